"""The benchmark harness: load, warm up, run interleaved trials, check outputs, aggregate.

Method: every method gets the same rendered prompts, max_tokens, target weights, dtype,
thread count and stopping policy (the target's EOS ids). Model loading and the first
(cold) call of each method are timed apart from the trials. Trials interleave methods
in balanced orders (each method right after each other one equally often), so slow drift of a
shared machine, and whatever one method leaves behind for the next, hits all methods alike. Each
prompt's time per token is the median over trials; speedups are paired per prompt
(baseline time per token / method time per token) and averaged geometrically, with a
bootstrap CI.
"""
from __future__ import annotations

import functools
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import __version__
from ..bridge import needs_bridge
from ..datastore import load_datastore
from ..decoding import auto_k_max
from ..drafters import CompositeDrafter, ModelDrafter, NgramDrafter
from ..models import kernel
from ..models.loading import ENGINES, gguf_for, hf_checkpoint, load_model, resolve_dtype
from ..models.registry import DEFAULT_MODEL, LLAMA_CPP_ONLY, default_engine
from ..schedule import AdaptiveK
from . import methods as M
from .ceiling import ceilings
from .interference import MachineLoad, others, rerun_stalls, snapshot
from .stats import interleaved_order, predicted_speedup, summarize_ratios
from .suite import load_suite, render

SCHEMA = "specdec-bench/1"


@dataclass
class BenchConfig:
    model: str = DEFAULT_MODEL
    engine: str = "native"  # what runs the target and the draft: "native" or "llama.cpp"
    draft: str | None = None  # a draft model (name or path); the n-gram drafter always runs
    datastore: str | None = None  # a datastore file, or an embedded target's name for its shipped one
    dtype: str | None = None
    device: str = "cpu"
    threads: int | None = None
    prompts: str | None = None  # JSONL; default: the bundled suite
    categories: list[str] | None = None
    per_category: int | None = None
    max_tokens: int = 128
    trials: int = 3
    # num_draft_tokens values to run for each drafter: integers and/or "auto" (the API's default).
    ks: list = field(default_factory=lambda: ["auto"])
    temperature: float = 0.0  # 0 is greedy; outputs are then checked against the baseline
    top_k: int | None = None
    top_p: float | None = None
    peers: bool = True  # transformers' generate / assisted / prompt lookup
    llama_cpp_peers: bool = True  # llama.cpp's own generation (and, on that engine, its prompt lookup), if installed
    batch_sizes: list[int] | None = None  # run the batched study (bench/batched.py) at these B instead
    # Serving endpoints (bench/serving.py) instead of local models: "NAME=URL" each.
    endpoints: list[str] | None = None
    concurrency: list[int] = field(default_factory=lambda: [1])  # requests in flight, per level
    request_rate: float | None = None  # Poisson arrivals of this many requests a second (None: a closed loop)
    ignore_eos: bool = False  # fix the output length at max_tokens, where the server supports it
    request_timeout: float = 300.0  # seconds, per request
    quick: bool = False

    @classmethod
    def quick_config(cls, **overrides) -> "BenchConfig":
        """A smoke run for CI and newcomers: one prompt per category, short outputs."""
        base = dict(per_category=1, max_tokens=48, trials=3, quick=True)  # 3: the fewest a stall cannot move
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.trials < 1:
            raise ValueError(f"trials must be >= 1, got {self.trials}")
        bad = [k for k in self.ks if k != "auto" and (not isinstance(k, int) or isinstance(k, bool) or k < 1)]
        if not self.ks or bad:
            raise ValueError(f"num_draft_tokens values must be integers >= 1 or 'auto', got {self.ks}")
        self.ks = sorted({k for k in self.ks if k != "auto"}) + ["auto"] * ("auto" in self.ks)
        if self.batch_sizes is not None:
            if not self.batch_sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1
                                           for b in self.batch_sizes):
                raise ValueError(f"batch sizes must be integers >= 1, got {self.batch_sizes}")
            if self.engine != "native":
                raise ValueError(f"batch sizes need an engine that batches (native), not {self.engine}")
            self.batch_sizes = sorted(set(self.batch_sizes))
        if self.endpoints is not None:
            from .serving import parse_endpoint

            names = [parse_endpoint(e).name for e in self.endpoints]
            if not names or len(set(names)) != len(names):
                raise ValueError(f"endpoint names must be given and distinct, got {names}")
        if not self.concurrency or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency levels must be integers >= 1, got {self.concurrency}")
        self.concurrency = sorted(set(self.concurrency))
        if self.request_rate is not None and not (isinstance(self.request_rate, (int, float)) and
                                                  0 < self.request_rate < float("inf")):
            raise ValueError(f"request rate must be a positive number of requests a second, got {self.request_rate}")
        if not self.request_timeout > 0:
            raise ValueError(f"request timeout must be > 0 seconds, got {self.request_timeout}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        from ..request import check_sampling

        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device cuda requested but no CUDA GPU is available")

    @property
    def fixed_ks(self) -> list[int]:
        return [k for k in self.ks if k != "auto"]


def _version_of(distribution: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(cfg: BenchConfig, dtype) -> dict:
    import transformers

    def git_commit():
        try:
            return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                  cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None

    cpu, fields = platform.processor() or platform.machine(), {}
    try:  # the first processor's fields: a VM's model name alone ("Intel(R) Xeon(R) Processor") says little
        for line in Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0].splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    cpu = fields.get("model name", cpu)
    cpu_id = (f"family {fields['cpu family']}, model {fields['model']}"
              if "cpu family" in fields and "model" in fields else None)
    return {
        "cpu": cpu, "cpu_id": cpu_id, "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if cfg.device.startswith("cuda") else None,
        "device": cfg.device, "dtype": None if dtype is None else str(dtype).replace("torch.", ""),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "engine": cfg.engine, "llama_cpp_python": _version_of("llama-cpp-python"),
        "native_kernel": kernel.isa() if cfg.engine == "native" and dtype in (torch.bfloat16, torch.int8)
        and cfg.device == "cpu" else None,
        "specdec": __version__, "git_commit": git_commit(), "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


# Verify costs measured in every run, beside the fixed k values asked for: what `auto` weighs.
VERIFY_KS = (1, 2, 4, 8)
# transformers' prompt lookup as its documentation runs it (and our llama.cpp peer's lookup too).
HF_PROMPT_LOOKUP_K = 10
# transformers' assisted generation starts its heuristic schedule from num_assistant_tokens (default 20).
HF_ASSISTANT_TOKENS = 20


def forward_ms(model, sizes, context: int = 256, rounds: int = 5, reps: int = 3) -> dict[int, float]:
    """Median time of one forward pass of n tokens after `context` cached tokens, for each n in
    `sizes`, measured in rounds over all sizes so that a noisy spell hits every size alike."""
    sizes = sorted(set(sizes))
    model.reset(context + max(sizes))
    model.forward(list(range(1, context + 1)), last_only=True)
    times = {n: [] for n in sizes}
    for r in range(rounds + 1):
        for n in sizes:
            for _ in range(reps):
                M._sync(model.device)
                t0 = time.perf_counter()
                model.forward(list(range(1, n + 1)))
                M._sync(model.device)
                if r:  # the first round warms up
                    times[n].append(time.perf_counter() - t0)
                model.rollback(context)
    return {n: statistics.median(t) * 1000 for n, t in times.items()}


def measure_costs(target, drafts: dict, ks, k_max: int) -> dict:
    """Cost ratio c per draft model; the target's pass over n tokens vs 1 token for every n up
    to k_max + 1 (what the ceilings' perfect schedule pays), and its verify cost for k+1 tokens."""
    ks = sorted({*ks, *VERIFY_KS})
    ms = forward_ms(target, range(1, max(k_max, *ks) + 2))
    t1 = ms[1]
    out = {"target_forward_ms": t1, "pass_cost": {str(n): ms[n] / t1 for n in sorted(ms)},
           "verify_cost": {str(k): ms[k + 1] / t1 for k in ks}, "drafts": {}}
    for name, model in drafts.items():
        d1 = forward_ms(model, [1])[1]
        out["drafts"][name] = {"forward_ms": d1, "c": d1 / t1}
    return out


def build_methods(cfg: BenchConfig, target, draft_model, hf, hf_draft, llama_gguf=None, n_ctx=None,
                  store=None) -> list[M.Method]:
    # n_ctx: llama.cpp's own loops, whose context must leave room past the longest request:
    # its speculative loop writes a block of drafts before it checks the context's end.
    # A fixed seed: each prompt's sampled output is the same in every trial, so trials time the same work.
    sp = dict(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=0)
    ks = cfg.ks
    # The composite's parts run alone too: prompt lookup, lookup + the datastore, the draft.
    drafters = {"ngram": NgramDrafter}
    if store is not None:
        drafters["store"] = lambda: CompositeDrafter(datastore=store)
    if draft_model is not None:
        drafters.update(draft=lambda: ModelDrafter(draft_model),
                        composite=lambda: CompositeDrafter(draft_model, datastore=store))
    methods: list[M.Method] = [M.Normal(target, sp)]
    methods += [M.Speculative(target, make(), name, k, sp) for name, make in drafters.items() for k in ks]
    if hf is not None:
        eos, fixed = target.eos_token_ids, cfg.fixed_ks
        mid_k = fixed[len(fixed) // 2] if fixed else None  # the peers' fixed k: ours where we run one
        methods.append(M.hf_generate(hf, eos, sp))
        # Prompt lookup as transformers users run it, and at our fixed k where we run one.
        methods += [M.hf_prompt_lookup(hf, eos, sp, k) for k in dict.fromkeys([HF_PROMPT_LOOKUP_K, mid_k]) if k]
        if hf_draft is not None:
            methods.append(M.hf_assisted_default(hf, hf_draft, eos, sp, "draft"))
            if mid_k:
                methods.append(M.hf_assisted_constant(hf, hf_draft, eos, sp, "draft", mid_k))
            methods.append(M.hf_assisted_heuristic(hf, hf_draft, eos, sp, "draft", mid_k or HF_ASSISTANT_TOKENS))
    if llama_gguf is not None:  # the runtime a CPU user would pick instead, on the same weights
        peer = dict(eos_ids=target.eos_token_ids, n_ctx=n_ctx, threads=torch.get_num_threads())
        methods.append(M.LlamaCpp(LLAMA_CPP_BASELINE, llama_gguf, **peer))
        if cfg.engine == "native":  # what a CPU user runs instead: llama.cpp's fastest plain decoding here
            methods.append(M.LlamaCpp(LLAMA_CPP_Q8, gguf_for(cfg.model, file_type="q8_0"), **peer))
        if cfg.engine == "llama.cpp":
            methods.append(M.LlamaCpp(f"llama.cpp-prompt-lookup-k{HF_PROMPT_LOOKUP_K}", llama_gguf,
                                      lookup_k=HF_PROMPT_LOOKUP_K, **peer))
    return methods


def llama_cpp_peer_file(cfg: BenchConfig, target, dtype):
    """The GGUF file llama.cpp's own methods run, or None where they do not run: the
    engine's own file, or on the native engine the same weights written as GGUF (greedy
    runs on a CPU with llama-cpp-python installed)."""
    if not cfg.llama_cpp_peers or cfg.temperature > 0 or cfg.device != "cpu" or not _version_of("llama-cpp-python"):
        return None
    if cfg.engine == "llama.cpp":
        return target.path
    return gguf_for(cfg.model, dtype)


def load_hf(name, dtype, device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_checkpoint(name)), dtype=dtype, use_safetensors=True).to(device).eval()


def _last_logits(model, ids) -> torch.Tensor:
    model.reset(len(ids) + 1)
    return model.forward(ids, last_only=True)[-1]


def divergence(target, prompt_ids, ref: list[int], mine: list[int], reference=None) -> dict:
    """Where two greedy outputs part (`ref`, the baseline's; `mine`, a method's) and, unless
    one is a prefix of the other, the target's margins there (`top2_margin`)."""
    j = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), min(len(mine), len(ref)))
    out = {"position": j, "baseline_len": len(ref), "method_len": len(mine)}
    if j < min(len(mine), len(ref)):
        out.update(top2_margin(target, prompt_ids, ref[:j], ref[j], mine[j], reference))
    return out


def top2_margin(target, prompt_ids, prefix, ours: int, theirs: int, reference=None) -> dict:
    """At a divergence (the baseline wrote `ours`, the method `theirs`): the target's logit
    gap between its top two tokens there, and between its choice and the method's token.

    It is a tie when a gap is within a few rounding steps of the model's dtype at the
    logit's magnitude: one pass over a block of tokens and one token at a time round
    differently, and in bf16 one step at a logit of 20 is already 0.125. Over hundreds of
    cached tokens the rounding of a bf16 pass adds up to more than a few steps, though, so
    where the gaps are wider `reference()` (the target in float32) settles it: see
    `float32_check`.
    """
    logits = _last_logits(target, prompt_ids + prefix)
    top = torch.topk(logits, 2)
    top2, to_theirs = float(top.values[0] - top.values[1]), float(logits.max() - logits[theirs])
    low_precision = target.dtype in (torch.bfloat16, torch.float16)
    if low_precision:
        tolerance = 4 * torch.finfo(target.dtype).eps * 2.0 ** math.floor(math.log2(max(abs(float(top.values[0])), 1e-6)))
    else:
        tolerance = 1e-3
    out = {"top2_margin": top2, "margin_to_theirs": to_theirs, "tie_tolerance": tolerance,
           "tie": min(top2, to_theirs) <= tolerance}
    if not out["tie"] and low_precision and reference is not None:
        out.update(float32_check(logits, _last_logits(reference(), prompt_ids + prefix), ours, theirs))
    return out


def float32_check(logits: torch.Tensor, exact: torch.Tensor, ours: int, theirs: int) -> dict:
    """Is a low-precision divergence rounding? `exact`: the same position in float32.

    float32_gap: how much float32 prefers the baseline's token to the method's (negative:
    it prefers the method's). rounding_shift: how much the low-precision pass itself moved
    that gap away from float32's. A tie when the shift is at least the gap: the rounding of
    one pass is enough to swap the two tokens, so either is the target's greedy choice up to
    rounding. A bug (a wrong position, a stale cache entry) picks a token float32 ranks far
    below, by more than rounding moves it.
    """
    gap = float(exact[ours] - exact[theirs])
    shift = float((logits[ours] - exact[ours]) - (logits[theirs] - exact[theirs]))
    return {"float32_gap": gap, "rounding_shift": shift, "tie": gap <= abs(shift)}


def run_benchmark(cfg: BenchConfig, progress: bool = True, log=print) -> dict:
    threads = torch.get_num_threads()
    try:
        return _run(cfg, progress, log)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: BenchConfig, progress: bool, log) -> dict:
    from tqdm.auto import tqdm

    cfg.validate()
    prompts = load_suite(cfg.prompts, cfg.categories, cfg.per_category)
    if cfg.endpoints:  # nothing local: the servers run the models
        from .serving import run_endpoints

        return {"schema": SCHEMA, "serving": run_endpoints(cfg, prompts, progress, log),
                "environment": environment(cfg, None), "config": asdict(cfg)}
    if cfg.batch_sizes and len(prompts) < max(cfg.batch_sizes):
        raise ValueError(f"batch size {max(cfg.batch_sizes)} needs at least as many prompts; the selection has "
                         f"{len(prompts)}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(0)
    dtype = resolve_dtype(cfg.dtype, cfg.device)
    load_s = {}
    t0 = time.perf_counter()
    target = load_model(cfg.model, dtype=dtype, device=cfg.device, engine=cfg.engine)
    load_s["target"] = time.perf_counter() - t0
    if target.tokenizer is None:
        raise ValueError(f"{cfg.model} has no tokenizer; the benchmark renders text prompts")
    draft_model = None
    if cfg.draft:
        t0 = time.perf_counter()
        draft_model = load_model(cfg.draft, dtype=dtype, device=cfg.device, engine=default_engine(cfg.draft, cfg.engine))
        load_s["draft"] = time.perf_counter() - t0
    store = load_datastore(cfg.datastore) if cfg.datastore else None
    hf = hf_draft = None
    if cfg.peers and not cfg.batch_sizes and cfg.model in LLAMA_CPP_ONLY:
        log(f"transformers peers skipped: {cfg.model} has no transformers checkpoint here")
    elif cfg.peers and not cfg.batch_sizes and dtype == torch.int8:
        log("transformers peers skipped: int8 weights are the native engine's (llama.cpp's peer runs Q8_0)")
    elif cfg.peers and not cfg.batch_sizes:
        t0 = time.perf_counter()
        hf = load_hf(cfg.model, dtype, cfg.device)
        # (A draft only llama.cpp runs has no transformers form: the assisted peers then skip.)
        hf_draft = load_hf(cfg.draft, dtype, cfg.device) if cfg.draft and cfg.draft not in LLAMA_CPP_ONLY else None
        load_s["transformers"] = time.perf_counter() - t0

    log(f"rendering {len(prompts)} prompts ...")
    render(prompts, target, target.tokenizer)
    if cfg.batch_sizes:
        from .batched import run_batch_study

        batched = run_batch_study(cfg, prompts, target, draft_model, progress, log, store)
        return {"schema": SCHEMA, "batched": batched, "environment": environment(cfg, dtype), "config": asdict(cfg),
                "load_seconds": load_s}
    llama_gguf = llama_cpp_peer_file(cfg, target, dtype)
    methods = build_methods(cfg, target, draft_model, hf, hf_draft, llama_gguf,
                            n_ctx=max(len(p.ids) for p in prompts) + cfg.max_tokens + 64, store=store)
    # The draft as it drafts: through ModelDrafter, with the head its checkpoint lists (if any).
    k_max = max([AdaptiveK().k_max, *cfg.fixed_ks])
    costs = measure_costs(target, {"draft": ModelDrafter(draft_model).model} if draft_model is not None else {},
                          cfg.fixed_ks, k_max)

    # Cold latency: each method's first call, on the first prompt, outside the trials.
    cold = {}
    for m in methods:
        cold[m.name] = m.run(prompts[0].ids, cfg.max_tokens).seconds

    def trial(m, p, n):
        before = snapshot()
        r = m.run(p.ids, cfg.max_tokens)
        return {"method": m.name, "prompt": p.id, "trial": n, "seconds": r.seconds,
                "prefill_seconds": r.prefill_seconds, "tokens": r.token_ids, "stats": r.stats,
                **others(before, snapshot())}

    if cfg.trials < 3:
        log(f"{cfg.trials} trial(s): a prompt's median is then a mean, which one stalled trial can move")
    load = MachineLoad().start()
    records = []
    bar = tqdm(total=cfg.trials * len(prompts) * len(methods), desc="bench", unit="run", disable=not progress)
    for n in range(cfg.trials):
        for pi, p in enumerate(prompts):
            for m in interleaved_order(methods, n * len(prompts) + pi):
                records.append(trial(m, p, n))
                bar.update()
    bar.close()
    by_name, by_id = {m.name: m for m in methods}, {p.id: p for p in prompts}
    unclean = rerun_stalls(records, lambda r: trial(by_name[r["method"]], by_id[r["prompt"]], r["trial"]), log)
    for i in unclean:
        records[i]["unclean"] = True
    machine = load.stop({m.name: (sum("stalled_seconds" in r for r in records if r["method"] == m.name),
                                  sum(r["method"] == m.name for r in records),
                                  sum(records[i]["method"] == m.name for i in unclean)) for m in methods})
    if machine["busy"]:
        log("the machine was busy: " + "; ".join(machine["reasons"]))
    report = aggregate(cfg, prompts, methods, records, costs, cold, target)
    report["machine"] = machine
    if cfg.temperature == 0:  # the replay needs the target's greedy output
        outputs = {r["prompt"]: r["tokens"] for r in records if r["method"] == "normal" and r["trial"] == 0}
        # The replay feeds the draft target ids: not for a draft with another tokenizer.
        replayed = ModelDrafter(draft_model) if draft_model is not None else None
        if replayed is not None and needs_bridge(target, replayed, target.tokenizer):
            replayed = None
        plain = {i: (r["seconds"], r["prefill"] or 0.0) for i, r in _per_prompt(records, "normal", prompts).items()}
        report["ceilings"] = ceilings(prompts, outputs, k_max, replayed, store,
                                      {int(n): v for n, v in costs["pass_cost"].items()},
                                      draft_cost(report["methods"], costs), plain,
                                      auto_k_max(target) if "auto" in cfg.ks else None)
    report.update(schema=SCHEMA, environment=environment(cfg, dtype), config=asdict(cfg), load_seconds=load_s)
    return report


def draft_cost(methods: list[dict], costs: dict) -> dict | None:
    """What the ceilings charge a draft token: the draft model's time per drafted token in
    the loop, pooled over the methods that draft with it alone (`cost_ratio_c`'s measure), or
    where none ran, its warm pass measured apart (`costs.drafts`). None without a draft."""
    alone = [m["overall"] for m in methods if m["drafter"] == "draft" and m["overall"].get("drafted")]
    if alone:
        seconds, drafted = sum(o["draft_seconds"] for o in alone), sum(o["drafted"] for o in alone)
        return {"c": seconds / drafted / (costs["target_forward_ms"] / 1000), "measured": "in the loop"}
    if "draft" in costs["drafts"]:
        return {"c": costs["drafts"]["draft"]["c"], "measured": "apart, warm"}
    return None


def _per_prompt(records, method, prompts):
    """prompt id -> (median seconds, median seconds per token, median decode seconds per token
    after the first, tokens of trial 0, median prefill, stats of trial 0). A trial that met
    interference on every run is left out of the medians while a clean one is there."""
    out = {}
    for p in prompts:
        every = [r for r in records if r["method"] == method and r["prompt"] == p.id]
        first = min(every, key=lambda r: r["trial"])
        rows = [r for r in every if not r.get("unclean")] or every
        prefills = [r["prefill_seconds"] for r in rows if r["prefill_seconds"] is not None]
        # Per trial: off the bf16 kernel a run that drafts differently may round a near tie
        # the other way (docs/design.md, "Guarantees") and write an output of another length.
        per_token = statistics.median(r["seconds"] / max(len(r["tokens"]), 1) for r in rows)
        # The prefill pass is the same work with or without speculation; what follows it is
        # what a drafter can speed up (for short answers the prefill caps the end-to-end ratio).
        decode = None
        if len(prefills) == len(rows) and all(len(r["tokens"]) > 1 for r in rows):
            decode = statistics.median((r["seconds"] - r["prefill_seconds"]) / (len(r["tokens"]) - 1) for r in rows)
        out[p.id] = {"seconds": statistics.median(r["seconds"] for r in rows), "per_token": per_token,
                     "decode_per_token": decode,
                     "tokens": first["tokens"],
                     "first_seconds": first["seconds"],
                     "prefill": statistics.median(prefills) if prefills else None, "stats": first["stats"]}
    return out


def _spec_metrics(rows: list[dict]) -> dict:
    """Acceptance and cost metrics summed over prompts (stats and time of the same trial)."""
    st = [r["stats"] for r in rows if r["stats"]]
    seconds = sum(r["first_seconds"] for r in rows if r["stats"])
    if not st:
        return {}
    total = lambda key: sum(s[key] for s in st)  # noqa: E731
    width = max(len(s["proposed_at"]) for s in st)
    proposed = [sum(s["proposed_at"][i] for s in st if i < len(s["proposed_at"])) for i in range(width)]
    accepted = [sum(s["accepted_at"][i] for s in st if i < len(s["accepted_at"])) for i in range(width)]
    drafted, acc, rejections = total("drafted"), total("accepted"), total("rejections")
    steps = total("target_calls") - len(st)  # verification passes (prefills excluded)
    draft_s = sum(s["timings"]["draft"] for s in st)
    # What no timing holds: the loop's own work (context, sources, schedule, bookkeeping).
    loop_s = sum(r["first_seconds"] - sum(r["stats"]["timings"].values()) for r in rows if r["stats"])
    bridged = sum(s.get("drafter", {}).get("bridge_steps", 0) for s in st)
    extra = {}
    if bridged:  # a draft with another tokenizer: the share of its steps lost at a token boundary
        extra["boundary_loss_share"] = sum(s["drafter"]["boundary_misses"] for s in st) / bridged
    return extra | {
        "acceptance_rate": acc / drafted if drafted else math.nan,
        # MLE of Leviathan's per-token acceptance probability: each step accepts a geometric
        # run of drafts, ended by a rejection or by running out of drafts.
        "alpha": acc / (acc + rejections) if acc + rejections else math.nan,
        "tokens_per_target_call": total("generated") / total("target_calls"),
        "tokens_per_step": (total("generated") - len(st)) / steps if steps else math.nan,
        "accepted_per_position": [a / p if p else math.nan for a, p in zip(accepted, proposed)],
        "drafted": drafted, "accepted": acc, "target_calls": total("target_calls"),
        "plain_steps": total("plain_steps"),
        "draft_calls": total("draft_calls"), "verify_steps": steps,
        "mean_drafted_per_step": drafted / steps if steps else math.nan,
        "draft_time_share": draft_s / seconds if seconds else math.nan,
        "draft_seconds": draft_s,
        "loop_ms_per_pass": 1000 * loop_s / total("target_calls"),
    }


# llama.cpp's own plain decoding: where it ran, every method's speedup over it is reported too.
LLAMA_CPP_BASELINE = "llama.cpp-greedy"
# llama.cpp's plain decoding of the same weights quantized to Q8_0: its fastest configuration on
# these CPUs, which llama-server runs (its n-gram speculation gains nothing there).
LLAMA_CPP_Q8 = "llama.cpp-greedy-q8_0"


# The drafters made of others, and the parts each is compared with when run alone.
COMPOSITE_PARTS = {"store": ("ngram",), "composite": ("ngram", "store", "draft")}


def composite_vs_sources(methods, per_prompt: dict, prompts) -> dict:
    """Each composite drafter against its own parts at the same k (lookup + datastore against
    lookup alone; lookup + datastore + draft against lookup alone, lookup with the datastore
    and the draft alone, those that ran): per category, the fastest part there (by its
    geometric-mean speedup over plain decoding), and the composite's paired per-prompt speedup
    over it. Below 1.0 the composite loses to one of its own parts in that category.
    per_prompt: method name -> `_per_prompt` of it."""
    by_name = {(m.drafter, m.k): m.name for m in methods if m.family == "specdec"}
    out = {}
    for (drafter, k), name in by_name.items():
        parts = {d: by_name[d, k] for d in COMPOSITE_PARTS.get(drafter, ()) if (d, k) in by_name}
        if not parts:
            continue
        per, base = per_prompt, per_prompt["normal"]
        rows = {}
        for cat in sorted({p.category for p in prompts}) + ["overall"]:
            ids = [p.id for p in prompts if cat in ("overall", p.category)]
            speed = {d: summarize_ratios([base[i]["per_token"] / per[n][i]["per_token"] for i in ids])
                     for d, n in parts.items()}
            best = max(speed, key=lambda d: speed[d]["geomean"])
            rows[cat] = {"best_source": parts[best], "best_source_speedup": speed[best],
                         "ratio": summarize_ratios([per[parts[best]][i]["per_token"] / per[name][i]["per_token"]
                                                    for i in ids])}
        out[name] = rows
    return out


def aggregate(cfg, prompts, methods, records, costs, cold, target) -> dict:
    base = _per_prompt(records, "normal", prompts)
    llama = _per_prompt(records, LLAMA_CPP_BASELINE, prompts) if any(
        m.name == LLAMA_CPP_BASELINE for m in methods) else None
    cats = sorted({p.category for p in prompts})
    t1 = costs["target_forward_ms"] / 1000
    out_methods = []

    @functools.cache
    def reference():  # the target in float32, loaded only if a divergence needs it
        return load_model(cfg.model, dtype=torch.float32, device=cfg.device, engine=cfg.engine)

    per_prompt = {}
    for m in methods:
        per = per_prompt[m.name] = _per_prompt(records, m.name, prompts)
        ratios = {pid: base[pid]["per_token"] / v["per_token"] for pid, v in per.items()}
        vs_llama = {pid: llama[pid]["per_token"] / v["per_token"] for pid, v in per.items()} if llama else None
        decode_ratios = {pid: base[pid]["decode_per_token"] / v["decode_per_token"] for pid, v in per.items()
                         if v["decode_per_token"] and base[pid]["decode_per_token"]}
        seconds = sum(v["seconds"] for v in per.values())
        tokens = sum(len(v["tokens"]) for v in per.values())
        prefills = [v["prefill"] for v in per.values() if v["prefill"] is not None]
        overall = {"speedup": summarize_ratios(list(ratios.values())), "tokens": tokens, "seconds": seconds,
                   "tokens_per_s": tokens / seconds, "ms_per_token": 1000 * seconds / tokens}
        if vs_llama:
            overall["vs_llama_cpp"] = summarize_ratios(list(vs_llama.values()))
        if prefills:
            prefill_s = sum(prefills)
            overall["prefill_ms_mean"] = 1000 * prefill_s / len(prefills)
            overall["decode_ms_per_token"] = 1000 * (seconds - prefill_s) / max(tokens - len(prefills), 1)
        if decode_ratios:
            overall["decode_speedup"] = summarize_ratios(list(decode_ratios.values()))
        overall.update(_spec_metrics(list(per.values())))
        if m.family == "specdec" and not math.isnan(overall.get("alpha", math.nan)):
            # The drafter's time in the loop, not a warm pass measured apart: a draft model's
            # first pass after a target pass reads its weights from memory again (3-4x the warm
            # pass on a CPU), and it catches up on the tokens it did not draft.
            if m.k == "auto" or m.drafter in costs["drafts"]:  # per drafted token
                c = overall["draft_seconds"] / max(overall["drafted"], 1) / t1
            else:  # a model-free drafter at fixed k: per proposal slot, relative to a target pass
                c = overall["draft_seconds"] / max(overall["verify_steps"], 1) / m.k / t1
            overall["cost_ratio_c"] = c
            if m.k != "auto":  # auto has no single k to predict from
                v = costs["verify_cost"].get(str(m.k), 1.0)
                overall.update(verify_cost=v, predicted_speedup=predicted_speedup(overall["alpha"], m.k, c, v))
        by_cat = {}
        for cat in cats:
            ids = [p.id for p in prompts if p.category == cat]
            entry = {"speedup": summarize_ratios([ratios[i] for i in ids])}
            if vs_llama:
                entry["vs_llama_cpp"] = summarize_ratios([vs_llama[i] for i in ids])
            if all(i in decode_ratios for i in ids):
                entry["decode_speedup"] = summarize_ratios([decode_ratios[i] for i in ids])
            if all(per[i]["prefill"] is not None for i in ids):  # what no drafter can speed up
                entry["prefill_share"] = sum(per[i]["prefill"] for i in ids) / sum(per[i]["seconds"] for i in ids)
            entry.update({key: val for key, val in _spec_metrics([per[i] for i in ids]).items()
                          if key in ("acceptance_rate", "alpha", "tokens_per_target_call", "tokens_per_step",
                                     "accepted_per_position")})
            by_cat[cat] = entry
        mismatches = []
        if m.name != "normal" and cfg.temperature == 0:
            for p in prompts:
                mine, ref = per[p.id]["tokens"], base[p.id]["tokens"]
                if mine == ref:
                    continue
                mismatches.append({"prompt": p.id} | divergence(target, p.ids, ref, mine, reference))
        out_methods.append({**m.describe(), "cold_seconds": cold[m.name], "overall": overall,
                            "categories": by_cat, "mismatches": mismatches})
    return {"methods": out_methods, "costs": costs, "composite_vs_sources": composite_vs_sources(methods, per_prompt, prompts),
            "prompts": [{"id": p.id, "category": p.category, "grounded": p.grounded, "prompt_tokens": len(p.ids)}
                        for p in prompts],
            "records": [{k: v for k, v in r.items() if k != "tokens"} | {"n_tokens": len(r["tokens"])}
                        for r in records]}
