"""Other ways of proposing, replayed against the target's greedy output on the grounded
prompts, in tokens per verification pass at best (as the bench's ceilings, up to 16 drafts
a pass, drafting free; see specdec/bench/ceiling.py):

  latest match      prompt lookup as shipped: the most recent occurrence of the longest
                    suffix n-gram (n <= 3) proposes what followed it
  any match         the best of all the lookup's candidate continuations, chosen with
                    hindsight (what verifying every candidate at once, as a tree, could take)
  draft-guided      the first candidate whose first token is the draft model's greedy
                    choice; the draft's own proposal where none is
  composite rule    the latest match where there is one, else the draft (CompositeDrafter)
  lookup or draft   the better of the two at each pass (the bench's ceiling)

It generates the plain greedy outputs first (the default target, 128 tokens; a few minutes).

    python3 scripts/probes/replay_proposers.py [--categories rag,summarization,code_editing]
"""
from __future__ import annotations

import argparse
from collections import Counter, defaultdict

import numpy as np
import torch
from tqdm import tqdm

from specdec import ModelDrafter, generate, load_model, load_tokenizer
from specdec.bench.ceiling import agreeing, draft_choices, draft_runs, fewest_passes, lookup_runs
from specdec.bench.suite import load_suite, render

K_MAX = 16


def candidates(seq: list[int], max_ngram: int = 3) -> list[int]:
    """Where each earlier occurrence of a suffix n-gram's continuation starts, longest n first,
    latest first (the first is what NgramDrafter proposes)."""
    a, out = np.asarray(seq), []
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        hits = np.flatnonzero((np.lib.stride_tricks.sliding_window_view(a[:-1], n) == a[-n:]).all(axis=1))
        out += [int(h) + n for h in hits[::-1]]
    return out


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--categories", default="rag,summarization,code_editing")
    args = ap.parse_args()
    torch.set_num_threads(2)
    tok = load_tokenizer("smollm2-135m-instruct")
    target = load_model("smollm2-135m-instruct")
    drafter = ModelDrafter(load_model("smollm2-135m-instruct-draft"))
    prompts = load_suite(categories=args.categories.split(","))
    render(prompts, target, tok)
    rules = ["latest match", "any match", "draft-guided", "composite rule", "lookup or draft"]
    tokens, passes = Counter(), defaultdict(Counter)
    for p in tqdm(prompts, desc="prompts"):
        out = generate(target, tok, p.ids, 128).token_ids
        seq = p.ids + out
        lookup = lookup_runs(p.ids, out, K_MAX)
        predicted = draft_choices(drafter, seq)  # predicted[i]: its token after seq[:i + 1]
        drafted = draft_runs(drafter, p.ids, out, K_MAX, predicted)
        runs = {rule: [0] for rule in rules}
        for t in range(1, len(out)):
            ids, truth = seq[: len(p.ids) + t], out[t:]
            starts = candidates(ids)
            runs["latest match"].append(lookup[t])
            runs["any match"].append(max((agreeing(ids[s: s + K_MAX], truth) for s in starts), default=0))
            guided = next((s for s in starts if ids[s] == predicted[len(ids) - 1]), None)
            runs["draft-guided"].append(agreeing(ids[guided: guided + K_MAX], truth) if guided is not None
                                        else drafted[t])
            runs["composite rule"].append(lookup[t] if starts else drafted[t])
            runs["lookup or draft"].append(max(lookup[t], drafted[t]))
        for where in (p.category, "all"):
            tokens[where] += len(out) - 1
            for rule in rules:
                passes[rule][where] += fewest_passes(runs[rule])
    wheres = sorted(w for w in tokens if w != "all") + ["all"]
    print("tokens per verification pass at best:", " ".join(f"{w:>14s}" for w in wheres))
    for rule in rules:
        print(f"  {rule:16s}", " ".join(f"{tokens[w] / passes[rule][w]:14.2f}" for w in wheres))


if __name__ == "__main__":
    main()
