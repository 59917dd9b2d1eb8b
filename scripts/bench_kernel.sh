#!/usr/bin/env bash
# The runs behind docs/benchmark.md, "The native kernel": the native engine's pass costs beside
# llama.cpp's, then the defaults on the 26 held-out prompts in Spec-Bench's mix of categories
# (none in the bundled suite) and on every prompt of the bundled suite, with llama.cpp's plain
# decoding beside them. About 35 minutes on 2 cores.
# Usage: bash scripts/bench_kernel.sh [OUT_DIR]   (default bench-runs/)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-runs}"
mkdir -p "$out"
python3 scripts/probes/pass_cost.py --rounds 6 | tee "$out/pass-cost.txt"
specdec bench --prompts specdec/bench/prompts/heldout-specbench-v1.jsonl --trials 2 --threads 2 --no-peers \
  --out "$out/native-bf16-kernel"
specdec bench --trials 1 --threads 2 --out "$out/suite-kernel"
