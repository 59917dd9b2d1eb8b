"""Command line: `specdec generate`, `specdec serve`, `specdec demo`, `specdec bench`, `specdec distill`.

User mistakes end with a one-line message and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from . import decoding, request
from .models.registry import DEFAULT_MODEL


class CLIError(Exception):
    """A user mistake: printed as one line."""


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    port = _int(text)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"a port is 1-65535, got {port}")
    return port


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _k(text: str):
    return "auto" if text == "auto" else _positive_int(text)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


class TextStream:
    """Prints decoded text as token ids arrive; holds back an incomplete UTF-8 character."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self._out = tokenizer, out
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        out = self._out or sys.stdout  # looked up late: stdout may be redirected after import
        out.write(text[self.printed:])
        out.flush()
        self.printed = len(text)


def draft_model_arg(args) -> str | None:
    """--draft as given, else the shipped draft of an embedded target (None if it has none)."""
    from .models.registry import DEFAULT_DRAFTS

    return args.draft if args.draft is not None else DEFAULT_DRAFTS.get(str(args.model))


def resolve_draft(args) -> str:
    """--draft's default for generate/demo: prompt lookup (with the target's datastore, where one
    ships: the fastest drafter measured for the default target, docs/results.md), else the
    shipped draft with prompt lookup, else prompt lookup."""
    from .models.registry import SHIPPED_DATASTORES

    if args.draft is not None:
        return args.draft
    shipped = draft_model_arg(args)
    return f"composite:{shipped}" if shipped and str(args.model) not in SHIPPED_DATASTORES else "ngram"


def datastore_arg(args) -> str | None:
    """--datastore: a file, 'none', or (not given) the embedded target's name where a datastore ships for it."""
    from .models.registry import SHIPPED_DATASTORES

    if args.datastore == "none" or (args.datastore is None and str(args.model) not in SHIPPED_DATASTORES):
        return None
    return args.datastore or str(args.model)


def load_datastore_arg(args):
    from .datastore import load_datastore

    name = datastore_arg(args)
    return load_datastore(name) if name else None


def make_drafter(spec: str, target, dtype, engine: str = "native", datastore=None):
    """--draft: 'ngram', 'none', a model name/path, or 'composite:MODEL' (lookup, else the datastore's
    continuation, else the model). A datastore (None: none) joins the prompt lookup of 'ngram' and
    'composite:MODEL'."""
    from .drafters import CompositeDrafter, ModelDrafter, NgramDrafter
    from .models.loading import load_model
    from .models.registry import default_engine

    if spec == "none":
        return None
    if spec == "ngram":
        return CompositeDrafter(datastore=datastore) if datastore else NgramDrafter()
    name = spec.removeprefix("composite:")
    # A draft only llama.cpp runs (gemma-3-270m) runs there whatever the target's engine.
    model = load_model(name, dtype=dtype, device=target.device, engine=default_engine(name, engine))
    if spec.startswith("composite:"):
        return CompositeDrafter(model, datastore=datastore)
    return ModelDrafter(model)


def check_draft_exists(spec: str) -> None:
    """Fail on a missing draft path before spending seconds loading the target."""
    from .models.loading import hf_checkpoint
    from .models.registry import LLAMA_CPP_ONLY, assembled_gguf

    name = spec.removeprefix("composite:")
    if name in LLAMA_CPP_ONLY:
        assembled_gguf(name)  # its package is installed (else a one-line error naming it)
    elif spec not in ("ngram", "none"):
        hf_checkpoint(name)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"target: embedded name, checkpoint dir or .gguf (default {DEFAULT_MODEL})")
    p.add_argument("--engine", choices=["native", "llama.cpp"], default=None, help="what runs the models: "
                   "our torch implementation (the default) or llama.cpp (pip install 'specdec[llamacpp]'; the "
                   "default for a model only it runs, such as gemma-3-270m)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "int8"], default=None,
                   help="default: bfloat16 where the CPU has native bf16, else float32; int8: weights as int8 with a "
                   "bf16 scale per 32, computed in bf16 (half the bytes a token reads; a Q8_0 file on llama.cpp)")
    p.add_argument("--device", default="cpu")


def load_target_and_drafter(args, without_tokenizer: str):
    """--model and --draft/--datastore as generate and serve take them; a missing draft or
    datastore fails before the target loads."""
    from .models.loading import load_model

    draft = resolve_draft(args)
    check_draft_exists(draft)
    store = load_datastore_arg(args)
    target = load_model(args.model, dtype=args.dtype, device=args.device, engine=args.engine)
    if target.tokenizer is None:
        raise CLIError(f"{args.model} ships no tokenizer; {without_tokenizer}")
    return target, make_drafter(draft, target, args.dtype, args.engine, store)


def cmd_generate(args) -> int:

    params = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                  chat=not args.no_chat)
    # Cheap checks first, so a typo fails in milliseconds, not after loading a model.
    request.check_sampling(args.temperature, args.top_k, args.top_p)
    request.check_max_tokens(args.max_tokens)
    request.check_seed(args.seed)
    if not args.prompt:
        raise ValueError("prompt is empty")
    target, drafter = load_target_and_drafter(args, "use the Python API with token ids")
    stream = TextStream(target.tokenizer)
    start = time.perf_counter()
    if drafter is None:
        result = decoding.generate(target, target.tokenizer, args.prompt, args.max_tokens, stream=stream, **params)
    else:
        result = decoding.speculative_generate(target, drafter, target.tokenizer, args.prompt, args.max_tokens,
                                               num_draft_tokens=args.num_draft_tokens, stream=stream, **params)
    seconds = time.perf_counter() - start
    s = result.stats
    summary = f"[{s.generated} tokens, {s.generated / seconds:.1f} tok/s, finish={result.finish_reason}"
    if drafter is not None:
        summary += f", acceptance {s.acceptance_rate:.2f}, {s.tokens_per_target_call:.2f} tokens/target call"
    print(file=sys.stdout)
    print(summary + "]", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from .batcher import Batcher
    from .server import serve

    if args.engine != "native":
        raise CLIError(f"serve runs on the native engine (continuous batching), not {args.engine}")
    target, drafter = load_target_and_drafter(args, "serve needs one")
    batcher = Batcher(target, drafter, max_batch=args.max_batch, context=args.context, queue_size=args.queue_size,
                      num_draft_tokens=args.num_draft_tokens)
    try:
        serve(batcher, str(args.model), args.host, args.port, args.shutdown_timeout,
              log=lambda text: print(text, file=sys.stderr, flush=True))
    except OSError as exc:
        raise CLIError(str(exc)) from None
    return 0


# A code edit: the answer copies most of the input, the case prompt lookup is made for.
DEMO_PROMPT = """Add type hints to this Python function and return the full edited code.

```python
def average_rating(reviews, minimum_votes):
    total = 0
    count = 0
    for review in reviews:
        if review["votes"] >= minimum_votes:
            total += review["stars"]
            count += 1
    if count == 0:
        return None
    return total / count
```"""


def cmd_demo(args) -> int:
    """Normal vs speculative decoding on the embedded default: outputs, match, speedup, acceptance."""
    from .models.loading import load_model

    draft = resolve_draft(args)
    if draft == "none":
        raise CLIError("the demo compares against a draft: --draft must not be 'none'")
    check_draft_exists(draft)
    store = load_datastore_arg(args)
    print(f"loading {args.model} ...", file=sys.stderr)
    target = load_model(args.model, dtype=args.dtype, device=args.device, engine=args.engine)
    drafter = make_drafter(draft, target, args.dtype, args.engine, store)
    tok = target.tokenizer
    run_normal = lambda: decoding.generate(target, tok, DEMO_PROMPT, args.max_tokens, chat=True)  # noqa: E731
    run_spec = lambda: decoding.speculative_generate(  # noqa: E731
        target, drafter, tok, DEMO_PROMPT, args.max_tokens, num_draft_tokens=args.num_draft_tokens, chat=True)
    from tqdm.auto import tqdm

    bar = tqdm(total=2 * (args.trials + 1), desc="demo", unit="run", file=sys.stderr)
    run_normal(), run_spec()  # warmup: first calls pay for allocation and kernel selection
    bar.update(2)
    times = {"normal": [], "speculative": []}
    results = {}
    for trial in range(args.trials):
        # Alternate the order so drift on a shared machine hits both methods alike.
        order = [("normal", run_normal), ("speculative", run_spec)]
        for name, fn in order if trial % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - t0)
            bar.update()
    bar.close()
    normal, spec = results["normal"], results["speculative"]
    t_n, t_s = statistics.median(times["normal"]), statistics.median(times["speculative"])
    print("=== normal decoding ===\n" + normal.text)
    print(f"=== speculative decoding ({drafter!r}, k={args.num_draft_tokens}) ===\n" + spec.text)
    print("=== summary ===")
    print(f"outputs match token for token: {spec.token_ids == normal.token_ids}")
    if spec.token_ids != normal.token_ids:
        print(_explain_divergence(normal, spec, target, args))
    print(f"normal      {t_n * 1000:7.0f} ms  ({len(normal.token_ids) / t_n:.1f} tok/s)")
    print(f"speculative {t_s * 1000:7.0f} ms  ({len(spec.token_ids) / t_s:.1f} tok/s)")
    # Per token, as the benchmark does: after a tie the two outputs can differ in length.
    speedup = (t_n / len(normal.token_ids)) / (t_s / len(spec.token_ids))
    print(f"speedup {speedup:.2f}x in time per token (median of {args.trials} interleaved trials after a warmup)")
    st = spec.stats
    print(f"acceptance rate {st.acceptance_rate:.2f}, tokens per target call {st.tokens_per_target_call:.2f} "
          f"(normal decoding: 1.00), target calls {st.target_calls} vs {normal.stats.target_calls}")
    return 0


def _explain_divergence(normal, spec, target, args) -> str:
    """Where two greedy outputs part, and whether the target's logits there make it a tie."""
    from .bench.runner import divergence
    from .models.loading import load_model

    v = divergence(target, normal.prompt_ids, normal.token_ids, spec.token_ids,
                   reference=lambda: load_model(args.model, dtype="float32", device=args.device, engine=args.engine))
    j = v["position"]
    if "tie" not in v:
        return f"  one output is a prefix of the other ({v['baseline_len']} vs {v['method_len']} tokens)"
    why = f"the target's top-2 logit margin there is {v['top2_margin']:.3g}"
    if "float32_gap" in v:
        dtype = str(target.dtype).removeprefix("torch.")
        why += (f"; in float32 the two tokens are {abs(v['float32_gap']):.3g} apart and {dtype} rounding "
                f"moves that gap by {abs(v['rounding_shift']):.3g}")
    verdict = ("a numerical tie: either token is the target's greedy choice up to rounding" if v["tie"]
               else "NOT a tie: a bug to report")
    return f"  they part at new token {j}: {why}, so {verdict}"


def _positive_ints(text: str) -> list[int]:
    values = [_positive_int(v.strip()) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected a comma-separated list of positive integers, e.g. 1,4,16")
    return values


def _k_list(text: str) -> list:
    values = [_k(v.strip()) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected a comma-separated list of k values ('auto' or integers)")
    return values


def cmd_bench(args) -> int:
    from .bench.report import print_summary, write_report
    from .bench.runner import BenchConfig, run_benchmark

    draft = None if args.endpoint else draft_model_arg(args)  # endpoints: the servers hold the models
    if draft is not None and not args.no_draft:
        check_draft_exists(draft)
    if not args.endpoint:
        load_datastore_arg(args)  # a missing or broken file fails now (loads are cached for the run)
    options = dict(model=args.model, engine=args.engine, draft=None if args.no_draft else draft,
                   datastore=None if args.endpoint else datastore_arg(args), dtype=args.dtype, device=args.device, threads=args.threads,
                   prompts=args.prompts, categories=args.categories.split(",") if args.categories else None,
                   per_category=args.per_category, max_tokens=args.max_tokens, trials=args.trials, ks=args.ks,
                   peers=not args.no_peers, llama_cpp_peers=not args.no_llama_cpp, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, batch_sizes=args.batch_sizes, endpoints=args.endpoint,
                   concurrency=args.concurrency, request_rate=args.request_rate, ignore_eos=args.ignore_eos or None,
                   request_timeout=args.request_timeout)
    cfg = BenchConfig.quick_config(**options) if args.quick else BenchConfig(
        **{k: v for k, v in options.items() if v is not None})
    cfg.validate()
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out} exists and is not a directory")
    report = run_benchmark(cfg, log=lambda msg: print(msg, file=sys.stderr))
    write_report(report, out)
    print_summary(report)
    print(f"report written to {out}/ (report.json, report.md, plots)", file=sys.stderr)
    return 0


def cmd_distill(args) -> int:
    from .train.distill import DistillConfig, distill
    from .models.loading import hf_checkpoint

    names = ("target", "out", "layers", "hidden", "intermediate", "prompts", "heldout", "max_new_tokens", "steps",
             "batch_tokens", "lr", "seed", "head_tokens", "threads", "mix")
    cfg = DistillConfig(**{n: getattr(args, n) for n in names}, command=["specdec", *sys.argv[1:]])
    cfg.check()
    hf_checkpoint(cfg.target)  # a missing target fails now, not after minutes
    out = distill(cfg)
    print(f"draft written to {out}/ (config.json, model.safetensors, train-log.jsonl)", file=sys.stderr)
    if args.ship:
        from .train.distill import export_shipped

        print(f"shippable form (without the target's shared weights) in {export_shipped(out, args.ship, cfg.target)}/",
              file=sys.stderr)
    return 0


def cmd_datastore(args) -> int:
    from .train.distill import write_datastore
    from .models.loading import hf_checkpoint

    runs = [Path(d) for d in args.runs]
    for run in runs:
        if not (run / "data").is_dir():
            raise CLIError(f"{run}: not a distill run directory (no data/ in it)")
    vocab = json.loads((hf_checkpoint(args.target) / "config.json").read_text())["vocab_size"]
    out = write_datastore([run / "data" for run in runs], Path(args.out), vocab, " ".join(["specdec", *sys.argv[1:]]))
    print(f"datastore written to {out}", file=sys.stderr)
    return 0


DATASTORE_HELP = ("a datastore for retrieval drafting beside prompt lookup (specdec datastore / distill write one), "
                  "or 'none'; default: the shipped one of an embedded target")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, streaming it, then print a summary line")
    g.add_argument("prompt")
    add_model_args(g)
    g.add_argument("--draft", default=None, help="'ngram' (prompt lookup, with --datastore), 'none' (plain "
                   "decoding), a model, or 'composite:MODEL' (prompt lookup when the context has a match, else the "
                   "datastore, else the model); default: 'ngram' with the shipped datastore for the default target")
    g.add_argument("--datastore", default=None, help=DATASTORE_HELP)
    g.add_argument("--num-draft-tokens", type=_k, default="auto", help="k, or 'auto' (the default: chosen each step "
                   "from measured acceptance and costs)")
    g.add_argument("--max-tokens", type=_int, default=128)
    g.add_argument("--temperature", type=_float, default=0.0)
    g.add_argument("--top-k", type=_positive_int, default=None)
    g.add_argument("--top-p", type=_float, default=None)
    g.add_argument("--seed", type=_int, default=None)
    g.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text, without the chat template")
    g.set_defaults(func=cmd_generate)

    v = sub.add_parser("serve", help="an OpenAI-compatible server with continuous batching (/v1/chat/completions, "
                       "/v1/completions, /v1/models, /health, /metrics)")
    add_model_args(v)
    v.add_argument("--draft", default=None, help="as for generate")
    v.add_argument("--datastore", default=None, help="as for generate")
    v.add_argument("--num-draft-tokens", type=_k, default="auto", help="as for generate")
    v.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=_port, default=8000)
    v.add_argument("--max-batch", type=_positive_int, default=16, help="requests decoded together (default 16)")
    v.add_argument("--context", type=_positive_int, default=4096, help="positions a request may use, prompt and "
                   "output (default 4096, at most the model's); the cache holds max-batch of them")
    v.add_argument("--queue-size", type=_positive_int, default=64, help="requests that may wait for a row; "
                   "past it a request gets 429 (default 64)")
    v.add_argument("--shutdown-timeout", type=_float, default=30.0, help="seconds a shutdown waits for the "
                   "requests in flight before cancelling them (default 30)")
    v.set_defaults(func=cmd_serve)

    d = sub.add_parser("demo", help="normal vs speculative decoding on the embedded default model")
    add_model_args(d)
    d.add_argument("--draft", default=None, help="as for generate")
    d.add_argument("--datastore", default=None, help="as for generate")
    d.add_argument("--num-draft-tokens", type=_k, default="auto")
    d.add_argument("--max-tokens", type=_positive_int, default=128)
    d.add_argument("--trials", type=_positive_int, default=3)
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="benchmark normal vs speculative decoding (and transformers) on a prompt suite")
    add_model_args(b)
    b.add_argument("--draft", default=None, help="a draft model (name or path; default: the shipped draft of "
                   "the default target); the n-gram drafter always runs")
    b.add_argument("--no-draft", action="store_true", help="no draft model: n-gram (and peers) only")
    b.add_argument("--datastore", default=None, help=DATASTORE_HELP + " (runs as 'store', lookup + datastore, and "
                   "in the composite)")
    b.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: torch's choice)")
    b.add_argument("--prompts", default=None, help="a JSONL prompt file (default: the bundled suite)")
    b.add_argument("--categories", default=None, help="comma-separated categories to run")
    b.add_argument("--per-category", type=_positive_int, default=None, help="at most this many prompts per category")
    b.add_argument("--max-tokens", type=_positive_int, default=None, help="default 128 (48 with --quick)")
    b.add_argument("--trials", type=_positive_int, default=None, help="default 3, the fewest whose median one stalled trial cannot move")
    b.add_argument("--num-draft-tokens", dest="ks", type=_k_list, default=None, help="k values to run for each "
                   "drafter: 'auto' (the default, as in the API) and/or integers, e.g. auto,2,4,8 for a k sweep")
    b.add_argument("--temperature", type=_float, default=None, help="0 (the default) is greedy")
    b.add_argument("--top-k", type=_positive_int, default=None)
    b.add_argument("--top-p", type=_float, default=None)
    b.add_argument("--no-peers", action="store_true", help="skip transformers' generate / assisted / prompt lookup")
    b.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp's own generation (run by default, "
                   "greedy on a CPU, where llama-cpp-python is installed)")
    b.add_argument("--batch-sizes", type=_positive_ints, default=None, help="run the batched study instead: "
                   "plain and speculative decoding of the prompts in batches of each size, e.g. 1,2,4,8,16 "
                   "(throughput, per-request latency, verify costs, the crossover)")
    b.add_argument("--endpoint", action="append", default=None, metavar="NAME=URL", help="benchmark a serving "
                   "endpoint (OpenAI-compatible, e.g. llama-server, vLLM, SGLang) instead of local models; repeat "
                   "to compare deployments, e.g. --endpoint plain=http://127.0.0.1:8080 --endpoint spec=http://...:8081 "
                   "(the first is the baseline)")
    b.add_argument("--concurrency", type=_positive_ints, default=None, help="with --endpoint: requests in flight, "
                   "per level, e.g. 1,4,16 (default 1)")
    b.add_argument("--request-rate", type=_float, default=None, help="with --endpoint: requests arrive as a Poisson "
                   "process of this many a second, at most --concurrency in flight, the same arrival times for every "
                   "endpoint (default: a closed loop, each level's requests all sent at once)")
    b.add_argument("--ignore-eos", action="store_true", help="with --endpoint: ask the servers to write max-tokens "
                   "tokens every time (ignore_eos)")
    b.add_argument("--request-timeout", type=_float, default=None, help="with --endpoint: seconds per request "
                   "(default 300)")
    b.add_argument("--quick", action="store_true", help="a smoke run: one prompt per category, short outputs")
    b.add_argument("--out", default="bench-out", help="directory for report.json, report.md and plots")
    b.set_defaults(func=cmd_bench)

    t = sub.add_parser("distill", help="train a small draft model on the target's own outputs (resumable)")
    t.add_argument("--target", default=DEFAULT_MODEL, help=f"embedded name, checkpoint dir or .gguf (default {DEFAULT_MODEL})")
    t.add_argument("--out", required=True, help="run directory: data, checkpoints, log, and the final draft")
    t.add_argument("--layers", type=_positive_int, default=2)
    t.add_argument("--hidden", type=_positive_int, default=None, help="width (default: the target's, sharing its "
                   "embeddings, frozen)")
    t.add_argument("--intermediate", type=_positive_int, default=None, help="MLP width (default: the target's)")
    t.add_argument("--prompts", type=_positive_int, default=1200, help="prompts the target answers (greedy and sampled)")
    t.add_argument("--heldout", type=_positive_int, default=48, help="of those, kept out to measure agreement")
    t.add_argument("--max-new-tokens", type=_positive_int, default=160)
    t.add_argument("--steps", type=_positive_int, default=3000)
    t.add_argument("--batch-tokens", type=_positive_int, default=4096, help="label positions per step")
    t.add_argument("--lr", type=_float, default=1e-3)
    t.add_argument("--seed", type=_int, default=0)
    t.add_argument("--head-tokens", type=_int, default=8192, help="tokens the draft's output head scores, in "
                   "training and drafting: the ones the target writes most (0: all; the checkpoint keeps the full head)")
    t.add_argument("--threads", type=_positive_int, default=None)
    t.add_argument("--mix", choices=("v1", "spec-bench", "self"), default="v1", help="training prompts: v1 (the "
                   "shipped draft's), spec-bench (also long articles, short QA, German news, role-play, writing, "
                   "reasoning, extraction) or self (half spec-bench, half user turns the target writes itself)")
    t.add_argument("--ship", default=None, help="also write the draft without the target's shared weights here "
                   "(how a draft ships in a package; rebuilt on first load)")
    t.set_defaults(func=cmd_distill)

    s = sub.add_parser("datastore", help="a datastore for retrieval drafting from distill runs' data: the "
                       "target's own replies (distill writes one per run too)")
    s.add_argument("runs", nargs="+", help="distill run directories (--out of specdec distill)")
    s.add_argument("--out", required=True, help="the datastore file to write (.safetensors)")
    s.add_argument("--target", default=DEFAULT_MODEL, help=f"the target the runs distilled (default {DEFAULT_MODEL})")
    s.set_defaults(func=cmd_datastore)

    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]  # the command, for recipes
    if getattr(args, "model", None) is not None and args.engine is None:
        from .models.registry import default_engine

        args.engine = default_engine(args.model)
    try:
        return args.func(args)
    except (CLIError, ValueError, TypeError, FileNotFoundError, ImportError) as exc:
        if os.environ.get("SPECDEC_DEBUG"):
            raise
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
