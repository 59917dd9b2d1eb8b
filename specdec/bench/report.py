"""Writing a benchmark report: report.json, report.md, four plots (one for the batched study),
and a summary table.

Everything here reads the dict that runner.run_benchmark returns (documented in
docs/bench-report-schema.md). A missing value -- None, NaN, or a key a method lacks
(transformers methods have no acceptance stats) -- renders as "–". A plot without the
data it needs is skipped with a note in report.md; it never fails the report.
"""
from __future__ import annotations

import json
import math
import numbers
import sys
from pathlib import Path

import numpy as np

from .interference import STALL, TRIAL_CORES
from .stats import predicted_speedup

DASH = "–"
HALF_DTYPES = ("bfloat16", "float16", "int8")  # top-2 logit margins below 0.25 are likely ties there; 1e-3 otherwise


class _Skip(Exception):
    """A plot this report has no data for; the message goes into report.md."""


def _clean(obj):
    """JSON has no NaN: write null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _get(d, *path):
    """d[path[0]][path[1]]..., or None where any level is missing."""
    for key in path:
        d = d.get(key) if isinstance(d, dict) else None
    return d


def _num(x) -> float | None:
    """A finite number as float; None for None, NaN, inf and non-numbers."""
    ok = isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
    return float(x) if ok else None


def _fmt(x, spec: str = ".2f", unit: str = "") -> str:
    return DASH if _num(x) is None else f"{_num(x):{spec}}{unit}"


def _pair(p) -> list:
    """A [lo, hi] list from report data, as two floats or Nones."""
    return [_num(v) for v in (list(p) if isinstance(p, (list, tuple)) else []) + [None, None]][:2]


def _speedup(sp) -> str:
    """'1.84x [1.52, 2.20]': geomean [95% CI]; '(n=1)' where a CI over one prompt would be empty."""
    lo, hi = _pair(_get(sp, "ci95"))
    g = _fmt(_get(sp, "geomean"), ".2f", "x")
    if g == DASH or lo is None or hi is None:
        return g
    return f"{g} (n={_get(sp, 'n')})" if (_get(sp, "n") or 0) < 2 else f"{g} [{lo:.2f}, {hi:.2f}]"


def _spec_methods(report: dict) -> list[dict]:
    return [m for m in report.get("methods", []) if m.get("family") == "specdec"]


def _machine(report: dict) -> str:
    e = report.get("environment") or {}
    chip = f"{e['gpu']} (host {e.get('cpu')})" if e.get("gpu") else e.get("cpu", "?")
    return (f"{chip} · {e.get('threads', '?')} threads · {e.get('dtype') or 'dtype n/a'} · {e.get('device', '?')}"
            f" · specdec {e.get('git_commit') or '?'}")


def _table(header: list[str], rows: list[list]) -> list[str]:
    align = "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"
    return ["| " + " | ".join(header) + " |", align] + ["| " + " | ".join(map(str, r)) + " |" for r in rows] + [""]


OVERALL = [  # (column, key in method["overall"], format, unit)
    ("tok/s", "tokens_per_s", ".1f", ""), ("ms/token", "ms_per_token", ".1f", ""),
    ("prefill ms", "prefill_ms_mean", ".1f", ""), ("decode ms/token", "decode_ms_per_token", ".1f", ""),
    ("acceptance", "acceptance_rate", ".3f", ""), ("alpha", "alpha", ".3f", ""), ("tokens/target call", "tokens_per_target_call", ".2f", ""),
    ("drafted/step", "mean_drafted_per_step", ".2f", ""), ("draft time share", "draft_time_share", ".1%", ""),
    ("loop ms/pass", "loop_ms_per_pass", ".2f", ""), ("c", "cost_ratio_c", ".4f", ""), ("verify cost", "verify_cost", ".2f", ""),
    ("lost at token boundaries", "boundary_loss_share", ".1%", ""),
    ("predicted", "predicted_speedup", ".2f", "x")]
DEFINITIONS = [
    "- **speedup**: per-prompt paired ratio (baseline ms/token / method ms/token), geometric mean over prompts, "
    "bootstrap 95% CI over prompts; **median [IQR]** of the same ratios. **predicted**: "
    "(1 − a^(k+1)) / ((1 − a)(k·c + verify cost)) (Leviathan et al. 2023) with a = **alpha**, the maximum-"
    "likelihood per-token acceptance probability: accepted / (accepted + steps that rejected a draft).",
    "- **tokens/target call** includes the prefill call and counts the bonus/correction token. **acceptance** = "
    "accepted drafts / drafted tokens. **drafted/step**: drafts per verification pass. **draft time share**: "
    "drafter time / total time. **loop ms/pass**: the time neither the target's passes nor the drafter took "
    "(the loop's own work: context, sources, schedule, bookkeeping), per target pass.",
    "- **c**: draft forward time / target forward time (model-free drafters: drafting time per proposal slot). "
    "**verify cost**: target time for k+1 tokens / for 1 token. **lost at token boundaries** (a draft with "
    "another tokenizer): steps whose first rejected token read like the target's own text, cut at another place, "
    "over the steps it proposed in. `–`: not measured for this method.", ""]


def _md_machine(report: dict) -> list[str]:
    """The machine while the trials ran: busy or quiet, and the trials run again after a stall."""
    m = report.get("machine")
    if not m:
        return []
    rerun = ", ".join(f"{name} {r['rerun']} of {r['trials']}" + (f" ({r['unclean']} never clean, left out of the "
                      "medians)" if r.get("unclean") else "") for name, r in m["reruns"].items() if r["rerun"])
    state = ("**BUSY**: " + "; ".join(m["reasons"]) + ". Ratios measured on a busy machine can be off; run again "
             "on a quiet one." if m["busy"] else "quiet")
    return [f"**Machine during the trials:** {state} (other processes {_fmt(m.get('others_cores'))} cores, steal "
            f"{_fmt(100 * m['steal_share'] if _num(m.get('steal_share')) is not None else None, '.1f', '%')}, "
            f"load average {_fmt(m['loadavg'][0])}). Trials run again, each after a quiet moment, because they met "
            f"interference (others took over {TRIAL_CORES} cores while they ran, or they took over {STALL}x the "
            f"fastest other trial of their method and prompt): {rerun or 'none'}.", ""]


def _md_header(report: dict) -> list[str]:
    e, methods = report.get("environment") or {}, report.get("methods", [])
    machine = "; ".join(filter(None, [e.get("cpu_id"), f"{e.get('cpu_count')} CPUs"]))
    env = (f"{e.get('cpu')} ({machine}), {e.get('threads')} threads, device {e.get('device')}"
           + (f" ({e['gpu']})" if e.get("gpu") else "") + f", {e.get('dtype')}"
           + (f", engine {e['engine']}" if e.get("engine") else "")
           + (f" (kernel {e['native_kernel']})" if e.get("native_kernel") else "")
           + f"; python {e.get('python')}, torch {e.get('torch')}, transformers {e.get('transformers')}, "
           f"specdec {e.get('specdec')}; commit {e.get('git_commit') or DASH}; {e.get('date')}")
    load = ", ".join(f"{k} {_fmt(v)} s" for k, v in (report.get("load_seconds") or {}).items())
    first = _get((report.get("prompts") or [None])[0], "id")
    warm = {m["name"]: [r["seconds"] for r in report.get("records", []) if r.get("method") == m["name"]
                        and r.get("prompt") == first and _num(r.get("seconds")) is not None] for m in methods}
    head = ["# specdec benchmark report", "", f"**Environment:** {env}", "",
            "**Config:** `" + ", ".join(f"{k}={v}" for k, v in (report.get("config") or {}).items()) + "`", "",
            f"**Load times:** {load or DASH}", ""] + _md_machine(report)
    if not methods:
        return head
    return head + ["## Cold (first-call) latency", ""] + _table(
        ["method", "cold s (first call)", "warm s (median of trials)"],
        [[m["name"], _fmt(m.get("cold_seconds")), _fmt(np.median(warm[m["name"]]) if warm[m["name"]] else None)]
         for m in methods]) + [f"Both on the first prompt (`{first}`); the cold call pays one-time setup.", ""]


def _md_tables(report: dict) -> list[str]:
    """Overall, per category, acceptance by position and measured costs."""
    methods, spec, costs = report.get("methods", []), _spec_methods(report), report.get("costs") or {}
    lines = ["## Overall", ""] + _table(
        ["method", "n", "speedup [95% CI]", "median [IQR]", "decode speedup [95% CI]"] + [c for c, *_ in OVERALL],
        [[m["name"], _get(m, "overall", "speedup", "n") or DASH, _speedup(_get(m, "overall", "speedup")),
          _fmt(_get(m, "overall", "speedup", "median")) + " [{}, {}]".format(
              *map(_fmt, _pair(_get(m, "overall", "speedup", "iqr")))),
          _speedup(_get(m, "overall", "decode_speedup"))]
         + [_fmt(_get(m, "overall", key), spec_, unit) for _, key, spec_, unit in OVERALL] for m in methods])
    cats = sorted({c for m in methods for c in (m.get("categories") or {})})
    lines += DEFINITIONS + ["## Speedup by category", ""] + _table(
        ["method"] + cats, [[m["name"]] + [_speedup(_get(m, "categories", c, "speedup")) for c in cats]
                            for m in methods])
    lines += ["Geometric mean of per-prompt speedups [bootstrap 95% CI].", ""]
    vs = [m for m in methods if _get(m, "overall", "vs_llama_cpp")]
    if vs:
        lines += ["## Speedup over llama.cpp's own plain decoding", ""] + _table(
            ["method", "overall"] + cats, [[m["name"], _speedup(_get(m, "overall", "vs_llama_cpp"))]
                                           + [_speedup(_get(m, "categories", c, "vs_llama_cpp")) for c in cats]
                                           for m in vs])
        lines += ["The same per-prompt ratios with `llama.cpp-greedy` (llama.cpp's own greedy loop, through "
                  "llama-cpp-python, on the same weights as GGUF) as the baseline: how each method compares with "
                  "the runtime a CPU user would otherwise pick.", ""]
    decode = [m for m in methods if any(_get(m, "categories", c, "decode_speedup") for c in cats)]
    if decode:
        normal = next((m for m in methods if m["name"] == "normal"), {})
        lines += ["## Decode-only speedup by category", ""] + _table(
            ["method"] + cats, [[m["name"]] + [_speedup(_get(m, "categories", c, "decode_speedup")) for c in cats]
                                for m in decode]
            + [["prefill share of `normal`'s time"] + [_fmt(100 * (_num(_get(normal, "categories", c, "prefill_share"))
                                                                  or math.nan), ".0f", "%") for c in cats]])
        lines += ["The same ratio over the time after the prefill pass (per token after the first), which is the "
                  "same work with or without speculation: the part a drafter can speed up. Where answers are "
                  "short or prompts long, the prefill (its share of plain decoding's time in the last row) holds "
                  "the end-to-end speedup below this one.", ""]
    width = max([len(_get(m, "overall", "accepted_per_position") or []) for m in spec] + [0])
    lines += ["## Acceptance by draft position", ""]
    lines += _table(["method", "acceptance"] + [str(i + 1) for i in range(width)], [
        [m["name"], _fmt(_get(m, "overall", "acceptance_rate"), ".3f")]
        + [_fmt(v, ".3f") for v in ((_get(m, "overall", "accepted_per_position") or []) + [None] * width)[:width]]
        for m in spec]) if spec else ["No speculative methods.", ""]
    lines += ["Column i: among verification passes that proposed at least i drafts, the fraction in which drafts "
              "1..i were all accepted.", "", "## Measured costs", "",
              f"Target forward (1 token after 256 cached): {_fmt(costs.get('target_forward_ms'))} ms.", ""]
    lines += _table(["k", "verify cost (k+1 tokens / 1 token)"],
                    [[k, _fmt(v)] for k, v in (costs.get("verify_cost") or {}).items()])
    drafts = costs.get("drafts") or {}
    return lines + _table(
        ["drafter", "forward ms, apart", "c, apart", "c in the loop"],
        [[f"draft model `{n}`", _fmt(d.get("forward_ms")), _fmt(d.get("c"), ".4f"), DASH] for n, d in drafts.items()]
        + [[f"`{m['name']}`", DASH, DASH, _fmt(_get(m, "overall", "cost_ratio_c"), ".4f")] for m in spec]) + [
        "c: drafting time per drafted token over a one-token target pass. Apart: one warm draft pass, timed "
        "in a loop of its own. In the loop: the drafter's time as the method ran, where a draft model's first "
        "pass after each target pass reads its weights from memory again; what the predictions and the "
        "ceilings use.", ""]


CEILING_KINDS = (("lookup", "prompt lookup"), ("datastore", "datastore"),
                 ("lookup_or_datastore", "lookup or datastore"), ("draft", "draft model"),
                 ("lookup_or_draft", "lookup or draft"), ("all_three", "all three"))
# The `auto` method that drafts from each kind's sources, whose measured speedup sits beside its ceiling.
CEILING_METHODS = {"lookup": "spec-ngram-kauto", "lookup_or_datastore": "spec-store-kauto",
                   "draft": "spec-draft-kauto", "all_three": "spec-composite-kauto"}


def _md_ceilings(report: dict) -> list[str]:
    """Tokens per verification pass at best, by drafter, beside the best measured."""
    c = report.get("ceilings")
    if not c:
        return []
    kinds = [(key, label) for key, label in CEILING_KINDS if key in c]
    spec = _spec_methods(report)
    rows = []
    for where in sorted(_get(c, "lookup", "categories") or {}) + ["overall"]:
        path = ("overall",) if where == "overall" else ("categories", where)
        measured = [(v, m["name"]) for m in spec if (v := _num(_get(m, *path, "tokens_per_step"))) is not None]
        best = max(measured, default=None)
        rows.append([where] + [_fmt(_get(c, key, *path)) for key, _ in kinds]
                    + [f"{best[0]:.2f} ({best[1]})" if best else DASH])
    return ["## How far the drafters could go", ""] + _table(
        ["category"] + [f"{label} at best" for _, label in kinds] + ["measured best"], rows) + [
        f"Tokens per verification pass (after the prefill) at best, with up to {c.get('k_max')} drafts a "
        "pass: each drafter replayed against the baseline's greedy output, which is also speculative "
        "decoding's output, with the fewest passes any schedule could make and drafting counted free. "
        "A verification pass never costs less than a plain decoding step, so this also bounds the drafter's "
        "decode speedup. **lookup or datastore** (the default's sources), **lookup or draft**, **all three**: "
        "the best of them at each pass (a composite drafter at best). **measured best**: tokens per "
        "verification pass of our best method here (in half precision a method whose output parts from the "
        "baseline's at a tie can exceed the replay).", ""] + _md_speedup_ceilings(report, kinds)


def _ceiling_methods(speedup: dict) -> dict[str, str]:
    """Ceiling kind -> the `auto` method drafting from its sources."""
    method_of = dict(CEILING_METHODS)
    if "all_three" not in speedup:  # no datastore: the composite is lookup + draft
        method_of["lookup_or_draft"] = CEILING_METHODS["all_three"]
    return method_of


def _md_speedup_ceilings(report: dict, kinds: list[tuple[str, str]]) -> list[str]:
    """The perfect schedule's speedup at the engine's measured pass costs, beside the measured one."""
    sp = _get(report, "ceilings", "speedup")
    if not sp:
        return []
    measured = {m["name"]: m for m in _spec_methods(report)}
    method_of = _ceiling_methods(sp)
    cols = [(key, label, measured.get(method_of.get(key))) for key, label in kinds]
    rows = []
    for where in sorted(_get(sp, "lookup", "categories") or {}) + ["overall"]:
        path = ("overall",) if where == "overall" else ("categories", where)
        rows.append([where] + [_fmt(_get(sp, key, *path), ".2f", "x") + (
            f" ({_fmt(_get(m, *path, 'speedup', 'geomean'), '.2f', 'x')})" if m else "") for key, _, m in cols])
    kind = "end to end" if sp.get("end_to_end") else "decode only"
    return ["### With a perfect schedule, at this engine's pass costs", ""] + _table(
        ["category"] + [label for _, label, _ in cols], rows) + [
        f"Speedup over plain decoding ({kind}, geometric mean of per-prompt ratios) of a schedule that knows "
        "how many of each source's proposals the target will accept: it drafts exactly those from the best "
        "source, or takes a plain step, paying this engine's measured pass over n tokens (`costs.pass_cost`) "
        f"and the draft's cost c a token{_charged(report)}. No schedule of these drafters does better, up to "
        "timing noise. In "
        "brackets: the measured speedup of the `auto` method drafting from the same sources; the gap is what "
        "a schedule that cannot see ahead leaves.", ""] + _md_replayed(report, sp, measured, method_of)


def _md_replayed(report: dict, sp: dict, measured: dict[str, dict], method_of: dict[str, str]) -> list[str]:
    """Perfect, `auto` replayed, measured: where the `auto` methods' speedup goes."""
    rp = _get(report, "ceilings", "replayed")
    if not rp:
        return []
    labels = dict(CEILING_KINDS)
    kinds = [k for k in rp if k != "k_max"]
    rows = []
    for where in sorted(_get(rp, kinds[0], "categories") or {}) + ["overall"]:
        path = ("overall",) if where == "overall" else ("categories", where)
        row = [where]
        for kind in kinds:
            m = measured.get(method_of.get(kind))
            row += [_fmt(_get(sp, kind, *path), ".2f", "x"), _fmt(_get(rp, kind, *path), ".2f", "x"),
                    _fmt(_get(m, *path, "speedup", "geomean"), ".2f", "x") if m else DASH]
        rows.append(row)
    header = ["category"] + [f"{labels[k]}: {col}" for k in kinds for col in ("perfect", "auto replayed", "measured")]
    return ["### Where `auto`'s speedup goes", ""] + _table(header, rows) + [
        "Over plain decoding, as above. **auto replayed**: the shipped schedule (a fresh `auto` each prompt, "
        f"at most {rp['k_max']} drafts a step) choosing through the same offers, learning as it goes, each pass "
        "charged this engine's measured cost and nothing else. Perfect over replayed is what a schedule that "
        "cannot see ahead loses; replayed over measured is what the loop costs around the target's passes "
        "(the drafter's lookups, the schedule's arithmetic, reading the logits), and timing noise.", ""]


def _charged(report: dict) -> str:
    cost = _get(report, "ceilings", "draft_cost")
    return f" ({cost['c']:.3f}, measured {cost['measured']})" if cost else ""


def _md_composite_vs_sources(report: dict) -> list[str]:
    lines = []
    for name, rows in (report.get("composite_vs_sources") or {}).items():
        speedup = {m["name"]: m for m in report.get("methods", [])}[name]
        table = []
        for cat, r in rows.items():
            path = ("overall",) if cat == "overall" else ("categories", cat)
            table.append([cat, _fmt(_get(speedup, *path, "speedup", "geomean"), ".2f", "x"),
                          f"{r['best_source']} {_fmt(r['best_source_speedup']['geomean'], '.2f', 'x')}",
                          _speedup(r["ratio"])])
        lines += [f"## `{name}` against its own sources", ""] + _table(
            ["category", f"{name} over normal", "faster source alone (over normal)", f"{name} over it [95% CI]"],
            table) + [
            "A composite drafter is prompt lookup where the context matches, else the datastore's continuation "
            "(where it has one), else the draft model (where it has one). Per category, its speedup paired per "
            "prompt over the fastest of its parts run alone at the same k (lookup; lookup with the datastore; "
            "the draft; chosen by their geometric means there). Below 1.00x it loses to one of its own parts.",
            ""]
    return lines


def _md_mismatches(report: dict) -> list[str]:
    dtype, n_prompts = _get(report, "environment", "dtype"), len(report.get("prompts") or [])
    tol = 0.25 if dtype in HALF_DTYPES else 1e-3
    lines = ["## Greedy mismatches vs `normal`", ""]
    temperature = _num(_get(report, "config", "temperature")) or 0.0
    if temperature > 0:  # the runner checks outputs only under greedy decoding
        return lines + [f"Not checked: sampling at temperature {temperature:g}, outputs differ by design.", ""]
    for m in (m for m in report.get("methods", []) if m.get("family") != "baseline"):
        mm = m.get("mismatches") or []
        lines.append(f"- **{m['name']}**: " + (f"{len(mm)} of {n_prompts} prompts differ" if mm else "identical"))
        for x in mm:
            margin = _num(x.get("top2_margin"))
            what = (f"top-2 margin {margin:.3g}, margin to its token {_fmt(x.get('margin_to_theirs'), '.3g')}"
                    if margin is not None else f"one output is a prefix of the other (lengths "
                    f"{x.get('baseline_len')} vs {x.get('method_len')})")
            if x.get("float32_gap") is not None:
                what += (f"; in float32 the baseline's token leads by {_fmt(x['float32_gap'], '.3g')}, "
                         f"rounding moved that by {_fmt(x.get('rounding_shift'), '.3g')}")
            tie = x.get("tie")
            if tie is None:  # reports written before the runner judged ties itself
                tie = margin is not None and margin < tol
            verdict = "tie" if tie else "MISMATCH"
            lines.append(f"  - prompt `{x.get('prompt')}`, position {x.get('position')}: {what} → **{verdict}**")
    return lines + ["", f"tie = at the divergence the target's top-2 logit margin (or the margin to the other "
                        f"method's token) is within 4 rounding steps of {dtype} at that logit's magnitude (1e-3 in "
                        "float32): block and single-token passes round differently, so either token is the "
                        "target's greedy choice up to rounding. Where the gaps are wider, the target in float32 "
                        "decides: a tie when the low-precision pass's own rounding moves the gap between the two "
                        "tokens by at least float32's gap. MISMATCH = a real divergence to investigate.", ""]


def _batch_rows(report: dict) -> list[list[str]]:
    """One row per (B, method) of the batched study."""
    b = report["batched"]
    rows = []
    for size in b["batch_sizes"]:
        for name in b["methods"]:
            e = _get(b, "by_batch", str(size), name) or {}
            rows.append([str(size), name, _fmt(e.get("tokens_per_s"), ".1f"), _speedup(e.get("throughput_ratio")),
                         _fmt(_get(e, "latency_ms_per_token", "median"), ".1f"),
                         _fmt(_get(e, "latency_ms_per_token", "p90"), ".1f"), _fmt(e.get("acceptance_rate"), ".3f"),
                         _fmt(e.get("mean_drafted_per_step"), ".2f"),
                         DASH if e.get("row_mismatches") is None else str(e["row_mismatches"])])
    return rows


BATCH_HEADER = ["B", "method", "tok/s (all rows)", "throughput vs plain [95% CI]", "ms/token per request (median)",
                "p90", "acceptance", "drafts/row/step", "rows ≠ plain"]


def crossover_sentence(report: dict) -> str:
    c = report["batched"]["crossover"]
    best = c["best"]
    if not best:
        return "No speculative method ran (a draft model or the n-gram drafter is needed)."
    trail = ", ".join(f"B={b}: {v['method']} {v['ratio']:.2f}x" for b, v in best.items())
    if c["stops_paying_at"] is None:
        return (f"Speculation pays at every batch size measured (best method per B: {trail}); no crossover up to "
                f"B={max(report['batched']['batch_sizes'])} on this machine.")
    if c["pays_up_to"] is None:
        return f"Speculation does not pay even at the smallest batch measured (best method per B: {trail})."
    return (f"**Crossover: speculation pays up to B={c['pays_up_to']} and stops paying at B={c['stops_paying_at']}** "
            f"on this machine (best method's throughput vs plain batched decoding, per B: {trail}).")


def _md_batched(report: dict) -> list[str]:
    b = report["batched"]
    v = b["verify_costs"]
    ks = list(next(iter(v["ratio"].values())))
    lines = ["## Batched requests", "", crossover_sentence(report), ""] + _table(BATCH_HEADER, _batch_rows(report))
    lines += [f"- {len(b['prompts'])} prompts (a fixed shuffle of the selection, so batches mix categories), "
              "split into batches of each B; every method decodes every batch, in balanced orders (each method "
              "right after each other one equally often). "
              "**throughput vs plain**: per batch, the method's tokens/s over plain batched `generate`'s on the "
              "same batch; geometric mean over batches, bootstrap 95% CI. **ms/token per request**: each row's "
              "time from the call's start to its last token, over its tokens. **drafts/row/step**: drafted "
              "tokens per row per verify step (with `auto`, the k it picked). **rows ≠ plain**: greedy rows "
              "that differ from plain decoding's (must be 0).", "",
              f"### Verify pass cost: B rows of k + 1 tokens vs one row of one token ({v['one_token_ms']:.2f} ms)",
              ""]
    lines += _table(["B"] + [f"k={k}" for k in ks],
                    [[size] + [f"{v['ratio'][size][k]:.2f}x" for k in ks] for size in v["ratio"]])
    lines += ["One decode pass over a few rows is memory-bound: the weights are read once for all rows, so a pass "
              "of B·(k+1) tokens costs little more than one token. As B·(k+1) grows the pass turns compute-bound, "
              "its cost grows with its rows, and accepted drafts stop coming nearly for free.", ""]
    return lines


def _ms(x) -> str:
    return _fmt(None if _num(x) is None else 1000 * x, ".1f")


def _serving_rows(report: dict) -> list[list[str]]:
    s = report["serving"]
    rows = []
    for level, by in s["levels"].items():
        for e in s["endpoints"]:
            v = by.get(e["name"]) or {}
            spec = v.get("speculation") or {}
            rt = v.get("response_timings") or {}
            acc = spec.get("acceptance_rate", rt.get("acceptance_rate"))
            rows.append([level, e["name"], _fmt(v.get("throughput_tokens_per_s"), ".1f"),
                         " / ".join(_fmt(x, ".0f") for x in v.get("trial_throughputs") or []) or DASH,
                         _ms(_get(v, "ttft", "p50")), _ms(_get(v, "ttft", "p90")), _ms(_get(v, "tpot", "p50")),
                         _ms(_get(v, "tpot", "p90")), _ms(_get(v, "itl", "p50")), _ms(_get(v, "seconds", "p50")),
                         _ms(_get(v, "seconds", "p90")), _fmt(acc, ".3f") if _num(acc) is not None else "n/a",
                         _fmt(spec.get("mean_acceptance_length"), ".2f") if spec else "n/a",
                         f"{len(v.get('errors') or [])}/{v.get('requests', 0)}"])
    return rows


SERVING_HEADER = ["concurrency", "endpoint", "tok/s (all requests)", "tok/s by trial", "TTFT p50 ms", "p90",
                  "TPOT p50 ms", "p90", "inter-chunk p50 ms", "end-to-end p50 ms", "p90", "acceptance",
                  "mean acceptance length", "errors"]


def _serving_comparisons(report: dict) -> list[str]:
    """Each endpoint against the first: per prompt at 1 in flight, where each prompt went to
    them in turn; per level, throughput with the range of the trials' own ratios (serving.py)."""
    s, lines = report["serving"], []
    for name, p in s["paired"].items():
        lines.append(f"{name} over {p['baseline']} at {p['concurrency']} in flight, time per token paired per "
                     f"prompt: {_speedup(p['speedup'])}")
    for level, by in s["levels"].items():
        for name, v in by.items():
            if "vs_baseline" not in v:
                continue
            vs, trials = v["vs_baseline"], [t for t in map(_num, v["vs_baseline"]["trials"]) if t is not None]
            spread = f" (trials {min(trials):.2f}-{max(trials):.2f})" if len(trials) > 1 else ""
            lines.append(f"{name} over {vs['baseline']} at {level} in flight, throughput: "
                         f"{_fmt(vs['throughput'], '.2f', 'x')}{spread}")
    return lines


def _md_serving(report: dict) -> list[str]:
    s = report["serving"]
    lines = ["## Serving endpoints", "", f"Arrivals: {s.get('arrivals', 'closed loop')}.", ""] + _table(
        ["endpoint", "URL", "model", "server"], [[e["name"], e["url"], e["model"] or DASH, e["kind"]]
                                                  for e in s["endpoints"]])
    lines += [""] + [f"- {line}" for line in _serving_comparisons(report)] + [""]
    if s["paired"]:
        cats = sorted({c for p in s["paired"].values() for c in p.get("categories", {})})
        lines += ["", "By category (the same ratio):", ""] + _table(
            ["endpoint"] + cats, [[name] + [_speedup(_get(p, "categories", c)) for c in cats]
                                  for name, p in s["paired"].items()])
    lines += ["## Per concurrency level", ""] + _table(SERVING_HEADER, _serving_rows(report))
    lines += ["- **tok/s by trial**: each trial's throughput; the endpoints' trials run back to back, so the "
              "spread says how far the machine moved between them. TTFT: time to the first content chunk. "
              "**TPOT**: (end − TTFT) / (completion_tokens − 1), "
              "completion_tokens from the stream's `usage`. **Inter-chunk**: time between content chunks, kept "
              "apart from TPOT: vLLM and SGLang send a verification step's tokens as one chunk, llama-server one "
              "chunk per token. **acceptance**, **mean acceptance length** (1 + accepted / drafts): from the "
              "server's own counters, as deltas around the timed requests (vLLM `vllm:spec_decode_*`, "
              "llama-server `llamacpp:spec_decode_*` with `--metrics`; else llama-server's per-response "
              "`timings`); n/a where the server offers none. **errors**: failed requests / all, kept per request "
              f"in `report.json`. Prompt-cached tokens over all requests: "
              f"{', '.join(str(sum(v.get('cached_tokens', 0) for v in by.values())) for by in s['levels'].values())} "
              "(per level; should be 0).", ""]
    errors = [(level, name, err) for level, by in s["levels"].items() for name, v in by.items()
              for err in (v.get("errors") or [])[:3]]
    if errors:
        lines += ["Errors (first three per endpoint and level):", ""] + [
            f"- concurrency {level}, {name}: {err}" for level, name, err in errors] + [""]
    return lines


def _markdown(report: dict, plots: dict[str, tuple[bool, str | None]]) -> str:
    if "serving" in report:
        lines = _md_header(report) + _md_serving(report) + ["## Plots", ""]
    elif "batched" in report:
        lines = _md_header(report) + _md_batched(report) + ["## Plots", ""]
    else:
        lines = (_md_header(report) + _md_tables(report) + _md_composite_vs_sources(report) + _md_ceilings(report)
                 + _md_mismatches(report)
                 + ["## Plots", ""])
    for name, (written, note) in plots.items():
        lines += [f"![{name}]({name}.png)"] * written + [f"- `{name}.png`: {note}"] * bool(note) + [""]
    return "\n".join(lines)


def _plot_speedup_by_category(report, fig, ax):
    methods = [m for m in report.get("methods", []) if m.get("family") != "baseline"]
    if not methods:
        raise _Skip("no method besides the baseline")
    cats = sorted({c for m in methods for c in (m.get("categories") or {})}) + ["overall"]
    width, ys = 0.8 / len(methods), [0.5, 2.0]
    from matplotlib import colormaps

    colors = colormaps["tab20"].colors  # more methods than tab10 has colours
    for i, m in enumerate(methods):
        bars = []  # (x, geomean, error below, error above)
        for j, cat in enumerate(cats):
            sp = _get(m, "overall", "speedup") if cat == "overall" else _get(m, "categories", cat, "speedup")
            g, (lo, hi) = _num(_get(sp, "geomean")), _pair(_get(sp, "ci95"))
            if g:
                lo, hi = lo or g, hi or g
                bars.append((j + (i - (len(methods) - 1) / 2) * width, g, max(g - lo, 0), max(hi - g, 0)))
                ys += [lo, hi]
        if bars:
            x, g, below, above = zip(*bars)
            ax.bar(x, np.array(g) - 1, width, bottom=1.0, yerr=[below, above], capsize=2, label=m["name"],
                   color=colors[i % len(colors)], error_kw={"lw": 0.8})
    ax.axhline(1.0, ls="--", color="k", lw=1)
    ax.set_yscale("log", base=2)
    ax.set_ylim(min(ys) / 1.15, max(ys) * 1.15)
    ax.yaxis.set_major_formatter(lambda y, _: f"{y:g}x")
    ax.set_xticks(range(len(cats)), [c.replace("_", " ") for c in cats], rotation=20, ha="right")
    ax.set(title="Speedup over normal decoding by category (geomean, 95% CI)", xlabel="prompt category",
           ylabel="speedup (log scale)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))


def _plot_acceptance_by_position(report, fig, ax):
    curves = {m["name"]: [_num(v) for v in _get(m, "overall", "accepted_per_position") or []]
              for m in _spec_methods(report)}
    curves = {name: [np.nan if v is None else v for v in c] for name, c in curves.items() if any(map(_num, c))}
    if not curves:
        raise _Skip("no speculative method has per-position acceptance data")
    for name, y in curves.items():
        ax.plot(range(1, len(y) + 1), y, marker="o", label=name)
    ax.set_xticks(range(1, max(map(len, curves.values())) + 1))
    ax.set_ylim(0, 1.05)
    ax.set(title="Acceptance by draft position", xlabel="draft position i",
           ylabel="P(drafts 1..i all accepted | ≥ i drafted)")
    ax.legend(fontsize=7)


def _plot_speedup_vs_k(report, fig, ax):
    spec = [m for m in _spec_methods(report) if isinstance(m.get("k"), int)]
    groups = {d: sorted((m for m in spec if str(m.get("drafter")) == d), key=lambda m: m["k"])
              for d in sorted({str(m.get("drafter")) for m in spec})}  # drafter -> its methods by k
    if not groups:
        raise _Skip("no fixed k to sweep (run with --num-draft-tokens auto,2,4,8)")
    for i, (drafter, ms) in enumerate(groups.items()):
        ks, sps = [m["k"] for m in ms], [_get(m, "overall", "speedup") for m in ms]
        g = np.array([_num(_get(s, "geomean")) or np.nan for s in sps])
        ci = np.array([[v or np.nan for v in _pair(_get(s, "ci95"))] for s in sps])
        err = np.clip(np.nan_to_num([g - ci[:, 0], ci[:, 1] - g]), 0, None)
        ax.errorbar(ks, g, yerr=err, fmt="o-", capsize=3, color=f"C{i}", label=f"{drafter}: measured")
        pred = [_num(_get(m, "overall", "predicted_speedup")) or np.nan for m in ms]
        ax.plot(ks, pred, "s--", mfc="none", color=f"C{i}", label=f"{drafter}: predicted")
    ax.axhline(1.0, ls=":", color="0.4", lw=1)
    ax.set_xticks(sorted({m["k"] for ms in groups.values() for m in ms}))
    single = max(map(len, groups.values())) < 2
    ax.set(title="Speedup vs drafted tokens per step" + (" (one k only: no trend)" if single else ""),
           xlabel="k (max drafts per step)", ylabel="speedup over normal decoding (x)")
    ax.legend(fontsize=7)
    return "only one k value per drafter: points, no trend (run with several k)" if single else None


def _plot_break_even(report, fig, ax):
    from matplotlib.colors import LogNorm

    spec = _spec_methods(report)
    ks = [k for k in _get(report, "config", "ks") or [m.get("k") for m in spec] if isinstance(k, int)]
    k = ks[len(ks) // 2] if ks else 4  # the runner's middle fixed k; with only `auto`, k = 4
    v = _num(_get(report, "costs", "verify_cost", str(k)))
    note, v = (None, v) if v else (f"no measured verify cost for k={k}: assumed 1.0", 1.0)
    pts = [(m["name"], _num(_get(m, "overall", "alpha")), _num(_get(m, "overall", "cost_ratio_c")),
            m.get("k")) for m in spec]
    pts = [p for p in pts if p[1] is not None and p[2] is not None]
    a, c = np.meshgrid(np.linspace(0, 1, 121), np.linspace(0, max([1.0] + [1.1 * p[2] for p in pts]), 121))
    s = np.vectorize(predicted_speedup)(a, k, c, v)
    span = max(abs(math.log(s.min())), abs(math.log(s.max())), 0.1)  # centre the diverging colours on 1.0x
    cf = ax.contourf(a, c, s, levels=np.geomspace(s.min(), s.max(), 20), cmap="RdBu",
                     norm=LogNorm(math.exp(-span), math.exp(span)))
    fig.colorbar(cf, ax=ax, label="predicted speedup (x)", format="%.2g")
    if s.min() < 1.0 < s.max():
        ax.clabel(ax.contour(a, c, s, levels=[1.0], colors="k", linewidths=1.5), fmt={1.0: "break-even"}, fontsize=8)
    for i, (name, alpha, cost, mk) in enumerate(pts):  # labels staggered: n-gram points all sit near c = 0
        ax.plot(alpha, cost, "o" if mk == k else "^", mfc="white", mec="k", clip_on=False, zorder=3)
        ax.annotate(name, (alpha, cost), xytext=(4, 4 + 10 * (i % 3)), textcoords="offset points", fontsize=7)
    ax.set(title=f"Predicted speedup at k={k}, verify cost {v:.2f} (▲: a method at another k)",
           xlabel="per-token acceptance probability α (accepted / (accepted + rejections))", ylabel="draft cost ratio c (draft / target forward)")
    return note


def _plot_batch_scaling(report, fig, ax):
    b = report["batched"]
    fig.delaxes(ax)
    left, right = fig.subplots(1, 2)
    sizes = b["batch_sizes"]
    for i, name in enumerate(b["methods"]):
        es = [_get(b, "by_batch", str(size), name) or {} for size in sizes]
        style = dict(marker="o", color="k" if name == "normal" else f"C{i}", ls="-" if name == "normal" else "--",
                     label="plain" if name == "normal" else name)
        left.plot(sizes, [_num(e.get("tokens_per_s")) or np.nan for e in es], **style)
        right.plot(sizes, [_num(_get(e, "latency_ms_per_token", "median")) or np.nan for e in es], **style)
    stop = _get(b, "crossover", "stops_paying_at")
    for ax_ in (left, right):
        ax_.set_xscale("log", base=2)
        ax_.set_xticks(sizes, [str(x) for x in sizes])
        if stop is not None:
            ax_.axvline(stop, color="0.5", ls=":", lw=1)
    left.set(title="Throughput (new tokens/s over all rows)", xlabel="batch size B", ylabel="tokens/s")
    right.set(title="Per-request latency (median ms/token)", xlabel="batch size B", ylabel="ms per token")
    right.legend(fontsize=7)
    if stop is not None:
        left.annotate(f"crossover: B={stop}", (stop, left.get_ylim()[0]), xytext=(4, 8), textcoords="offset points",
                      fontsize=7, color="0.3")


def _plot_serving(report, fig, ax):
    s = report["serving"]
    fig.delaxes(ax)
    left, right = fig.subplots(1, 2)
    levels = [int(x) for x in s["levels"]]
    for i, e in enumerate(s["endpoints"]):
        vs = [s["levels"][str(c)].get(e["name"]) or {} for c in levels]
        style = dict(marker="o", color=f"C{i}", label=e["name"])
        left.plot(levels, [_num(v.get("throughput_tokens_per_s")) or np.nan for v in vs], **style)
        right.plot(levels, [1000 * (_num(_get(v, "tpot", "p50")) or np.nan) for v in vs], **style)
    for ax_ in (left, right):
        ax_.set_xscale("log", base=2)
        ax_.set_xticks(levels, [str(c) for c in levels])
    left.set(title="Throughput (output tokens/s, all requests)", xlabel="requests in flight", ylabel="tokens/s")
    right.set(title="Per-request TPOT (median)", xlabel="requests in flight", ylabel="ms per output token")
    right.legend(fontsize=7)


PLOTS = {"speedup_by_category": _plot_speedup_by_category, "acceptance_by_position": _plot_acceptance_by_position,
         "speedup_vs_k": _plot_speedup_vs_k, "break_even": _plot_break_even}
BATCH_PLOTS = {"batch_scaling": _plot_batch_scaling}
SERVING_PLOTS = {"serving_load": _plot_serving}


def write_plots(report: dict, out: Path) -> dict[str, tuple[bool, str | None]]:
    """Draw each plot into out/<name>.png (Agg, no pyplot state); name -> (written, note or None)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    result = {}
    chosen = SERVING_PLOTS if "serving" in report else BATCH_PLOTS if "batched" in report else PLOTS
    for name, draw in chosen.items():
        path, fig = Path(out) / f"{name}.png", Figure(figsize=(9, 5) if chosen is PLOTS else (12, 4.5))
        FigureCanvasAgg(fig)
        try:
            note = draw(report, fig, fig.add_subplot())
            fig.text(0.01, -0.02, _machine(report), fontsize=7, color="0.4")
            fig.savefig(path, dpi=110, bbox_inches="tight")
            result[name] = (True, note)
        except Exception as e:  # noqa: BLE001 -- one plot must never sink the report
            path.unlink(missing_ok=True)  # no stale plot from an earlier run
            result[name] = (False, f"skipped: {e}" if isinstance(e, _Skip) else f"skipped ({type(e).__name__}: {e})")
            print(f"report: {name}.png {result[name][1]}", file=sys.stderr)
    return result


def write_report(report: dict, out: Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(_clean(report), indent=1, allow_nan=False))
    (out / "report.md").write_text(_markdown(report, write_plots(report, out)), encoding="utf-8")


def print_summary(report: dict, file=None) -> None:
    """An aligned table on stdout: rich when installed (plain text in a pipe or log), else padded columns."""
    file = file or sys.stdout
    if "serving" in report:
        keep = [0, 1, 2, 3, 5, 7, 8, 10, 12]
        _print_table([SERVING_HEADER[i] for i in keep], [[r[i] for i in keep] for r in _serving_rows(report)],
                     report, file)
        print("\n".join(_serving_comparisons(report)), file=file)
        return
    if "batched" in report:
        header = BATCH_HEADER[:5] + ["acceptance", "drafts/row/step"]
        _print_table(header, [r[:5] + r[6:8] for r in _batch_rows(report)], report, file)
        print(crossover_sentence(report).replace("**", ""), file=file)
        return
    methods = report.get("methods", [])
    vs = any(_get(m, "overall", "vs_llama_cpp") for m in methods)  # llama.cpp's own decoding ran
    sp = _get(report, "ceilings", "speedup") or {}
    perfect = {name: _get(sp, kind, "overall") for kind, name in _ceiling_methods(sp).items() if kind in sp}
    header = ["method", "speedup [95% CI]"] + ["vs llama.cpp"] * vs + ["tok/s", "acceptance", "tokens/call",
                                                                       "predicted"] + ["perfect schedule"] * bool(sp)
    rows = [[m["name"], _speedup(_get(m, "overall", "speedup"))]
            + [_fmt(_get(m, "overall", "vs_llama_cpp", "geomean"), ".2f", "x")] * vs
            + [_fmt(_get(m, "overall", "tokens_per_s"), ".1f"), _fmt(_get(m, "overall", "acceptance_rate"), ".3f"),
               _fmt(_get(m, "overall", "tokens_per_target_call")),
               _fmt(_get(m, "overall", "predicted_speedup"), ".2f", "x")]
            + [_fmt(perfect.get(m["name"]), ".2f", "x")] * bool(sp) for m in methods]
    _print_table(header, rows, report, file)
    if _get(report, "machine", "busy"):
        print("BUSY machine: " + "; ".join(report["machine"]["reasons"]) + ". Run again on a quiet one.", file=file)


def _print_table(header, rows, report, file) -> None:
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich comes with transformers (via typer); plain padded columns otherwise
        widths = [max(map(len, col)) for col in zip(header, *rows)]
        print("\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [header] + rows), file=file)
        return
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, caption=_machine(report), caption_justify="left")
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=True)
    for r in rows:
        table.add_row(*r)
    tty = getattr(file, "isatty", lambda: False)()
    Console(file=file, width=None if tty else 200, highlight=False).print(table)
