"""Would a small tree pay for the draft? A replay, not a drafter.

The simplest tree keeps the draft's greedy chain d1..dk and adds, at each depth i, the
draft's next m - 1 most likely tokens as leaves (siblings of d_i that attend to the prefix
and d1..d_{i-1}). Where the target rejects d_i but writes one of its siblings, the step
keeps that sibling and the target's token after it: one more token than the chain alone.

This replays that rule, greedy, against the target's own output on the 26 held-out
prompts (teacher forcing: the draft's top-8 at every position of prompt + output in one
pass), and prints tokens per verification pass for chain length k and m candidates a
depth (m = 1: the chain alone). A pass then holds 1 + k * m tokens; what those cost is
`scripts/probes/verify_cost.py`'s table.

    python3 scripts/probes/sibling_replay.py [DRAFT]   (default: the shipped draft)
"""
from __future__ import annotations

import sys

import torch

import specdec
from specdec.bench.suite import load_suite, render

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"


def passes(ranks: list[int], k: int, m: int) -> int:
    """Verification passes over an output whose token t the draft ranked ranks[t] (0: its argmax)."""
    i = n = 0
    while i < len(ranks):
        n += 1
        j = 0
        while j < k and i + j < len(ranks) and ranks[i + j] == 0:
            j += 1
        if j < k and i + j < len(ranks) and 0 < ranks[i + j] < m:  # a sibling is the target's token
            j += 1
        i += j + 1  # and the target's own token after the last one kept
    return n


def main() -> None:
    torch.set_num_threads(2)
    target = specdec.load_model("smollm2-135m-instruct")
    draft = specdec.load_model(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct-draft")
    prompts = load_suite(HELDOUT)
    render(prompts, target, target.tokenizer)
    ranks = []
    for p in prompts:
        out = specdec.generate(target, None, p.ids, 96).token_ids
        seq = p.ids + out
        draft.reset(len(seq))
        top = draft.forward(seq)[len(p.ids) - 1: len(seq) - 1].topk(8, dim=-1).indices
        ranks.append([int((top[i] == tok).nonzero()[0]) if (top[i] == tok).any() else 8 for i, tok in enumerate(out)])
    total = sum(map(len, ranks))
    print(f"tokens per verification pass, {len(prompts)} held-out prompts, {total} target tokens:")
    for k in (1, 2, 3, 4):
        print(f"  k = {k}: " + "  ".join(f"m = {m}: {total / sum(passes(r, k, m) for r in ranks):.2f}"
                                         for m in (1, 2, 3, 4, 8)))


if __name__ == "__main__":
    main()
