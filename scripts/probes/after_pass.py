"""What small numpy operations cost right after a kernel pass, against a second time in a row
(docs/benchmark.md, "The hidden-state head, built": its work a step costs more than its
arithmetic). A pass streams the target's 270 MB of weights through the caches; whatever runs
next starts cold. Each operation below runs once after a 3-token verify pass, then again at
once; the means over 100 passes, 2 threads. The last one is the shipped draft's one-token
pass as it drafts (its 8,192-token head): about 24 MB of weights, read again after each pass.
--sleep MS waits that long after each pass before the first run: if the cost came from the
kernel's OpenMP threads still spinning after the pass, a wait would remove it; if from the
caches the pass emptied, it would not.

    python3 scripts/probes/after_pass.py [--sleep MS]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import specdec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sleep", type=float, default=0.0, help="ms to wait after each pass")
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = specdec.load_model("smollm2-135m-instruct")
    target.reset(512)
    target.forward(list(range(100, 400)), last_only=True)
    draft = specdec.load_model("smollm2-135m-instruct-draft")  # as it drafts: its 8,192-token head
    draft.restrict_head(draft.head_tokens)
    draft.reset(512)
    draft.forward(list(range(100, 400)), last_only=True)

    def draft_pass(out):
        draft.rollback(300)
        return draft.forward([9])

    rng = np.random.default_rng(0)
    x, y = rng.random(576, dtype=np.float32), rng.random(576, dtype=np.float32)
    w = rng.random((576, 576), dtype=np.float32)
    ops = {"argmax of the pass's logits": lambda out: out.numpy().argmax(-1),
           "x + y (576)": lambda out: x + y, "exp(x)": lambda out: np.exp(x), "x / (1 + y)": lambda out: x / (1 + y),
           "576 x 576 matvec": lambda out: w @ x, "(x * y).sum()": lambda out: (x * y).sum(),
           "linspace(0, 100, 50)": lambda out: np.linspace(0, 100, 50), "unique of 50": lambda out: np.unique(x[:50]),
           "the shipped draft's pass": draft_pass}
    first, again = np.zeros(len(ops)), np.zeros(len(ops))
    n = 100
    for _ in range(n):
        target.rollback(300)
        out = target.forward([5, 6, 7])
        time.sleep(args.sleep / 1e3)
        for i, op in enumerate(ops.values()):
            t0 = time.perf_counter()
            op(out)
            t1 = time.perf_counter()
            op(out)
            first[i] += t1 - t0
            again[i] += time.perf_counter() - t1
    print(f"{'operation':30s} {'first since the pass':>22s} {'at once again':>14s}")
    for name, a, b in zip(ops, first, again):
        print(f"{name:30s} {a / n * 1e6:19.1f} us {b / n * 1e6:11.1f} us")


if __name__ == "__main__":
    main()
