#!/usr/bin/env bash
# The runs behind docs/benchmark.md, "On llama.cpp": specdec's decoding on the llama.cpp engine
# beside llama.cpp's own plain decoding and prompt-lookup speculation, and the native engine
# with llama.cpp's plain decoding beside it; on the 26 held-out prompts in Spec-Bench's mix of
# categories (none in the bundled suite). About 30 minutes on 2 cores.
# Usage: bash scripts/bench_llamacpp.sh [OUT_DIR]   (default bench-runs/)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-runs}"
mkdir -p "$out"
heldout=specdec/bench/prompts/heldout-specbench-v1.jsonl
# 1. The llama.cpp engine on a bf16 GGUF written from the native engine's weights; the shipped draft as GGUF.
specdec bench --engine llama.cpp --prompts "$heldout" --trials 2 --threads 2 --num-draft-tokens auto,4 --no-peers \
  --out "$out/llamacpp-bf16"
# 2. The same prompts on the native engine (bf16), llama.cpp's plain decoding beside it.
specdec bench --prompts "$heldout" --trials 2 --threads 2 --no-peers --out "$out/native-bf16"
# 3. The embedded Q4_1 file itself on llama.cpp, with the shipped draft (bf16 GGUF).
q4=$(python3 -c 'from specdec.models.loading import embedded_gguf_path; print(embedded_gguf_path("smollm2-135m-instruct"))')
specdec bench --engine llama.cpp --model "$q4" --draft smollm2-135m-instruct-draft --prompts "$heldout" --trials 2 \
  --threads 2 --num-draft-tokens auto,4 --no-peers --out "$out/llamacpp-q4_1"
