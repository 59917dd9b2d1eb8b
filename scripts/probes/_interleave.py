"""The probes' shared timing loop: every method on every prompt, `trials` times, in the bench's
balanced orders (`specdec.bench.stats.interleaved_order`; before commit 05bb456 one order,
rotated: docs/benchmark.md "Method"), so that a noisy spell of the shared machine, and what
one method leaves behind for the next, hits each alike."""
from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import defaultdict
from types import SimpleNamespace

import torch

import specdec
from specdec.bench.stats import interleaved_order
from specdec.bench.suite import load_suite, render
from specdec.decoding import auto_k_max

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"


def interleaved(methods: dict, prompts, trials: int):
    """methods: name -> f(prompt ids) returning a Generation or a token list. Returns
    ({(name, prompt id): [seconds per token, a trial each]}, {name: [what f returned]})."""
    times, outputs = defaultdict(list), defaultdict(list)
    for trial in range(trials):
        for i, p in enumerate(prompts):
            for name in interleaved_order(list(methods), trial * len(prompts) + i):
                start = time.perf_counter()
                out = methods[name](p.ids)
                tokens = getattr(out, "token_ids", out)
                times[name, p.id].append((time.perf_counter() - start) / max(len(tokens), 1))
                outputs[name].append(out)
    return times, outputs


def print_over_baseline(times, prompts, baseline: str, names: list[str], trials: int, title: str = "") -> None:
    """Each method's speedup over `baseline` (per prompt, the medians of its trials), as a
    geometric mean over the prompts, then by category."""
    def geomean(xs):
        return math.exp(statistics.fmean(map(math.log, xs)))

    cats = defaultdict(list)
    print(f"{title}over {baseline}, geometric mean over {len(prompts)} prompts (median of {trials} trials each)")
    width = max(map(len, names))
    for name in names:
        ratios = [statistics.median(times[baseline, p.id]) / statistics.median(times[name, p.id]) for p in prompts]
        for p, r in zip(prompts, ratios):
            cats[name, p.category].append(r)
        print(f"  {name:{width}s} {geomean(ratios):.3f}x")
    print("by category: " + ", ".join(names))
    for cat in sorted({p.category for p in prompts}):
        print(f"  {cat:15s}" + "".join(f" {geomean(cats[name, cat]):6.2f}x" for name in names))


def heldout_args() -> argparse.Namespace:
    """The schedule probes' options: --trials, --max-tokens, --engine."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--engine", default="native", choices=["native", "llama.cpp"])
    return ap.parse_args()


def heldout_default(engine: str, max_tokens: int) -> SimpleNamespace:
    """What the schedule probes share: the default target on `engine`, the held-out
    Spec-Bench-mix prompts rendered for it, `auto`'s k_max there, plain decoding, and the
    default drafter (prompt lookup + the shipped datastore, or another drafter) at a given
    num_draft_tokens."""
    torch.set_num_threads(2)
    target = specdec.load_model("smollm2-135m-instruct", engine=engine)
    store = specdec.load_datastore("smollm2-135m-instruct")
    prompts = load_suite(HELDOUT)
    render(prompts, target, target.tokenizer)
    return SimpleNamespace(
        target=target, store=store, prompts=prompts,
        k_max=auto_k_max(target),  # as "auto" takes it
        plain=lambda ids: specdec.generate(target, None, ids, max_tokens),
        default=lambda ids, k, drafter=None: specdec.speculative_generate(
            target, drafter or specdec.CompositeDrafter(datastore=store), None, ids, max_tokens, num_draft_tokens=k))
