"""Whether the output head over every row is what makes a block cost so much on the llama.cpp
engine: one pass of n tokens after --cached ones, with logits for every row (what a
verification needs) and with the last row's only (what llama-bench's pp test computes).
Rounds alternate the two; medians, as a multiple of the one-token pass.

To time another build of llama.cpp through the same bindings, point llama-cpp-python at its
libraries: LLAMA_CPP_LIB_PATH=<dir with libllama.so> python3 scripts/probes/llamacpp_logits.py

    python3 scripts/probes/llamacpp_logits.py [--cached 150] [--rounds 4]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec

SIZES = (1, 2, 5, 9, 17)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cached", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = specdec.load_model("smollm2-135m-instruct", engine="llama.cpp")
    model.reset(args.cached + max(SIZES))
    model.forward(list(range(1000, 1000 + args.cached)), last_only=True)
    times: dict[tuple[bool, int], list[float]] = {}
    for _ in range(args.rounds):
        for last_only in (False, True):
            for n in SIZES:
                for _ in range(3):
                    start = time.perf_counter()
                    model.forward(list(range(5, 5 + n)), last_only=last_only)
                    times.setdefault((last_only, n), []).append(time.perf_counter() - start)
                    model.rollback(args.cached)
    one = statistics.median(times[False, 1])
    print(f"{model.path.name}, {args.cached} cached, {args.threads} threads: a one-token pass {one * 1e3:.2f} ms")
    for last_only in (False, True):
        label = "the last row's logits" if last_only else "logits for every row"
        print(f"  {label:22s}" + "".join(f"  {n} tokens {statistics.median(times[last_only, n]) / one:.2f}x"
                                        for n in SIZES[1:]))


if __name__ == "__main__":
    main()
