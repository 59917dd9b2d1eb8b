"""Would a datastore of the target's own writing draft where prompt lookup finds nothing?
A replay, not a drafter.

Prompt lookup proposes what followed the context's last n-gram in the prompt, so it pays
only where the output copies the input. Retrieval drafting (REST, He et al. 2024) looks
the same suffix up in a corpus instead, and proposes the continuation most matches share.
The corpus here is what the target wrote for `specdec distill` (its replies only, greedy
and sampled; no bench prompt is in that data). Looking it up is a binary search, so it
drafts for free, like prompt lookup.

It replays, greedy, against the target's own output on the 26 held-out prompts: tokens
per verification pass at best (as the bench's ceilings, `specdec.bench.ceiling`), for
each source alone, for the composite's rule (lookup where it matches, else the draft),
and for the datastore put between the two.

    python3 scripts/probes/datastore_replay.py [--data DIR ...] [--k-max 4]
"""
from __future__ import annotations

import argparse
from collections import Counter, defaultdict

import numpy as np
import torch
from tqdm import tqdm

import specdec
from specdec.bench.ceiling import agreeing, draft_choices, draft_runs, fewest_passes, lookup_runs
from specdec.bench.suite import load_suite, render
from specdec.distill import load_data
from specdec.drafters import find_match

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"
GAP = 0xFFFF  # between replies: no token has this id (vocabularies here are under 65,535)


class Datastore:
    """Token sequences in one array, with a suffix order over their first 8 tokens."""

    def __init__(self, replies: list[np.ndarray], max_ngram: int = 8, min_ngram: int = 2, max_hits: int = 256):
        self.max_ngram, self.min_ngram, self.max_hits = max_ngram, min_ngram, max_hits
        self.tokens = np.concatenate([np.append(r, GAP) for r in replies]).astype(np.int64)
        padded = np.concatenate([self.tokens, np.full(8, GAP)])
        cols = [padded[i: i + len(self.tokens)] for i in range(8)]
        # Two 64-bit keys, 4 tokens of 16 bits each: their order is the suffixes' order.
        self.hi = (cols[0] << 48) | (cols[1] << 32) | (cols[2] << 16) | cols[3]
        self.lo = (cols[4] << 48) | (cols[5] << 32) | (cols[6] << 16) | cols[7]
        self.order = np.lexsort((self.lo, self.hi))
        self.hi, self.lo = self.hi[self.order], self.lo[self.order]

    def _range(self, gram: list[int]) -> tuple[int, int]:
        """Suffixes that start with gram (len 1..8), as a slice of self.order."""
        def bounds(keys, part, lo, hi):
            n = len(part)
            key = 0
            for t in part:
                key = (key << 16) | t
            shift = 16 * (4 - n)
            return (lo + int(np.searchsorted(keys[lo:hi], key << shift, "left")),
                    lo + int(np.searchsorted(keys[lo:hi], ((key + 1) << shift) - 1, "right")))
        lo, hi = bounds(self.hi, gram[:4], 0, len(self.hi))
        if len(gram) > 4 and hi > lo:
            lo, hi = bounds(self.lo, gram[4:], lo, hi)
        return lo, hi

    def propose(self, ids: list[int], k: int) -> tuple[list[int], int]:
        """The continuation most hits share, token by token, after the longest suffix of ids
        (max_ngram down to min_ngram tokens) found in the store, and that suffix's length;
        ([], 0) where none is."""
        for n in range(min(self.max_ngram, len(ids)), self.min_ngram - 1, -1):
            lo, hi = self._range(ids[-n:])
            if hi > lo:
                starts = self.order[lo: min(hi, lo + self.max_hits)] + n
                out = []
                for _ in range(k):
                    nxt = self.tokens[np.minimum(starts, len(self.tokens) - 1)]
                    nxt = nxt[nxt != GAP]
                    if not nxt.size:
                        break
                    values, counts = np.unique(nxt, return_counts=True)
                    best = values[counts.argmax()]
                    out.append(int(best))
                    starts = starts[self.tokens[np.minimum(starts, len(self.tokens) - 1)] == best] + 1
                return out, n
        return [], 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", nargs="+", default=["drafts-local/specbench-mix/data", "drafts-local/self-mix/data"])
    ap.add_argument("--k-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--min-ngram", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(2)
    replies = {}
    for d in args.data:
        for e in load_data(d):  # the same prompt in two runs: keep one copy of each reply
            reply = e.tokens[e.prompt_len:].numpy()
            replies[reply.tobytes()] = reply
    store = Datastore(list(replies.values()), min_ngram=args.min_ngram)
    print(f"datastore: {len(replies)} replies, {len(store.tokens):,} tokens, from {', '.join(args.data)}")
    target = specdec.load_model("smollm2-135m-instruct")
    drafter = specdec.ModelDrafter(specdec.load_model("smollm2-135m-instruct-draft"))
    prompts = load_suite(HELDOUT)
    render(prompts, target, target.tokenizer)
    rules = ["lookup", "datastore", "draft", "lookup else draft", "lookup else datastore",
             "lookup, datastore, draft", "best of lookup, draft", "best of all three"]
    tokens, passes, first = Counter(), defaultdict(Counter), Counter()
    by_n = defaultdict(lambda: [0, 0, 0])  # suffix length found: steps, first draft right, drafts accepted
    K = args.k_max
    for p in tqdm(prompts, desc="prompts"):
        out = specdec.generate(target, None, p.ids, args.max_tokens).token_ids
        seq = p.ids + out
        look = lookup_runs(p.ids, out, K)
        drafted = draft_runs(drafter, p.ids, out, K, draft_choices(drafter, seq))
        runs = {rule: [0] for rule in rules}
        for t in range(1, len(out)):
            ids, truth = seq[: len(p.ids) + t], out[t:]
            matched = find_match(np.asarray(ids), 3, 1) is not None  # what the composite's lookup sees
            proposal, n_match = store.propose(ids, K)
            stored = agreeing(proposal, truth)
            by_n[n_match][0] += 1
            by_n[n_match][1] += stored > 0
            by_n[n_match][2] += stored
            first[(p.category, "tried")] += bool(proposal)
            first[(p.category, "right")] += stored > 0
            first[(p.category, "steps")] += 1
            for n0 in range(2, 9):
                runs.setdefault(f"lookup, store n>={n0}, draft", [0]).append(
                    look[t] if matched else stored if n_match >= n0 else drafted[t])
            for rule, n in (("lookup", look[t]), ("datastore", stored), ("draft", drafted[t]),
                            ("lookup else draft", look[t] if matched else drafted[t]),
                            ("lookup else datastore", look[t] if matched else stored),
                            ("lookup, datastore, draft", look[t] if matched else stored if proposal else drafted[t]),
                            ("best of lookup, draft", max(look[t], drafted[t])),
                            ("best of all three", max(look[t], drafted[t], stored))):
                runs[rule].append(n)
        for where in (p.category, "all"):
            tokens[where] += len(out) - 1
            for rule in runs:
                passes[rule][where] += fewest_passes(runs[rule])
    wheres = sorted(w for w in tokens if w != "all") + ["all"]
    print(f"tokens per verification pass at best, k <= {K}, {len(prompts)} held-out prompts, {args.max_tokens} tokens:")
    print(f"  {'':26s}" + "".join(f"{w[:10]:>11s}" for w in wheres))
    for rule in runs:
        print(f"  {rule:26s}" + "".join(f"{tokens[w] / passes[rule][w]:11.2f}" for w in wheres))
    cats = wheres[:-1]
    for key in ("tried", "right"):
        total = sum(first[(c, key)] for c in cats) / sum(first[(c, "steps")] for c in cats)
        print(f"  datastore {key:5s} (share of steps)" + "".join(
            f"{first[(c, key)] / first[(c, 'steps')]:11.2f}" for c in cats) + f"{total:11.2f}")

    print("  by the suffix length found: steps, first draft right, drafts accepted a step")
    for n in sorted(by_n):
        steps, right, acc = by_n[n]
        print(f"    n = {n}: {steps:5d} {right / steps:6.2f} {acc / steps:6.2f}")


if __name__ == "__main__":
    main()
