#!/usr/bin/env bash
# The run behind docs/benchmark.md, "Batched requests": plain and speculative decoding (lookup,
# the shipped draft, the composite; k = auto) of 80 prompts of the bundled suite in batches of
# 1, 2, 4, 8 and 16, bf16, 2 threads. About 15 minutes on 2 cores. The plot it writes is
# docs/img/batch_scaling.png.
# Usage: bash scripts/bench_batched.sh [OUT_DIR]   (default bench-runs/)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-runs}"
mkdir -p "$out"
specdec bench --batch-sizes 1,2,4,8,16 --trials 1 --threads 2 --out "$out/batched"
