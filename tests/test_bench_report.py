"""The benchmark report writer, on a small synthetic report shaped like runner.aggregate's output:
report.json is strict JSON, report.md has its tables and verdicts, the plots are real PNGs, a
plot without data is skipped with a note, and the summary prints in a non-TTY. No model runs."""
from __future__ import annotations

import io
import json
import math
import sys

import matplotlib.image
import pytest

from specdec.bench import report as R

NAN = math.nan
CATS = {"qa": ["qa-1", "qa-2"], "summarization": ["sum-1", "sum-2"]}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def speedup(g, n=2):
    return {"n": n, "geomean": g, "ci95": [g * 0.9, g * 1.1] if n > 1 else [g, g], "median": g, "iqr": [g * 0.95, g * 1.05]}


def method(name, family, drafter=None, k=None, g=1.0, acc=None, mismatches=()):
    overall = {"speedup": speedup(g, 4), "tokens": 256, "seconds": 2.56 / g, "tokens_per_s": 100 * g,
               "ms_per_token": 10 / g}
    if family != "transformers":  # ours expose prefill time and Stats
        overall |= {"prefill_ms_mean": 30.0, "decode_ms_per_token": 9.5 / g, "acceptance_rate": NAN,
                    "tokens_per_target_call": 1.0, "tokens_per_step": 1.0, "accepted_per_position": [],
                    "drafted": 0, "accepted": 0, "target_calls": 256, "draft_calls": 0, "verify_steps": 252,
                    "mean_drafted_per_step": 0.0, "draft_time_share": 0.0, "draft_seconds": 0.0}
    if family == "specdec":
        overall |= {"acceptance_rate": acc, "tokens_per_target_call": 1 + acc * k / 2, "tokens_per_step": 1 + acc,
                    "accepted_per_position": [acc ** (i + 1) for i in range(k - 1)] + [NAN],  # a 0/0 position
                    "mean_drafted_per_step": k * 0.8, "draft_time_share": 0.01, "cost_ratio_c": 0.003,
                    "verify_cost": 1.0 + 0.2 * k, "predicted_speedup": 1.4}
    cats = {c: {"speedup": speedup(g * (1.2 if c == "qa" else 0.8))} for c in CATS}
    if family != "transformers":
        overall["decode_speedup"] = speedup(g * 1.1, 4)
        for c in cats:
            cats[c]["decode_speedup"] = speedup(g * (1.3 if c == "qa" else 0.9))
    return {"name": name, "family": family, "drafter": drafter, "k": k, "cold_seconds": 3.0, "overall": overall,
            "categories": cats, "mismatches": list(mismatches)}


def make_report(dtype="float32", ks=(2, 4)):
    methods = [method("normal", "baseline")]
    methods += [method(f"spec-ngram-k{k}", "specdec", "ngram", k, g=1.5 + 0.2 * k, acc=0.5 + 0.05 * k,
                       mismatches=[{"prompt": "qa-2", "position": 5, "baseline_len": 64, "method_len": 64,
                                    "top2_margin": 5e-4, "margin_to_theirs": 5e-4}] if k == ks[0] else [])
                for k in ks]
    methods.append(method("hf-greedy", "transformers", g=0.95, mismatches=[
        {"prompt": "sum-1", "position": 12, "baseline_len": 64, "method_len": 64, "top2_margin": 0.125,
         "margin_to_theirs": 0.125},
        {"prompt": "qa-1", "position": 40, "baseline_len": 64, "method_len": 40}]))  # a prefix: no margin
    prompts = [{"id": p, "category": c, "grounded": c == "summarization", "prompt_tokens": 50}
               for c, ids in CATS.items() for p in ids]
    return {
        "methods": methods,
        "costs": {"target_forward_ms": 12.5, "verify_cost": {str(k): 1.0 + 0.2 * k for k in ks}, "drafts": {}},
        "prompts": prompts,
        "records": [{"method": m["name"], "prompt": p["id"], "trial": t, "seconds": 0.5 + 0.01 * t,
                     "prefill_seconds": None, "stats": None, "n_tokens": 64}
                    for t in range(2) for p in prompts for m in methods],
        "schema": "specdec-bench/1",
        "environment": {"cpu": "Test CPU", "cpu_count": 4, "threads": 2, "gpu": None, "device": "cpu",
                        "dtype": dtype, "python": "3.11", "torch": "2.x", "transformers": "5.x",
                        "specdec": "0.1.0", "git_commit": None, "platform": "test", "date": "2025-01-01 00:00:00 UTC"},
        "config": {"model": "tiny", "draft": None, "ks": list(ks), "max_tokens": 64, "trials": 2,
                   "temperature": 0.0, "top_k": None, "top_p": None},
        "load_seconds": {"target": 1.25, "transformers": NAN},
        "ceilings": {"k_max": 16, "lookup": {"overall": 2.5, "categories": {"qa": 1.25, "summarization": 3.75}}},
    }


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000, path
    h, w = matplotlib.image.imread(path).shape[:2]
    assert h > 200 and w > 300


def test_write_report_writes_json_markdown_and_plots(tmp_path):
    R.write_report(make_report(), tmp_path)

    text = (tmp_path / "report.json").read_text()
    parsed = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in report.json"))
    assert parsed["load_seconds"]["transformers"] is None
    assert parsed["methods"][0]["overall"]["acceptance_rate"] is None

    md = (tmp_path / "report.md").read_text()
    for heading in ("## Overall", "## Speedup by category", "## Decode-only speedup by category",
                    "## Acceptance by draft position", "## Measured costs",
                    "## Greedy mismatches", "## Cold (first-call) latency", "## Plots"):
        assert heading in md
    assert "Test CPU" in md and "float32" in md and "commit –" in md
    assert "| spec-ngram-k4 | 4 | 2.30x [2.07, 2.53] |" in md  # geomean [CI] in the overall table
    assert "| 2.53x [2.28, 2.78] |" in md  # its decode-only speedup next to it
    decode = md.split("## Decode-only speedup by category")[1].split("##")[0]
    assert "| spec-ngram-k4 | 2.99x [2.69, 3.29] | 2.07x [1.86, 2.28] |" in decode
    assert "hf-greedy" not in decode  # no prefill time, no decode-only ratio
    assert "| method | qa | summarization |" in md
    hf_row = next(line for line in md.splitlines() if line.startswith("| hf-greedy | 4 |"))
    assert hf_row.count("–") >= 8  # transformers methods have no prefill / acceptance / cost stats
    assert "| spec-ngram-k4 | 0.700 | 0.700 | 0.490 | 0.343 | – |" in md  # per position, NaN as –
    assert "prompt `qa-2`, position 5: top-2 margin 0.0005" in md and "**tie**" in md
    assert "prompt `sum-1`, position 12: top-2 margin 0.125" in md  # above the float32 tolerance
    assert md.count("**MISMATCH**") == 2  # that one, and the length-only divergence
    assert "paired ratio" in md and "includes the prefill call" in md and "accepted drafts / drafted tokens" in md
    ceilings = md.split("## How far the drafters could go")[1].split("##")[0]
    assert "| category | prompt lookup at best | measured best |" in ceilings  # no draft model: one kind
    assert "| qa | 1.25 | – |" in ceilings and "| summarization | 3.75 | – |" in ceilings
    assert "| overall | 2.50 | 1.70 (spec-ngram-k4) |" in ceilings and "up to 16 drafts" in ceilings

    for name in R.PLOTS:
        assert_png(tmp_path / f"{name}.png")
        assert f"![{name}]({name}.png)" in md


def test_the_perfect_schedule_sits_beside_the_measured_auto_method(tmp_path):
    report = make_report()
    report["methods"][2]["name"] = "spec-ngram-kauto"  # the k = 4 method stands in for auto
    report["ceilings"]["speedup"] = {"end_to_end": True,
                                     "lookup": {"overall": 2.75, "categories": {"qa": 1.5, "summarization": 4.0}}}
    R.write_report(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    table = md.split("### With a perfect schedule, at this engine's pass costs")[1].split("##")[0]
    assert "| category | prompt lookup |" in table
    assert "| qa | 1.50x (2.76x) |" in table and "| overall | 2.75x (2.30x) |" in table
    assert "end to end" in table and "cannot see ahead" in table
    assert "Where `auto`'s speedup goes" not in md  # nothing replayed
    report["ceilings"]["replayed"] = {"k_max": 15, "lookup": {"overall": 2.5, "categories": {"qa": 1.25,
                                                                                            "summarization": 3.5}}}
    R.write_report(report, tmp_path)
    replayed = (tmp_path / "report.md").read_text().split("### Where `auto`'s speedup goes")[1].split("##")[0]
    assert "| category | prompt lookup: perfect | prompt lookup: auto replayed | prompt lookup: measured |" in replayed
    assert "| qa | 1.50x | 1.25x | 2.76x |" in replayed and "| overall | 2.75x | 2.50x | 2.30x |" in replayed
    assert "at most 15 drafts a step" in replayed
    R.print_summary(report, file=(out := io.StringIO()))
    lines = out.getvalue().splitlines()
    assert "perfect schedule" in lines[0]
    assert next(line for line in lines if "spec-ngram-kauto" in line).rstrip().endswith("2.75x")
    assert next(line for line in lines if line.strip().startswith("normal")).rstrip().endswith("–")
    del report["ceilings"]["speedup"]
    R.write_report(report, tmp_path)
    assert "perfect schedule" not in (tmp_path / "report.md").read_text()


def test_no_ceilings_no_section(tmp_path):
    report = make_report()
    del report["ceilings"]  # sampled runs have none: the replay needs greedy outputs
    R.write_report(report, tmp_path)
    assert "How far the drafters" not in (tmp_path / "report.md").read_text()


def test_the_header_names_the_machine_and_the_kernel(tmp_path):
    # Sessions land on VMs of one name and several CPUs: the family and model tell them apart.
    report = make_report()
    report["environment"] |= {"cpu_id": "family 6, model 167", "engine": "native", "native_kernel": "amx-bf16"}
    R.write_report(report, tmp_path)
    line = next(l for l in (tmp_path / "report.md").read_text().splitlines() if l.startswith("**Environment:**"))
    assert "Test CPU (family 6, model 167; 4 CPUs)" in line and "engine native (kernel amx-bf16)" in line
    report["environment"] |= {"cpu_id": None, "native_kernel": None}
    R.write_report(report, tmp_path)
    line = next(l for l in (tmp_path / "report.md").read_text().splitlines() if l.startswith("**Environment:**"))
    assert "Test CPU (4 CPUs)" in line and "kernel" not in line


def test_half_precision_tolerance_and_single_k(tmp_path):
    R.write_report(make_report(dtype="bfloat16", ks=(4,)), tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "top-2 margin 0.125, margin to its token 0.125 → **tie**" in md  # below 0.25 in bf16
    assert md.count("**MISMATCH**") == 1
    assert_png(tmp_path / "speedup_vs_k.png")  # one k: still points, with a note
    assert "only one k value" in md


def test_plots_without_data_are_skipped_not_fatal(tmp_path):
    report = make_report()
    report["methods"] = [m for m in report["methods"] if m["family"] != "specdec"]
    report["config"]["temperature"] = 0.8  # sampling: the runner does not compare outputs
    for m in report["methods"]:
        m["mismatches"] = []
    (tmp_path / "acceptance_by_position.png").write_bytes(b"stale")
    R.write_report(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "`acceptance_by_position.png`: skipped" in md and "`speedup_vs_k.png`: skipped" in md
    assert not (tmp_path / "acceptance_by_position.png").exists()  # no stale plot left behind
    assert_png(tmp_path / "speedup_by_category.png")
    assert "No speculative methods." in md
    assert "Not checked: sampling at temperature 0.8" in md


def test_print_summary_non_tty(capsys):
    R.print_summary(make_report())
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # no colour codes in a pipe
    lines = out.splitlines()
    row = next(line for line in lines if "spec-ngram-k2" in line)
    assert "1.90x [1.71, 2.09]" in row and "0.600" in row and "1.40x" in row
    assert "–" in next(line for line in lines if "hf-greedy" in line)


def test_print_summary_plain_without_rich(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "rich", None)  # makes `import rich` fail
    R.print_summary(make_report())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["method", "speedup"] and len(lines) == 1 + 4
    assert len({line.index("x [") for line in lines[1:]}) == 1  # columns line up


def test_mismatch_line_shows_the_float32_check(tmp_path):
    report = make_report(dtype="bfloat16", ks=(4,))
    report["methods"][1]["mismatches"] = [
        {"prompt": "qa-2", "position": 101, "baseline_len": 128, "method_len": 128, "top2_margin": 0.75,
         "margin_to_theirs": 0.75, "tie_tolerance": 0.5, "float32_gap": 0.54, "rounding_shift": -2.04, "tie": True},
        {"prompt": "qa-1", "position": 7, "baseline_len": 128, "method_len": 128, "top2_margin": 4.0,
         "margin_to_theirs": 4.0, "tie_tolerance": 0.5, "float32_gap": 4.1, "rounding_shift": 0.1, "tie": False}]
    R.write_report(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert ("position 101: top-2 margin 0.75, margin to its token 0.75; in float32 the baseline's token leads by "
            "0.54, rounding moved that by -2.04 → **tie**") in md
    assert "position 7: top-2 margin 4, margin to its token 4; in float32 the baseline's token leads by 4.1, " \
           "rounding moved that by 0.1 → **MISMATCH**" in md
