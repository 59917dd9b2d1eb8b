"""Batched plain decoding: tokens per second over all rows at batch sizes 1..16, against one
prompt at a time, on the default target (bf16, the native engine). Every row runs to
max_tokens (EOS off), so each size does the same work per row; the held-out prompts, rounds
over all sizes so that a noisy spell hits each alike.

    python3 scripts/probes/batch_throughput.py [--max-tokens 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec
from specdec import generate
from specdec.bench.suite import load_suite, render

SIZES = (1, 2, 4, 8, 16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = specdec.load_model("smollm2-135m-instruct")
    prompts = load_suite("specdec/bench/prompts/heldout-specbench-v1.jsonl")
    render(prompts, target, target.tokenizer)
    target.eos_token_ids = ()  # every row runs to max_tokens
    rates = {b: [] for b in SIZES}
    for _ in range(args.rounds):
        for b in SIZES:
            batch = [p.ids for p in prompts[:b]]
            start = time.perf_counter()
            out = generate(target, None, batch, args.max_tokens)
            rates[b].append(sum(len(g.token_ids) for g in out) / (time.perf_counter() - start))
    one = statistics.median(rates[1])
    print(f"new tokens per second over all rows (median of {args.rounds}), {args.max_tokens} tokens a row, "
          f"prefill included")
    for b in SIZES:
        r = statistics.median(rates[b])
        print(f"  batch {b:2d}: {r:7.1f} tok/s  {r / one:5.2f}x batch 1")


if __name__ == "__main__":
    main()
