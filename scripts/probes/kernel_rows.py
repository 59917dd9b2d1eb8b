"""The native kernel's pass time by rows and position: a block of M rows at the start of the
cache and after 850 cached positions (attention's share grows with it), on the embedded
model. Given built kernel libraries (NAME=PATH), it times each of them in turn in one
process, so two builds compare without a noisy spell between them; medians of --rounds.

    python3 scripts/probes/kernel_rows.py [--threads 2] [--rounds 6] [--rows 1 9 32 128] [--at 0 850]
        [--all-logits] [NAME=libspecdec_kernel.so ...]

--all-logits times the head for every row, as a verification pass needs (else the last row's only,
as reading a prompt does).

An earlier commit's build, for example: `git worktree add /tmp/old COMMIT && PYTHONPATH=/tmp/old
python3 -c "from specdec.models import kernel; print(kernel.build())"` prints its path.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec
from specdec.models import kernel

ROWS = (1, 9, 32, 128)
STARTS = (0, 850)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--at", type=int, nargs="+", default=list(STARTS), help="cached positions before the block")
    ap.add_argument("--all-logits", action="store_true")
    ap.add_argument("libs", nargs="*", metavar="NAME=PATH", help="kernel builds to compare (default: this one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    libs = {name: kernel.load(path) for name, path in (a.split("=", 1) for a in args.libs)}
    if not libs:
        if kernel.library() is None:
            raise SystemExit("the kernel cannot be built here")
        libs = {"this build": kernel.library()}
    module = specdec.load_model("smollm2-135m-instruct").module
    cache = module.new_cache(1024)
    g = torch.Generator().manual_seed(0)
    times: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for name, lib in libs.items():
            for m in args.rows:
                for start in args.at:
                    cache.lengths[0] = start
                    tokens = torch.randint(0, module.cfg.vocab_size, (m,), generator=g)
                    t0 = time.perf_counter()
                    kernel.run(lib, module, [tokens], [0], cache, not args.all_logits, None)
                    times.setdefault((name, m, start), []).append(time.perf_counter() - t0)
    print(f"kernel pass, median ms of {args.rounds} (ms per row); {args.threads} threads, {kernel.isa()}, "
          f"logits for {'every row' if args.all_logits else 'the last row'}")
    print(f"{'rows':>5} {'at':>4}" + "".join(f"{name:>22}" for name in libs))
    for m in args.rows:
        for start in args.at:
            cells = [statistics.median(times[name, m, start]) * 1e3 for name in libs]
            print(f"{m:>5} {start:>4}" + "".join(f"{ms:>13.2f} ({ms / m:.3f})" for ms in cells))


if __name__ == "__main__":
    main()
