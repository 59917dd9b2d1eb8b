"""Does `auto` gain if its schedule keeps what it learned on earlier requests? On the held-out
Spec-Bench-mix prompts: the default composite drafter with a fresh schedule per call (what
`num_draft_tokens="auto"` does) against one `AdaptiveK` carried from prompt to prompt (what
passing the same AdaptiveK does), and the draft model alone both ways; each over plain
decoding, paired per prompt, interleaved. Greedy, so the outputs are identical.

    python3 scripts/probes/warm_schedule.py [--trials 2] [--max-tokens 96] [--draft NAME_OR_PATH]
"""
from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict

import torch

import specdec
from _interleave import interleaved
from specdec import CompositeDrafter, ModelDrafter, generate, speculative_generate
from specdec.bench.suite import load_suite, render
from specdec.schedule import AdaptiveK

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--draft", default="smollm2-135m-instruct-draft")
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = specdec.load_model("smollm2-135m-instruct")
    draft = specdec.load_model(args.draft)
    prompts = load_suite(HELDOUT)
    render(prompts, target, target.tokenizer)
    warm = {"composite": AdaptiveK(), "draft": AdaptiveK()}  # carried across every call
    drafters = {"composite": CompositeDrafter(draft), "draft": ModelDrafter(draft)}
    methods = {"plain": lambda ids: generate(target, None, ids, args.max_tokens)}
    for name, d in drafters.items():
        methods[f"{name}, fresh"] = lambda ids, d=d: speculative_generate(target, d, None, ids, args.max_tokens)
        methods[f"{name}, warm"] = lambda ids, d=d, s=warm[name]: speculative_generate(
            target, d, None, ids, args.max_tokens, num_draft_tokens=s)
    times, _ = interleaved(methods, prompts, args.trials)  # (method, prompt) -> seconds per token
    cats = defaultdict(list)
    print(f"over plain decoding, geometric mean over {len(prompts)} prompts (median of {args.trials} trials each)")
    for name in methods:
        if name == "plain":
            continue
        ratios = [statistics.median(times["plain", p.id]) / statistics.median(times[name, p.id]) for p in prompts]
        for p, r in zip(prompts, ratios):
            cats[name, p.category].append(r)
        print(f"  {name:18s} {math.exp(statistics.fmean(map(math.log, ratios))):.2f}x")
    print("by category:")
    for cat in sorted({p.category for p in prompts}):
        print(f"  {cat:15s}" + "".join(f"  {name} {math.exp(statistics.fmean(map(math.log, cats[name, cat]))):.2f}x"
                                       for name in methods if name != "plain"))


if __name__ == "__main__":
    main()
