"""Passes of one size on the llama.cpp engine, over and over, for a profiler to sample: which
of llama.cpp's kernels a block's time goes to. The bf16 target after --cached tokens, each pass
rolled back after; prints the median pass time.

    perf record -F 2000 -o /tmp/p5.data python3 scripts/probes/llamacpp_pass_loop.py 5
    perf report -i /tmp/p5.data --sort dso,symbol

Another build of llama.cpp through the same bindings: LLAMA_CPP_LIB_PATH=<dir with libllama.so>.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tokens", type=int, help="tokens a pass")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--cached", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = specdec.load_model("smollm2-135m-instruct", engine="llama.cpp")
    model.reset(args.cached + args.tokens)
    model.forward(list(range(1000, 1000 + args.cached)), last_only=True)
    ids, times = list(range(5, 5 + args.tokens)), []
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        model.forward(ids)
        times.append(time.perf_counter() - start)
        model.rollback(args.cached)
    print(f"{model.path.name}, {args.cached} cached, {args.threads} threads: {len(times)} passes of "
          f"{args.tokens} tokens, median {statistics.median(times) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
