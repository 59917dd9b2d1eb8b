"""How often is the target's greedy token outside the draft's head list, and does scoring more
tokens at run time help the draft as trained?

The shipped draft scores only its 8,192 head tokens (`head_tokens.json`): where the target
writes any other token, the draft cannot propose it. This prints, per category of the
held-out Spec-Bench-mix prompts, the share of the target's greedy tokens outside the list,
then replays the draft (teacher-forced, as the bench's ceilings do) with its own list, the
list widened by the next most frequent tokens of a distill run's data, and all 49,152 tokens:
first drafts right and tokens per verification pass at k = 4.

    python3 scripts/probes/head_coverage.py [--data drafts-local/specbench-mix/data] [--max-tokens 96]
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

import specdec
from specdec import ModelDrafter, generate
from specdec.bench.ceiling import draft_runs
from specdec.bench.suite import load_suite, render
from specdec.distill import load_data

sys.path.insert(0, str(Path(__file__).parent))
from feature_draft_probe import passes_at_k  # noqa: E402

HELDOUT = Path(__file__).parents[2] / "specdec/bench/prompts/heldout-specbench-v1.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="drafts-local/specbench-mix/data",
                    help="a distill run's data folder, whose continuations rank the tokens added to the list")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(2)
    tok = specdec.load_tokenizer("smollm2-135m-instruct")
    target = specdec.load_model("smollm2-135m-instruct")
    draft = specdec.load_model("smollm2-135m-instruct-draft")
    own = [int(t) for t in draft.head_tokens]
    counts = Counter()
    for e in load_data(Path(args.data)):
        counts.update(e.tokens[e.prompt_len:].tolist())
    listed = set(own)
    extra = [t for t, _ in counts.most_common() if t not in listed]
    heads = {f"own ({len(own)})": own, f"+4096 ({len(own) + 4096})": own + extra[:4096],
             f"+all seen ({len(own) + len(extra)})": own + extra, "all (49152)": None}

    prompts = load_suite(HELDOUT)
    render(prompts, target, tok)
    outputs = {p.id: generate(target, tok, p.ids, args.max_tokens).token_ids for p in tqdm(prompts, desc="greedy outputs")}
    outside, total = Counter(), Counter()
    for p in prompts:
        total[p.category] += len(outputs[p.id])
        outside[p.category] += sum(t not in listed for t in outputs[p.id])
    print("share of the target's greedy tokens outside the draft's own head list")
    for c in sorted(total):
        print(f"  {c:16s} {outside[c] / total[c]:.3f}")
    print(f"  {'all':16s} {sum(outside.values()) / sum(total.values()):.3f}\n")

    print("| head list | first draft right | tokens/pass, k = 4 |\n|---|---:|---:|")
    for name, head in heads.items():
        drafter = ModelDrafter(draft, head_tokens=head)
        n = first = passes = 0
        for p in prompts:
            runs = draft_runs(drafter, p.ids, outputs[p.id], 16)
            n += len(outputs[p.id]) - 1
            first += sum(r > 0 for r in runs[1:])
            passes += passes_at_k(runs, 4)
        print(f"| {name} | {first / n:.3f} | {n / passes:.3f} |")


if __name__ == "__main__":
    main()
