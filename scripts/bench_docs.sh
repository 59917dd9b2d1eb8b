#!/usr/bin/env bash
# Reproduces the runs behind docs/benchmark.md (about 75 minutes on 2 cores).
# Usage: bash scripts/bench_docs.sh [OUT_DIR]   (default bench-runs/)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-runs}"
mkdir -p "$out"
# A cheap, poor draft: the target's first two layers with its head (no training).
[ -f drafts-local/first2/config.json ] || python3 scripts/truncated_draft.py --layers 2 --out drafts-local/first2
# 1. Greedy: every category, n-gram and the 2-layer draft at k = 1, 2, 4, 8, transformers peers.
specdec bench --per-category 2 --num-draft-tokens auto,1,2,4,8 --draft drafts-local/first2 --out "$out/greedy"
# 2. Sampling at temperature 0.7: acceptance falls.
specdec bench --per-category 1 --num-draft-tokens auto,4 --draft drafts-local/first2 --temperature 0.7 --no-peers \
  --out "$out/t07"
# 3. An expensive draft: the target drafting for itself (acceptance ~1, cost ratio c ~1).
specdec bench --categories summarization,qa,code_generation,multi_turn --per-category 1 --num-draft-tokens auto,2,4 \
  --draft smollm2-135m-instruct --no-peers --out "$out/selfdraft"
