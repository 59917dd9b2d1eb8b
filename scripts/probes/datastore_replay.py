"""Would a datastore of the target's own writing draft where prompt lookup finds nothing?
A replay of `specdec.datastore` against the target's greedy output.

Prompt lookup proposes what followed the context's last n-gram in the prompt, so it pays
only where the output copies the input. Retrieval drafting (REST, He et al. 2024) looks
the same suffix up in a corpus instead, and proposes the continuation most matches share.
The corpus is the shipped datastore (what the target wrote for two `specdec distill` runs,
its replies only; no bench prompt is in that data), or one written from the data of the
runs given. Looking it up is a binary search, so it drafts for free, like prompt lookup.

It replays, greedy, against the target's own output on the 26 held-out prompts: tokens
per verification pass at best (as the bench's ceilings, `specdec.bench.ceiling`), for
each source alone, for the composite's rule (lookup where it matches, else the draft),
and for the datastore put between the two.

    python3 scripts/probes/datastore_replay.py [--runs DISTILL_RUN ...] [--k-max 4]
"""
from __future__ import annotations

import argparse
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import specdec
from specdec.bench.ceiling import agreeing, draft_choices, draft_runs, fewest_passes, lookup_runs
from specdec.bench.suite import load_suite, render
from specdec.distill import write_datastore
from specdec.drafters import find_match

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", default=None, help="distill runs whose data to store (default: the shipped store)")
    ap.add_argument("--k-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.runs:
        path = Path(tempfile.mkdtemp()) / "store.safetensors"
        store = specdec.Datastore.load(write_datastore([Path(r) / "data" for r in args.runs], path, 49152))
    else:
        store = specdec.load_datastore("smollm2-135m-instruct")
    print(f"datastore: {len(store):,} tokens, from {', '.join(args.runs or ['the shipped store'])}")
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
            found = store.match(ids)
            proposal, n_match = (store.continuation(found, K), found[0]) if found else ([], 0)
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
