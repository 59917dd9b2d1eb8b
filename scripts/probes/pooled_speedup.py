"""Speedup over the prompts of several `specdec bench` reports taken together.

Each report's ratios are paired within its own run (method and baseline interleaved on the
same prompt); this pools those per-prompt ratios, so that runs over disjoint categories
give one geometric mean over all their prompts, with a bootstrap CI over prompts.

    python3 scripts/probes/pooled_speedup.py bench-runs/grounded/report.json bench-runs/translation/report.json ...
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

from specdec.bench.stats import summarize_ratios


def per_token(report: dict) -> dict[tuple[str, str], float]:
    """(method, prompt) -> median over trials of seconds per generated token, as the report's own ratios use."""
    rows = defaultdict(list)
    for r in report["records"]:
        rows[(r["method"], r["prompt"])].append(r["seconds"] / max(r["n_tokens"], 1))
    return {key: statistics.median(v) for key, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="report.json files of runs over disjoint prompts")
    args = ap.parse_args()
    ratios, seen = defaultdict(list), set()
    for path in args.reports:
        report = json.load(open(path))
        t = per_token(report)
        for p in report["prompts"]:
            if p["id"] in seen:
                raise SystemExit(f"prompt {p['id']} is in more than one report: pool disjoint runs")
            seen.add(p["id"])
            for m in report["methods"]:
                if (m["name"], p["id"]) in t:
                    ratios[m["name"]].append(t[("normal", p["id"])] / t[(m["name"], p["id"])])
    for name, r in ratios.items():
        s = summarize_ratios(r)
        print(f"{name:28s} n={s['n']:3d}  {s['geomean']:.2f}x [{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}]")


if __name__ == "__main__":
    main()
