"""The acceptance rate a draft model would need for a given end-to-end speedup, per category.

From a `specdec bench` report: plain decoding's own times per prompt (its prefill pass and
the decoding after it) and the costs measured in the run (the draft's cost ratio c, the
verify cost of k+1 tokens for each k run). Speculation only speeds up the decoding, so

    end-to-end ratio of a prompt = T / (prefill + (T - prefill) / S)

for a decode speedup S. This finds the S whose geometric mean of ratios over a category's
prompts reaches the goal, then the acceptance rate alpha at which the Leviathan et al.
model (`specdec.bench.stats.predicted_speedup`, i.i.d. acceptance) predicts that S at the
best k measured. Prompt lookup's acceptance comes in runs, so this is the bar for a draft
model, which is what the report's alpha column measures.

    python3 scripts/probes/required_acceptance.py bench-runs/grounded/report.json --speedup 2
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict

from specdec.bench.stats import geomean, required_alpha


def plain_times(report: dict) -> dict[str, tuple[float, float]]:
    """prompt id -> (median seconds, median prefill seconds) of plain decoding."""
    rows = defaultdict(list)
    for r in report["records"]:
        if r["method"] == "normal":
            rows[r["prompt"]].append((r["seconds"], r["prefill_seconds"]))
    return {p: (statistics.median(s for s, _ in v), statistics.median(f for _, f in v)) for p, v in rows.items()}


def decode_speedup_needed(times: list[tuple[float, float]], goal: float) -> float:
    """The decode speedup S at which the geometric mean of T / (prefill + (T - prefill) / S)
    over `times` reaches `goal` (inf if not even free decoding gets there)."""
    def mean_ratio(s):
        return geomean([t / (f + (t - f) / s) for t, f in times])

    if mean_ratio(math.inf) <= goal:
        return math.inf
    lo, hi = 1.0, 2.0
    while mean_ratio(hi) < goal:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_ratio(mid) < goal else (lo, mid)
    return hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="a report.json of `specdec bench` with a draft model")
    ap.add_argument("--speedup", type=float, default=2.0, help="the end-to-end goal (default 2)")
    ap.add_argument("--draft", default="draft", help="the draft's name in the report's costs (default: draft)")
    args = ap.parse_args()
    report = json.load(open(args.report))
    costs = report["costs"]
    if args.draft not in costs.get("drafts", {}):
        raise SystemExit(f"no costs for a draft named {args.draft!r} in {args.report}")
    c = costs["drafts"][args.draft]["c"]
    verify = {int(k): v for k, v in costs["verify_cost"].items()}
    times = plain_times(report)
    by_cat = defaultdict(list)
    for p in report["prompts"]:
        by_cat[p["category"]].append(times[p["id"]])
    by_cat["overall"] = list(times.values())
    measured = {m["name"]: m for m in report["methods"]}.get(f"spec-{args.draft}-k{max(verify)}")

    def alpha_for(s):  # the lowest over the ks measured (nan: no k reaches s)
        alphas = [required_alpha(s, k, c, v) for k, v in verify.items()] if s < math.inf else []
        return min((a for a in alphas if not math.isnan(a)), default=math.nan)

    print(f"c = {c:.3f}, verify cost " + ", ".join(f"k={k}: {v:.2f}" for k, v in sorted(verify.items())))
    print(f"{'category':15s} {'n':>3s} {'prefill share':>18s} {'ceiling':>8s} {'decode S needed':>15s} "
          f"{'alpha needed':>12s} {'decode-only alpha':>17s} {'alpha of ' + (measured or {}).get('name', '-'):>22s}")
    for cat, tt in by_cat.items():
        s = decode_speedup_needed(tt, args.speedup)
        shares = [f / t for t, f in tt]
        share = f"{statistics.median(shares):.0%} (max {max(shares):.0%})"
        ceiling = geomean([t / f for t, f in tt])
        have = (measured["overall"] if cat == "overall" else measured["categories"].get(cat, {})).get("alpha") \
            if measured else None
        print(f"{cat:15s} {len(tt):3d} {share:>18s} {ceiling:7.1f}x {s:14.2f}x {alpha_for(s):12.2f} "
              f"{alpha_for(args.speedup):17.2f} {'-' if have is None else f'{have:.2f}':>22s}")


if __name__ == "__main__":
    main()
