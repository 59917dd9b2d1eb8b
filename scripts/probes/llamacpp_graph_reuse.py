"""What changing the block size costs on the llama.cpp engine: llama.cpp reuses its compute
graph when a pass has the shape of the one before, and builds it again when not. The bench
measures pass costs size by size, several passes of one size in a row (`runner.forward_ms`),
but speculative decoding's passes change size nearly every step (a plain step, then a block
of 3, then 2, ...). Per pair of sizes (a, b): the mean time of a pass in the sequence a, b, a,
b, ... against the mean of a, a, ... and b, b, ... run alone; the difference is what a change
of size adds to a pass. Rounds alternate the orders; medians over rounds.

    python3 scripts/probes/llamacpp_graph_reuse.py [--cached 200] [--rounds 6] [--passes 24]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec

PAIRS = ((1, 2), (1, 4), (2, 4), (3, 6))


def mean_pass(model, sizes: list[int], cached: int) -> float:
    """Mean seconds of a pass over the sizes in order, each pass rolled back after."""
    start = time.perf_counter()
    for n in sizes:
        model.forward(list(range(5, 5 + n)))
        model.rollback(cached)
    return (time.perf_counter() - start) / len(sizes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cached", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--passes", type=int, default=24, help="passes in each sequence")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = specdec.load_model("smollm2-135m-instruct", engine="llama.cpp")
    model.reset(args.cached + 16)
    model.forward(list(range(1000, 1000 + args.cached)), last_only=True)
    half = args.passes // 2
    runs = {(a, b): {"a": [], "b": [], "alternating": []} for a, b in PAIRS}
    for _ in range(args.rounds):
        for (a, b), r in runs.items():
            r["a"].append(mean_pass(model, [a] * args.passes, args.cached))
            r["alternating"].append(mean_pass(model, [a, b] * half, args.cached))
            r["b"].append(mean_pass(model, [b] * args.passes, args.cached))
    one = statistics.median(runs[PAIRS[0]]["a"])
    print(f"{model.path.name}, {args.cached} cached, {args.threads} threads: a one-token pass {one * 1e3:.2f} ms "
          f"(medians of {args.rounds} rounds of {args.passes} passes)")
    for (a, b), r in runs.items():
        same = (statistics.median(r["a"]) + statistics.median(r["b"])) / 2
        alt = statistics.median(r["alternating"])
        print(f"  sizes {a} and {b}: {alt * 1e3:6.2f} ms a pass alternating, {same * 1e3:6.2f} ms in runs of one "
              f"size; a change of size adds {(alt - same) * 1e3:5.2f} ms ({(alt - same) / one:+.1%} of a one-token pass)")


if __name__ == "__main__":
    main()
