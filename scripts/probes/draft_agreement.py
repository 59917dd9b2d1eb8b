"""Greedy agreement of draft models with the target on the bench suite's prompts.

The target writes its greedy continuation of each prompt; each draft then reads prompt +
continuation once (teacher forcing) and scores where its argmax, over its head list,
is the target's next token. This is the greedy acceptance rate of a first draft, measured
on prompts no draft trained on, without timing anything.

Usage: python3 scripts/probes/draft_agreement.py NAME=PATH [NAME=PATH ...] [--per-category 2] [--max-tokens 128]
       [--prompts FILE]   (a prompt file instead of the suite, e.g. specdec/bench/prompts/heldout-specbench-v1.jsonl)
"""
from __future__ import annotations

import argparse

import torch

import specdec
from specdec.bench.suite import load_suite, render
from specdec.drafters import ModelDrafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafts", nargs="+", metavar="NAME=PATH")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", default=None, help="a JSONL prompt file (default: the bundled suite)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = specdec.load_model("smollm2-135m-instruct")
    drafts = {name: ModelDrafter(specdec.load_model(path)) for name, path in (d.split("=", 1) for d in args.drafts)}
    prompts = load_suite(args.prompts, per_category=args.per_category)
    render(prompts, target, target.tokenizer)
    written = [(p.category, list(p.ids), specdec.generate(target, None, list(p.ids), args.max_tokens).token_ids)
               for p in prompts]
    for name, drafter in drafts.items():
        model, by_category = drafter.model, {}
        for category, prompt, completion in written:
            model.reset(len(prompt) + len(completion))
            logits = model.forward(prompt + completion)[len(prompt) - 1: -1]
            hits = int((logits.argmax(-1) == torch.tensor(completion)).sum())
            counts = by_category.setdefault(category, [0, 0])
            counts[0] += hits
            counts[1] += len(completion)
        total = sum(h for h, _ in by_category.values()) / sum(n for _, n in by_category.values())
        cats = ", ".join(f"{c} {h / n:.2f}" for c, (h, n) in by_category.items())
        print(f"{name}: {total:.3f} overall ({cats})")


if __name__ == "__main__":
    main()
