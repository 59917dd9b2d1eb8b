"""What a tree pass costs on the native kernel against a chain of as many rows: each tree row
that leaves the first chain attends from a gathered copy of its last chunk of K and V
(kernel.cpp, `pass`), so a tree costs more than its rows as a block would. Times, in
rounds, a one-token pass, chains of n rows and trees of n rows shaped as a drafter's would
be (a first chain of up to 8, the rest hung on it in short branches), after --at cached
positions, on the embedded model; medians, in one-token passes.

    python3 scripts/probes/tree_cost.py [--threads 2] [--rounds 12] [--rows 5 9 12 16] [--at 300 800]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec
from specdec.models import kernel


def drafter_shaped(n: int) -> list[int]:
    """A first chain of min(8, n // 2 + 1) rows, then branches of two hung on it in turn."""
    trunk = min(8, n // 2 + 1)
    parents = [i - 1 for i in range(trunk)]
    at = 0
    while len(parents) < n:
        parents.append(at)  # a sibling of row at + 1
        if len(parents) < n:
            parents.append(len(parents) - 1)  # and its child
        at = (at + 1) % (trunk - 1) if trunk > 1 else 0
    return parents


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--rows", type=int, nargs="+", default=[5, 9, 12, 16])
    ap.add_argument("--at", type=int, nargs="+", default=[300, 800])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = kernel.library()
    if lib is None or kernel.isa() is None:
        raise SystemExit("the kernel cannot be built here")
    module = specdec.load_model("smollm2-135m-instruct").module
    cache = module.new_cache(1024)
    g = torch.Generator().manual_seed(0)
    times: dict[tuple, list[float]] = {}

    def timed(key, fn):
        t0 = time.perf_counter()
        fn()
        times.setdefault(key, []).append(time.perf_counter() - t0)

    for _ in range(args.rounds):
        for start in args.at:
            cache.lengths[0] = start
            one = torch.randint(0, module.cfg.vocab_size, (1,), generator=g)
            timed(("one", 1, start), lambda: kernel.run(lib, module, [one], [0], cache, False, None))
            for n in args.rows:
                tokens = torch.randint(0, module.cfg.vocab_size, (n,), generator=g)
                timed(("chain", n, start), lambda: kernel.run(lib, module, [tokens], [0], cache, False, None))
                timed(("tree", n, start), lambda: kernel.run_tree(lib, module, tokens, drafter_shaped(n), cache, None))
    med = {key: statistics.median(v) for key, v in times.items()}
    print(f"{kernel.isa()}, {args.threads} threads, medians of {args.rounds} rounds; in one-token passes")
    for start in args.at:
        base = med[("one", 1, start)]
        print(f"after {start} cached: one-token pass {base * 1e3:.2f} ms")
        for n in args.rows:
            c, t = med[("chain", n, start)] / base, med[("tree", n, start)] / base
            print(f"  {n:>3} rows: chain {c:.3f}  tree {t:.3f}  (tree over chain {t / c:.3f}; "
                  f"shape {drafter_shaped(n)})")


if __name__ == "__main__":
    main()
