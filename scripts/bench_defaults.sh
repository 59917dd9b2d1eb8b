#!/usr/bin/env bash
# The runs behind README.md's headline table and docs/benchmark.md, "The defaults": every
# prompt of the bundled suite once, greedy, beside transformers' greedy generate, prompt lookup
# and assisted generation on the same weights, and llama.cpp's own plain decoding where
# llama-cpp-python is installed. About 40 minutes each on 2 cores.
# Usage: bash scripts/bench_defaults.sh [OUT_DIR]   (default bench-runs/)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-runs}"
mkdir -p "$out"
# 1. specdec bench as it comes: every drafter with k = auto, the API's default.
specdec bench --trials 1 --threads 2 --out "$out/defaults"
# 2. Each drafter with k = auto and with k = 4, the API's default before auto (peers at k = 4 too).
specdec bench --trials 1 --threads 2 --num-draft-tokens auto,4 --no-llama-cpp --out "$out/defaults-k4"
