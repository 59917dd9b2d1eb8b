"""Statistics for the benchmark: paired ratios, robust summaries, bootstrap intervals,
and the speedup speculative decoding should give (Leviathan et al. 2023).
"""
from __future__ import annotations

import math

import numpy as np

from ..schedule import expected_tokens_per_step  # noqa: F401  (re-exported: part of the model)


def geomean(x) -> float:
    x = np.asarray(x, dtype=float)
    return float(np.exp(np.log(x).mean())) if x.size else math.nan


def summarize_ratios(ratios, *, n_boot: int = 10_000, seed: int = 0) -> dict:
    """Per-prompt paired ratios (baseline time / method time) -> geometric mean with a
    bootstrap 95% CI over prompts, median and interquartile range.

    The geometric mean is the right average for ratios: a 2x win and a 2x loss cancel.
    Prompts, not trials, are resampled: they are the units the claim generalizes over.
    """
    r = np.asarray(ratios, dtype=float)
    if r.size == 0:
        return {"n": 0, "geomean": math.nan, "ci95": [math.nan, math.nan], "median": math.nan, "iqr": [math.nan, math.nan]}
    logs = np.log(r)
    rng = np.random.default_rng(seed)
    if r.size > 1:
        boot = logs[rng.integers(0, r.size, size=(n_boot, r.size))].mean(axis=1)
        lo, hi = np.exp(np.percentile(boot, [2.5, 97.5]))
    else:
        lo = hi = r[0]
    q1, med, q3 = np.percentile(r, [25, 50, 75])
    return {"n": int(r.size), "geomean": float(np.exp(logs.mean())), "ci95": [float(lo), float(hi)],
            "median": float(med), "iqr": [float(q1), float(q3)]}


def predicted_speedup(alpha: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """Leviathan et al.'s speedup (1 - a^(k+1)) / ((1 - a)(k c + 1)), with the 1 (one target
    pass) replaced by the measured cost of verifying k+1 tokens relative to one token.

    c: draft forward time / target forward time. verify_cost: target time for k+1 tokens /
    target time for 1 token (1.0 where the target is purely memory-bound).
    """
    return expected_tokens_per_step(alpha, k) / (k * c + verify_cost)


def required_alpha(speedup: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """The acceptance rate a draft needs for a predicted speedup of `speedup` at k (nan if
    even perfect acceptance falls short). The predicted speedup rises with alpha, so bisect."""
    lo, hi = 0.0, 1.0
    if predicted_speedup(hi - 1e-12, k, c, verify_cost) < speedup:
        return math.nan
    for _ in range(60):
        mid = (lo + hi) / 2
        if predicted_speedup(mid, k, c, verify_cost) < speedup:
            lo = mid
        else:
            hi = mid
    return hi


def break_even_alpha(k: int, c: float, verify_cost: float = 1.0) -> float:
    """The acceptance rate below which speculation is slower than plain decoding."""
    return required_alpha(1.0, k, c, verify_cost)


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of n methods in which each method comes right after each other one equally
    often (a Williams design: n orders for even n, 2n for odd). A rotation of one order would
    keep every method's predecessor fixed, and a predecessor can leave a cost behind: on the
    AMX VM our plain decoding, always timed right after llama.cpp's generation, ran 7% slower
    than in balanced orders (91.9 against 98.8 tokens a second), which raised every ratio
    over it by about 5% (`git show 3681d61:docs/benchmark.md`, "Method")."""
    if n < 1:
        return []
    first, lo, hi = [0], 1, n - 1
    while lo <= hi:
        first.append(lo)
        if lo != hi:
            first.append(hi)
        lo, hi = lo + 1, hi - 1
    orders = [[(x + i) % n for x in first] for i in range(n)]
    return orders + [o[::-1] for o in orders] if n % 2 else orders


def interleaved_order(items: list, round_: int) -> list:
    """items in the balanced order for this round (rounds cycle through balanced_orders)."""
    orders = balanced_orders(len(items))
    return [items[i] for i in orders[round_ % len(orders)]] if items else []
