#!/usr/bin/env bash
# Trains the shipped draft for the default target, as it was trained (about 85 minutes on
# 2 cores: 50 for the target to write its data, 35 to train), and writes its shippable form
# into the package. Resumable: rerun the same command after an interruption.
# Usage: bash scripts/train_draft.sh [RUN_DIR]   (default drafts-local/smollm2-135m-instruct-draft)
set -euo pipefail
cd "$(dirname "$0")/.."
run="${1:-drafts-local/smollm2-135m-instruct-draft}"
specdec distill --target smollm2-135m-instruct --out "$run" --prompts 2000 --heldout 40 --max-new-tokens 128 \
  --steps 1600 --batch-tokens 2048 --threads 2 --ship specdec/assets/smollm2-135m-instruct-draft
