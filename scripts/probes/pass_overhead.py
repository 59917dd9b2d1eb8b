"""What a native pass costs outside the kernel's C call: the Python from `model.forward` to the
call and back (the tensors it builds, the checks, the plan's fingerprint, the module's call).
Timed around the real call, on passes after 300 cached (the 270 MB the kernel streams leave
Python's own data cold), and again with the call replaced by one that does nothing (warm);
then `kernel.run` called directly, without the layers above it. Medians.

    python3 scripts/probes/pass_overhead.py [--passes 300] [--tokens 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec
from specdec.models import kernel


class Timed:
    """The kernel library with its pass timed (or skipped, with skip=True)."""

    def __init__(self, lib, skip: bool):
        self.lib, self.skip, self.marks = lib, skip, {}

    def __getattr__(self, name):
        fn = getattr(self.lib, name)
        if name != "specdec_pass":
            return fn

        def timed(*args):
            self.marks["start"] = time.perf_counter()
            rc = 0 if self.skip else fn(*args)
            self.marks["end"] = time.perf_counter()
            return rc
        return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = specdec.load_model("smollm2-135m-instruct")
    model.reset(600)
    model.forward(list(range(1, 301)), last_only=True)
    lib = kernel.library()
    block = list(range(5, 5 + args.tokens))
    for skip in (False, True):
        timed = Timed(lib, skip)
        kernel.use(timed)
        before, after, call = [], [], []
        for _ in range(args.passes):
            start = time.perf_counter()
            model.forward(block)
            end = time.perf_counter()
            model.rollback(300)
            before.append(timed.marks["start"] - start)
            after.append(end - timed.marks["end"])
            call.append(timed.marks["end"] - timed.marks["start"])
        kernel.use(lib)
        label = "the call skipped (warm)" if skip else "after real passes (cold)"
        print(f"{args.tokens}-token pass, {label}: {statistics.median(before) * 1e6:.0f} us before the C call, "
              f"{statistics.median(after) * 1e6:.0f} us after it; the call {statistics.median(call) * 1e3:.2f} ms")
    timed, before, after = Timed(lib, skip=False), [], []
    tokens = torch.tensor(block)
    with torch.inference_mode():
        for _ in range(args.passes):  # the cache's length stays at 300: each pass overwrites the same rows
            start = time.perf_counter()
            kernel.run(timed, model.module, [tokens], [0], model.cache, False, None)
            end = time.perf_counter()
            before.append(timed.marks["start"] - start)
            after.append(end - timed.marks["end"])
    print(f"{args.tokens}-token pass, kernel.run called directly (cold): {statistics.median(before) * 1e6:.0f} us "
          f"before the C call, {statistics.median(after) * 1e6:.0f} us after it")


if __name__ == "__main__":
    main()
