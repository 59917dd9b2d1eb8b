#!/usr/bin/env bash
# The runs behind docs/benchmark.md, "A draft that pays on real workloads": the 26 held-out
# prompts in Spec-Bench's mix of categories (specdec/bench/prompts/heldout-specbench-v1.jsonl,
# Spec-Bench's format, written for this project, none in the suite or in any training mix),
# 96 new tokens, 2 interleaved trials, greedy and at temperature 0.7, with the shipped draft
# and with a draft DRAFT given as an argument (e.g. one `specdec distill --mix spec-bench`
# trained). About 20 minutes on 2 cores.
# Usage: bash scripts/bench_specbench.sh [DRAFT] [OUT_DIR]   (default: the shipped draft only; bench-runs/)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${2:-bench-runs}"
mkdir -p "$out"
heldout=specdec/bench/prompts/heldout-specbench-v1.jsonl
drafts=(smollm2-135m-instruct-draft)
[ -n "${1:-}" ] && drafts+=("$1")
for draft in "${drafts[@]}"; do
  name=$(basename "$draft")
  specdec bench --prompts "$heldout" --draft "$draft" --trials 2 --threads 2 --max-tokens 96 --no-peers \
    --out "$out/specbench-$name-greedy"
  specdec bench --prompts "$heldout" --draft "$draft" --trials 2 --threads 2 --max-tokens 96 --no-peers \
    --temperature 0.7 --out "$out/specbench-$name-t07"
done
