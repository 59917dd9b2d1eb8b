"""What llama.cpp's flash attention does to the llama.cpp engine's passes on this CPU: a
one-token pass and blocks of 2-17 tokens after 0, 150 and 300 cached, with the engine's
setting (disabled, as llama-cpp-python's `Llama` runs) and with llama.cpp's own default
(auto, which turns it on). Rounds alternate the two contexts; medians, blocks as a multiple
of the same setting's one-token pass.

    python3 scripts/probes/llamacpp_flash_attn.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec
from specdec.models import llamacpp

SIZES = (1, 2, 5, 9, 17)
CACHED = (0, 150, 300)
SETTINGS = {"disabled (the engine's)": 0, "auto (llama.cpp's default)": -1}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    models = {}
    for name, setting in SETTINGS.items():
        llamacpp._Context.flash_attn_type = setting  # read when the model's context is made, in reset
        models[name] = specdec.load_model("smollm2-135m-instruct", engine="llama.cpp")
        models[name].reset(max(CACHED) + max(SIZES))
    llamacpp._Context.flash_attn_type = SETTINGS["disabled (the engine's)"]
    times: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for at in CACHED:
            for name, model in models.items():
                model.rollback(0)
                model.forward(list(range(1000, 1000 + max(at, 1))), last_only=True)
                for n in SIZES:
                    for _ in range(3):
                        start = time.perf_counter()
                        model.forward(list(range(5, 5 + n)))
                        times.setdefault((name, at, n), []).append(time.perf_counter() - start)
                        model.rollback(max(at, 1))
    print("flash attention: a one-token pass (ms), then blocks of n tokens in one-token passes")
    for at in CACHED:
        for name in models:
            one = statistics.median(times[name, at, 1])
            print(f"  {max(at, 1):3d} cached, {name:27s} {one * 1e3:6.2f} ms"
                  + "".join(f"  {n}: {statistics.median(times[name, at, n]) / one:.2f}" for n in SIZES[1:]))


if __name__ == "__main__":
    main()
