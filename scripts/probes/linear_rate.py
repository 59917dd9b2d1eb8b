"""The rate of the native kernel's dot products on one matrix with its weights in cache, against
torch's bf16 linear (oneDNN) on the same shapes: what the products alone reach, apart from the
memory that feeds a whole pass. One thread, medians of --reps calls; GMAC/s = M * N * K / time.

    python3 scripts/probes/linear_rate.py [--reps 50] [NAME=libspecdec_kernel.so ...]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.models import kernel

SHAPES = ((576, 1536), (1536, 576), (576, 576))  # (K, N): SmolLM2-135M's gate/up, down, o
ROWS = (1, 16, 32, 128)


def timed(call, reps: int) -> float:
    call()  # warm: the weights in cache, the tiles configured
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("libs", nargs="*", metavar="NAME=PATH", help="kernel builds (default: this one)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    libs = {name: kernel.load(path) for name, path in (a.split("=", 1) for a in args.libs)}
    if not libs:
        if kernel.library() is None:
            raise SystemExit("the kernel cannot be built here")
        libs = {kernel.isa(): kernel.library()}
    g = torch.Generator().manual_seed(0)
    print(f"GMAC/s, one thread, weights in cache (median of {args.reps})")
    print(f"{'K':>5} {'N':>5} {'rows':>5} " + " ".join(f"{n:>14}" for n in [*libs, "torch"]))
    for K, N in SHAPES:
        W = torch.randn(N, K, generator=g).bfloat16()
        for M in ROWS:
            x = torch.randn(M, K, generator=g).bfloat16()
            out = torch.empty(M, N)
            rates = []
            for lib in libs.values():
                def call(lib=lib):
                    lib.specdec_linear(x.data_ptr(), M, K, W.data_ptr(), N, out.data_ptr(), 1)
                rates.append(M * N * K / timed(call, args.reps) / 1e9)
            rates.append(M * N * K / timed(lambda: torch.nn.functional.linear(x, W), args.reps) / 1e9)
            print(f"{K:>5} {N:>5} {M:>5} " + " ".join(f"{r:>14.0f}" for r in rates))


if __name__ == "__main__":
    main()
