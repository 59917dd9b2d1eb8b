"""What a draft's one-token pass costs, as c (its time over the target's), on the native
kernel after 300 cached tokens, with the shipped draft's 8,192-token head list (a pass's
cost depends on the draft's shape, not on its weights: an untrained shape times the same).

    python3 scripts/probes/draft_cost.py NAME=PATH [NAME=PATH ...]
    e.g. python3 scripts/truncated_draft.py --layers 4 --out drafts-local/first4
         python3 scripts/probes/draft_cost.py shipped=smollm2-135m-instruct-draft four=drafts-local/first4
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

import specdec
from specdec.drafters import ModelDrafter

CACHED = 300


def main() -> None:
    torch.set_num_threads(2)
    head = specdec.load_model("smollm2-135m-instruct-draft").head_tokens
    models = {"target": specdec.load_model("smollm2-135m-instruct")}
    for arg in sys.argv[1:]:
        name, path = arg.split("=", 1)
        models[name] = ModelDrafter(specdec.load_model(path), head_tokens=head).model
    times = {name: [] for name in models}
    for _ in range(5):  # rounds over every model in turn, so that a noisy spell hits each alike
        for name, m in models.items():
            m.reset(CACHED + 4)
            m.forward(list(range(1000, 1000 + CACHED)), last_only=True)
            for _ in range(10):
                start = time.perf_counter()
                m.forward([7])
                times[name].append(time.perf_counter() - start)
                m.rollback(CACHED)
    t1 = statistics.median(times["target"])
    for name, t in times.items():
        print(f"{name:12s} {1e3 * statistics.median(t):6.3f} ms   c = {statistics.median(t) / t1:.3f}")


if __name__ == "__main__":
    main()
