"""What the hidden-state head's own work costs a step in the real loop (docs/benchmark.md,
"The hidden-state head, built"): the default's drafter and the same with the shipped head,
one after the other on each of the 26 held-out prompts (96 greedy tokens, 2 threads); the
head's seconds inside the drafter (`CompositeDrafter._head_seconds`), the drafter's seconds
and the verify seconds, per target pass.

    python3 scripts/probes/head_overhead.py
"""
from __future__ import annotations

import torch

import specdec
from specdec import CompositeDrafter, speculative_generate
from specdec.bench.suite import load_suite, render

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"


def main() -> None:
    torch.set_num_threads(2)
    target = specdec.load_model("smollm2-135m-instruct")
    store = specdec.load_datastore("smollm2-135m-instruct")
    drafters = {"default": CompositeDrafter(datastore=store),
                "with the head": CompositeDrafter(datastore=store, head=specdec.load_head("smollm2-135m-instruct",
                                                                                            target))}
    prompts = load_suite(HELDOUT)
    render(prompts, target, target.tokenizer)
    speculative_generate(target, drafters["with the head"], None, prompts[0].ids, 16)  # warm up
    got = {name: dict(head=0.0, draft=0.0, verify=0.0, passes=0) for name in drafters}
    for p in prompts:
        for name, drafter in drafters.items():
            g = speculative_generate(target, drafter, None, p.ids, 96)
            row = got[name]
            row["head"] += drafter._head_seconds
            row["draft"] += g.stats.timings["draft"]
            row["verify"] += g.stats.timings["verify"]
            row["passes"] += g.stats.target_calls
    for name, row in got.items():
        n = row["passes"]
        print(f"{name:14s} {n} target passes; ms a pass: the head's work {1e3 * row['head'] / n:.3f}, "
              f"drafting {1e3 * row['draft'] / n:.3f}, verifying {1e3 * row['verify'] / n:.2f}")


if __name__ == "__main__":
    main()
