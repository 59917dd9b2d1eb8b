"""Does a source's hit at the previous position say more about its next proposal than the match
length already does? A replay against the target's greedy output on the 26 held-out prompts (96
tokens): for prompt lookup and the datastore, how often the first proposal is right, by the
matched length (a source of its own for `auto`) and by whether the same source's proposal at
the previous position was right (which a drafter could check at run time for a lookup's cost).

    python3 scripts/probes/streak_replay.py
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import torch

import specdec
from specdec.bench.ceiling import datastore_runs, lookup_runs
from specdec.bench.suite import load_suite, render
from specdec.drafters import find_match

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"


def main() -> None:
    torch.set_num_threads(2)
    target = specdec.load_model("smollm2-135m-instruct")
    store = specdec.load_datastore("smollm2-135m-instruct")
    prompts = load_suite(HELDOUT)
    render(prompts, target, target.tokenizer)
    count = Counter()  # (source, matched length, hit at t-1, "steps" | "right")
    for p in prompts:
        out = specdec.generate(target, None, p.ids, 96).token_ids
        seq = p.ids + out
        runs = {"lookup": lookup_runs(p.ids, out, 16), "datastore": datastore_runs(store, p.ids, out, 16)}
        for t in range(2, len(out)):
            ids = seq[: len(p.ids) + t]
            match = {"lookup": find_match(np.asarray(ids), 3, 1), "datastore": store.match(ids)}
            for source, r in runs.items():
                if match[source]:
                    n = match[source][1] if source == "lookup" else min(match[source][0], 4)
                    count[source, n, r[t - 1] > 0, "steps"] += 1
                    count[source, n, r[t - 1] > 0, "right"] += r[t] > 0
    print("first proposal right (steps), by source, matched length (datastore: 4 = 4 or more) and "
          "whether the source was right at the previous position:")
    for source in ("lookup", "datastore"):
        for n in sorted({k[1] for k in count if k[0] == source}):
            cells = [f"after a {'hit' if hit else 'miss'} {count[source, n, hit, 'right'] / count[source, n, hit, 'steps']:.2f}"
                     f" ({count[source, n, hit, 'steps']})" for hit in (True, False) if count[source, n, hit, "steps"]]
            print(f"  {source} n = {n}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
