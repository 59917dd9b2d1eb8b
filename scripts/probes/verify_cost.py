"""What a verification pass costs as it grows: the default target's forward over n tokens
after 300 cached ones, relative to one token. A tree of candidate continuations, or a long
proposal, is paid for here.

    python3 scripts/probes/verify_cost.py
"""
from __future__ import annotations

import statistics
import time

import torch

import specdec

SIZES = (1, 2, 5, 9, 17, 25, 33, 49)
CACHED = 300


def main() -> None:
    torch.set_num_threads(2)
    target = specdec.load_model("smollm2-135m-instruct")
    target.reset(CACHED + max(SIZES))
    target.forward(list(range(1000, 1000 + CACHED)), last_only=True)
    times = {n: [] for n in SIZES}
    for _ in range(3):  # rounds over all sizes, so that a noisy spell hits every size alike
        for n in SIZES:
            for _ in range(6):
                start = time.perf_counter()
                target.forward(list(range(5, 5 + n)))
                times[n].append(time.perf_counter() - start)
                target.rollback(CACHED)
    one = statistics.median(times[1])
    print(f"tokens in the pass, ms (median of 18), cost in one-token passes ({target.dtype}, {CACHED} cached)")
    for n in SIZES:
        ms = statistics.median(times[n])
        print(f"  {n:3d} {ms * 1e3:7.1f} {ms / one:5.2f}")


if __name__ == "__main__":
    main()
