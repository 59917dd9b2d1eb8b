"""The native engine's weights and KV cache on 2 MB pages (specdec/models/pages.py) against the
same on ordinary 4 KB pages: the target loaded twice in one process, one copy with the pages
module's allocator swapped for torch's. Pass times after 300 cached, then plain decoding and the
default drafter (prompt lookup + the shipped datastore, `auto`) end to end on the held-out
Spec-Bench-mix prompts, all interleaved, so a noisy spell hits both alike. Greedy: both copies
must give the same tokens. Backs docs/kernels.md, "Weights on 2 MB pages".

    python3 scripts/probes/huge_pages.py [--rounds 40] [--trials 2] [--max-tokens 96]
"""
from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

import specdec
from _interleave import interleaved, print_over_baseline
from specdec import CompositeDrafter, generate, speculative_generate
from specdec.bench.suite import load_suite, render
from specdec.models import pages

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"


def anon_huge_kb() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(2)
    before = anon_huge_kb()
    huge = specdec.load_model("smollm2-135m-instruct")
    huge.reset(2048)
    print(f"AnonHugePages: {before} kB before, {anon_huge_kb()} kB with one copy on 2 MB pages")
    with mock.patch.object(pages, "_zeros_bytes", lambda n: torch.zeros(n, dtype=torch.uint8)):
        small = specdec.load_model("smollm2-135m-instruct")
        small.reset(2048)  # large enough that no call below makes another cache
    print(f"AnonHugePages with the second copy on ordinary pages: {anon_huge_kb()} kB")
    models = {"2 MB pages": huge, "4 KB pages": small}

    ms = {(name, n): [] for name in models for n in (1, 5)}
    for m in models.values():
        m.reset(2048)
        m.forward(list(range(100, 400)), last_only=True)
    for _ in range(args.rounds):
        for n in (1, 5):
            for name, m in models.items():
                m.rollback(300)
                t = time.perf_counter()
                m.forward(list(range(5, 5 + n)))
                ms[name, n].append((time.perf_counter() - t) * 1e3)
    print(f"ms a pass after 300 cached, median of {args.rounds}")
    for n in (1, 5):
        a, b = (statistics.median(ms[name, n]) for name in models)
        print(f"  {n} token(s): 2 MB pages {a:.2f}, 4 KB pages {b:.2f}, ratio {a / b:.3f}")

    store = specdec.load_datastore("smollm2-135m-instruct")
    prompts = load_suite(HELDOUT)
    render(prompts, huge, huge.tokenizer)
    methods = {}
    for name, m in models.items():
        methods[f"{name} plain"] = lambda ids, m=m: generate(m, None, ids, args.max_tokens)
        methods[f"{name} default"] = lambda ids, m=m: speculative_generate(
            m, CompositeDrafter(datastore=store), None, ids, args.max_tokens)
    times, outs = interleaved(methods, prompts, args.trials)
    first = next(iter(outs.values()))
    assert all([o.token_ids for o in out] == [o.token_ids for o in first] for out in outs.values())
    print_over_baseline(times, prompts, "4 KB pages plain", list(methods), args.trials)
    print_over_baseline(times, prompts, "4 KB pages default", ["2 MB pages default"], args.trials, title="paired: ")


if __name__ == "__main__":
    main()
