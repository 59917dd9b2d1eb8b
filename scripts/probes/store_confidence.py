"""Does the datastore's own confidence make a sharper source for `auto`? The store votes over
up to 256 occurrences of the context's suffix; the share that votes for its first proposal
says how sure it is. First, a replay against the target's greedy output on the 26 held-out
prompts: how often the first proposal is right, by suffix length and share. Then the default
drafter (prompt lookup + datastore) where, for each W, a first proposal with a share below W is
a source of its own for `auto` ("store{n}-weak"; W = 0 splits nothing: the shipped drafter),
over plain decoding, paired per prompt, interleaved. Greedy, so every output is the same.

    python3 scripts/probes/store_confidence.py [--engine native|llama.cpp] [--trials 2] [--max-tokens 96]
        [--weak-below 0 0.4 0.6]
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np
import torch

import specdec
from _interleave import interleaved, print_over_baseline
from specdec import CompositeDrafter, DatastoreDrafter, NgramDrafter, generate, speculative_generate
from specdec.bench.ceiling import agreeing
from specdec.bench.suite import load_suite, render
from specdec.datastore import MAX_HITS

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"


def first_share(store, found) -> float:
    """The share of the occurrences `continuation` votes over that go on with its first token."""
    n, lo, hi = found
    nxt = store.tokens[store.order[np.linspace(lo, hi - 1, min(hi - lo, MAX_HITS)).astype(np.int64)] + n]
    live = nxt[nxt != store.gap]
    return float(np.unique(live, return_counts=True)[1].max()) / len(nxt) if live.size else 0.0


class SplitStore(DatastoreDrafter):
    """The shipped datastore drafter, with its weak first proposals a source of their own."""

    def __init__(self, store, weak_below: float):
        super().__init__(store)
        self.weak_below = weak_below

    def sources(self, ids, row=0):
        found = self._match(ids, row)
        if not found:
            return ()
        return (f"store{found[0]}{'-weak' if first_share(self.store, found) < self.weak_below else ''}",)


def replay(target, store, prompts, max_tokens) -> None:
    by = defaultdict(lambda: [0, 0])  # (suffix length, share bucket): steps, first proposal right
    for p in prompts:
        out = generate(target, None, p.ids, max_tokens).token_ids
        seq = p.ids + out
        for t in range(1, len(out)):
            found = store.match(seq[: len(p.ids) + t])
            if found:
                key = (min(found[0], 4), min(int(first_share(store, found) * 5), 4))
                by[key][0] += 1
                by[key][1] += agreeing(store.continuation(found, 1), out[t:]) > 0
    print("first proposal right, by suffix length (4: 4 or more) and the share voting for it:")
    print("  n   " + "".join(f"  {b / 5:.1f}-{(b + 1) / 5:.1f}" for b in range(5)))
    for n in sorted({k[0] for k in by}):
        print(f"  {n}   " + "".join(f"  {by[n, b][1] / by[n, b][0]:.2f} ({by[n, b][0]:3d})" if by[n, b][0] else "          "
                                   for b in range(5)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--weak-below", type=float, nargs="+", default=[0.0, 0.4, 0.6])
    ap.add_argument("--engine", default="native", choices=["native", "llama.cpp"])
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = specdec.load_model("smollm2-135m-instruct", engine=args.engine)
    store = specdec.load_datastore("smollm2-135m-instruct")
    prompts = load_suite(HELDOUT)
    render(prompts, target, target.tokenizer)
    replay(target, store, prompts, args.max_tokens)
    n = args.max_tokens
    methods = {"plain": lambda ids: generate(target, None, ids, n)}
    for w in args.weak_below:
        methods[f"default, weak below {w}"] = lambda ids, w=w: speculative_generate(
            target, CompositeDrafter(lookup=NgramDrafter(), datastore=SplitStore(store, w)), None,
            ids, n)
    times, _ = interleaved(methods, prompts, args.trials)  # (method, prompt) -> seconds per token
    names = [m for m in methods if m != "plain"]
    print_over_baseline(times, prompts, "plain", names, args.trials)


if __name__ == "__main__":
    main()
