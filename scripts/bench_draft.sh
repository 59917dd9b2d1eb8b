#!/usr/bin/env bash
# Reproduces the runs behind the shipped draft's numbers in README.md and
# docs/benchmark.md ("The shipped draft"): about 230 minutes on 2 cores.
# Usage: bash scripts/bench_draft.sh [OUT_DIR]   (default bench-runs/)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-runs}"
mkdir -p "$out"
# 1. Greedy, every category: the shipped draft (the default draft), alone and composite with
#    prompt lookup, at k = 2, 4 and auto; transformers' prompt lookup and assisted generation.
specdec bench --per-category 2 --trials 2 --num-draft-tokens auto,2,4 --out "$out/draft-greedy"
# 2. Sampling at temperature 0.7.
specdec bench --per-category 1 --trials 2 --num-draft-tokens auto,4 --temperature 0.7 --no-peers --out "$out/draft-t07"
# 3. Every prompt of the input-grounded categories (34), n-gram and composite at k = 4 and auto.
specdec bench --categories code_editing,rag,summarization --trials 2 --num-draft-tokens auto,4 --no-peers \
  --out "$out/grounded"
# 4. auto and the confidence stop with a poor draft (the target's first two layers, untrained).
[ -f drafts-local/first2/config.json ] || python3 scripts/truncated_draft.py --layers 2 --out drafts-local/first2
specdec bench --per-category 1 --trials 2 --num-draft-tokens auto,4 --draft drafts-local/first2 --min-confidence 0.4 \
  --no-peers --out "$out/poor-auto"
# 5. The confidence stop with the shipped draft (greedy).
specdec bench --per-category 1 --trials 2 --num-draft-tokens auto,4 --min-confidence 0.4 --no-peers --out "$out/stop"
# 6. Every translation prompt (12; short answers, where the draft is weakest).
specdec bench --categories translation --trials 2 --num-draft-tokens auto,4 --no-peers --out "$out/translation"
# 7. Every prompt of the other four categories (47), one trial.
specdec bench --categories code_generation,math,multi_turn,qa --trials 1 --num-draft-tokens auto,4 --no-peers --out "$out/rest"
# 8. Every prompt at temperature 0.7, one trial.
specdec bench --trials 1 --num-draft-tokens auto,4 --temperature 0.7 --no-peers --out "$out/t07-all"
# 9. Every prompt, greedy, one trial (with 8, the current numbers: docs/benchmark.md, "The current numbers").
specdec bench --trials 1 --num-draft-tokens auto,4 --no-peers --out "$out/greedy-all"
# 10. Against transformers' generate, prompt lookup and assisted generation (16 prompts, one trial).
specdec bench --per-category 2 --trials 1 --num-draft-tokens auto,4 --out "$out/peers"
