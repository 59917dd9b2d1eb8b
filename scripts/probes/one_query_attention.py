"""Why one-token passes attend in float32 on a CPU: torch's attention for one query and for
a block of queries, in bf16 and in float32, at SmolLM2-135M's shapes (9 query heads, 3 KV
heads, 64 dims), then the default target's own forward for 1 and 5 tokens.

    python3 scripts/probes/one_query_attention.py
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import specdec


def micros(fn, n: int = 300) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    print("attention, one layer (us): cached tokens, queries, bf16, float32")
    for cached in (100, 300, 600):
        k, v = torch.randn(2, 1, 3, cached, 64, dtype=torch.bfloat16)
        for queries in (1, 5):
            q = torch.randn(1, 9, queries, 64, dtype=torch.bfloat16)
            mask = torch.ones(queries, cached, dtype=torch.bool).tril(cached - queries) if queries > 1 else None
            times = [micros(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
                     for q, k, v in ((q, k, v), (q.float(), k.float(), v.float()))]
            print(f"  {cached:4d} {queries:2d} {times[0]:7.0f} {times[1]:7.0f}")
    target = specdec.load_model("smollm2-135m-instruct", dtype="bfloat16")
    print("the target's forward (ms, median of 25): cached tokens, 1 token, 5 tokens")
    for cached in (100, 300, 600):
        target.reset(cached + 8)
        target.forward(list(range(cached)), last_only=True)
        row = []
        for n in (1, 5):
            times = []
            for _ in range(25):
                start = time.perf_counter()
                target.forward(list(range(n)))
                times.append(time.perf_counter() - start)
                target.rollback(cached)
            row.append(sorted(times)[12] * 1e3)
        print(f"  {cached:4d} {row[0]:6.1f} {row[1]:6.1f}")


if __name__ == "__main__":
    main()
