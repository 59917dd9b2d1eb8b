"""The paired speedup of one method over another, from a `specdec bench` report.

The report gives every method's speedup over `normal` (and over `llama.cpp-greedy` where it
ran); this gives it over any other method of the same run, per prompt from the same
interleaved trials (median seconds per token over trials), averaged geometrically with a
bootstrap 95% CI over prompts, overall and by category.

    python3 scripts/probes/method_ratio.py bench-runs/llamacpp-bf16/report.json spec-composite-kauto llama.cpp-prompt-lookup-k10
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

from specdec.bench.stats import summarize_ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("method", help="the method whose speedup is wanted")
    ap.add_argument("over", help="the method it is compared with")
    args = ap.parse_args()
    report = json.load(open(args.report))
    from statistics import median

    per_token = defaultdict(list)
    for r in report["records"]:
        per_token[(r["method"], r["prompt"])].append(r["seconds"] / max(r["n_tokens"], 1))
    ratios = defaultdict(list)
    for p in report["prompts"]:
        mine, theirs = per_token.get((args.method, p["id"])), per_token.get((args.over, p["id"]))
        if not mine or not theirs:
            raise SystemExit(f"{args.method} or {args.over} did not run on prompt {p['id']}")
        ratio = median(theirs) / median(mine)
        ratios["overall"].append(ratio)
        ratios[p["category"]].append(ratio)
    for where, r in sorted(ratios.items(), key=lambda kv: kv[0] != "overall"):
        s = summarize_ratios(r)
        print(f"{where:16s} n={s['n']:3d}  {s['geomean']:.2f}x [{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}]")


if __name__ == "__main__":
    main()
