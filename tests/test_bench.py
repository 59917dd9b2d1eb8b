"""The benchmark: its statistics, its prompt suite, and run_benchmark end to end on the real
model with a tiny config (float32, so every greedy method must reproduce `normal` exactly)."""
from __future__ import annotations

import json
import math
from collections import Counter, defaultdict

import pytest
import torch

from specdec.bench.runner import SCHEMA, BenchConfig, float32_check, run_benchmark, top2_margin
from specdec.bench.stats import (balanced_orders, break_even_alpha, expected_tokens_per_step, interleaved_order,
                                 predicted_speedup, required_alpha, summarize_ratios)
from specdec.bench.suite import DEFAULT_SUITE, GROUNDED, load_suite
from specdec.models.loading import load_model
from tiny import needs_model, save_tiny

MODEL = "smollm2-135m-instruct"
TORCH_THREADS = 2  # read by conftest.py




# ----------------------------------------------------------------------------- divergences


def _logits(**at) -> torch.Tensor:
    out = torch.zeros(8)
    for i, v in at.items():
        out[int(i[1:])] = v
    return out


@pytest.mark.parametrize("low, exact, tie", [
    # float32 prefers the baseline's token 1 by 0.5; one bf16 pass moves that gap by -1.0: rounding.
    (_logits(t1=29.0, t2=30.0), _logits(t1=30.5, t2=30.0), True),
    # float32 prefers the method's token 2: the method is right, whatever the bf16 pass says.
    (_logits(t1=30.0, t2=29.9), _logits(t1=30.0, t2=30.2), True),
    # float32 prefers token 1 by 5 and the pass moves the gap by only 0.25: not rounding, a bug.
    (_logits(t1=30.0, t2=25.25), _logits(t1=30.0, t2=25.0), False),
])
def test_float32_check(low, exact, tie):
    got = float32_check(low, exact, ours=1, theirs=2)
    assert got["tie"] is tie
    assert got["float32_gap"] == pytest.approx(float(exact[1] - exact[2]))
    assert got["float32_gap"] + got["rounding_shift"] == pytest.approx(float(low[1] - low[2]))


def test_top2_margin_sends_a_wide_bf16_divergence_to_float32(tmp_path):
    path = save_tiny(tmp_path / "tiny")
    target = load_model(path, dtype=torch.bfloat16)
    exact = load_model(path, dtype=torch.float32)
    prompt, prefix = [3, 7, 11, 5], [9, 2]
    exact.reset(8)
    logits = exact.forward(prompt + prefix, last_only=True)[-1]
    ours, bug = int(logits.argmax()), int(logits.argmin())  # a token float32 ranks last: a bug's pick
    loaded = []
    reference = lambda: loaded.append(1) or exact  # noqa: E731
    got = top2_margin(target, prompt, prefix, ours, bug, reference)
    assert got["tie"] is False and loaded and got["float32_gap"] > abs(got["rounding_shift"])
    # A float32 target is its own reference: the within-rounding test decides alone.
    loaded.clear()
    got = top2_margin(exact, prompt, prefix, ours, bug, reference)
    assert got["tie"] is False and "float32_gap" not in got and not loaded


# ----------------------------------------------------------------------------- stats


def test_summarize_ratios_geomean_and_ci():
    s = summarize_ratios([2.0, 0.5])
    assert s["n"] == 2
    assert s["geomean"] == pytest.approx(1.0, abs=1e-12)  # a 2x win and a 2x loss cancel
    lo, hi = s["ci95"]
    assert lo <= s["geomean"] <= hi and lo < hi
    assert 0.5 <= lo and hi <= 2.0
    assert s["median"] == pytest.approx(1.25)  # the arithmetic median, unlike the geomean
    s = summarize_ratios([1.1, 1.3, 0.9, 1.6, 1.2])
    assert s["ci95"][0] <= s["geomean"] <= s["ci95"][1]
    assert s["iqr"][0] <= s["median"] <= s["iqr"][1]
    assert summarize_ratios([1.1, 1.3, 0.9]) == summarize_ratios([1.1, 1.3, 0.9])  # seeded bootstrap


def test_summarize_ratios_single_and_empty():
    s = summarize_ratios([1.7])
    assert s == {"n": 1, "geomean": pytest.approx(1.7), "ci95": [1.7, 1.7], "median": 1.7, "iqr": [1.7, 1.7]}
    e = summarize_ratios([])
    assert e["n"] == 0 and math.isnan(e["geomean"]) and all(math.isnan(x) for x in e["ci95"])


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_expected_tokens_per_step(k):
    assert expected_tokens_per_step(0.0, k) == 1.0
    assert expected_tokens_per_step(1.0, k) == k + 1
    assert expected_tokens_per_step(1 - 1e-9, k) == pytest.approx(k + 1, rel=1e-6)  # continuous at 1
    assert expected_tokens_per_step(0.5, k) == pytest.approx(sum(0.5 ** i for i in range(k + 1)))
    values = [expected_tokens_per_step(a / 10, k) for a in range(11)]
    assert values == sorted(values)


def test_predicted_speedup():
    for alpha in (0.0, 0.3, 0.8, 1.0):
        for k in (1, 4):
            # a free draft and a verify pass as cheap as one token: the speedup is the tokens per step
            assert predicted_speedup(alpha, k, 0.0, 1.0) == pytest.approx(expected_tokens_per_step(alpha, k))
    assert predicted_speedup(0.8, 4, 0.1, 1.2) == pytest.approx(expected_tokens_per_step(0.8, 4) / (0.4 + 1.2))
    assert predicted_speedup(0.0, 4, 0.1) < 1.0  # drafting that is never accepted only costs


@pytest.mark.parametrize("k, c, v", [(4, 0.1, 1.0), (2, 0.05, 1.3), (8, 0.02, 1.5), (4, 0.0, 1.2)])
def test_break_even_alpha(k, c, v):
    a = break_even_alpha(k, c, v)
    assert 0.0 < a < 1.0
    assert predicted_speedup(a, k, c, v) == pytest.approx(1.0, abs=1e-6)
    assert predicted_speedup(a - 0.01, k, c, v) < 1.0 < predicted_speedup(a + 0.01, k, c, v)


def test_break_even_alpha_never_pays():
    assert math.isnan(break_even_alpha(4, 2.0, 1.0))  # even perfect acceptance: 5 / 9 < 1
    assert math.isnan(break_even_alpha(1, 0.0, 3.0))  # verifying costs more than 2 tokens gain


@pytest.mark.parametrize("goal, k, c, v", [(2.0, 4, 0.087, 1.07), (1.6, 8, 0.05, 1.2), (1.1, 2, 0.1, 1.0)])
def test_required_alpha(goal, k, c, v):
    a = required_alpha(goal, k, c, v)
    assert predicted_speedup(a, k, c, v) == pytest.approx(goal, abs=1e-6)
    assert predicted_speedup(a - 0.01, k, c, v) < goal < predicted_speedup(a + 0.01, k, c, v)
    assert required_alpha(goal + 0.1, k, c, v) > a  # a higher goal needs a better draft
    assert math.isnan(required_alpha((k + 1) / (k * c + v) + 0.01, k, c, v))  # beyond k+1 tokens per step


# ----------------------------------------------------------------------------- the prompt suite


def test_bundled_suite():
    prompts = load_suite()
    assert DEFAULT_SUITE.exists()
    by_cat = defaultdict(list)
    for p in prompts:
        by_cat[p.category].append(p)
    assert len(by_cat) == 8, sorted(by_cat)
    assert all(len(v) >= 10 for v in by_cat.values()), {c: len(v) for c, v in by_cat.items()}
    ids = [p.id for p in prompts]
    assert len(ids) == len(set(ids))
    assert GROUNDED & set(by_cat) == {"summarization", "rag", "code_editing"}
    for p in prompts:
        assert p.grounded == (p.category in GROUNDED), p.id
        assert p.turns and all(isinstance(t, str) and t.strip() for t in p.turns), p.id
        assert p.ids == []  # rendered later, against a tokenizer
    assert any(len(p.turns) > 1 for p in by_cat["multi_turn"])


def test_suite_selection():
    qa = load_suite(categories=["qa", "rag"], per_category=2)
    assert sorted(p.category for p in qa) == ["qa", "qa", "rag", "rag"]
    assert len(load_suite(per_category=1)) == 8


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("bad, line", [
    ({"category": "qa"}, 3),  # no turns
    ({"turns": ["Why?"]}, 3),  # no category
    ({"category": "qa", "turns": []}, 3),
    ({"category": "qa", "turns": [""]}, 3),
    ({"category": "qa", "turns": [7]}, 3),
    ({"category": 5, "turns": ["Why?"]}, 3),
    ("{not json", 3),
])
def test_custom_suite_bad_line_names_the_line(tmp_path, bad, line):
    path = write_jsonl(tmp_path / "mine.jsonl", [{"category": "qa", "turns": ["Why is the sky blue?"]}, "", bad])
    with pytest.raises(ValueError, match=rf"mine\.jsonl:{line}:"):
        load_suite(path)


def test_custom_suite_fields_and_defaults(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [
        {"category": "qa", "turns": ["Why is the sky blue?"]},
        {"id": "s1", "category": "summarization", "prompt": "Summarize: cats sleep a lot."},
        {"id": "r1", "category": "rag", "turns": ["Use the text."], "grounded": False},
    ])
    p = load_suite(path)
    assert [x.id for x in p] == ["qa-001", "s1", "r1"]
    assert [x.grounded for x in p] == [False, True, False]  # default from the category, or given
    assert p[1].turns == ["Summarize: cats sleep a lot."]


# Spec-Bench's question.jsonl form, with texts written for this test (none of Spec-Bench's items).
SPEC_BENCH_ROWS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a short note inviting a neighbour to tea.",
                                                        "Now make it twice as formal."]},
    {"question_id": 161, "category": "summarization",
     "turns": ["Summarize: The town council voted on Tuesday to keep the old bridge open to cyclists while a "
               "new one is built upstream. Work starts in spring."], "reference": ["ignored"]},
    {"question_id": 401, "category": "rag", "turns": ["Passage: Ravens can live for forty years.\n\nQuestion: "
                                                      "How long can ravens live?"]},
]


def test_spec_bench_question_format(tmp_path):
    p = load_suite(write_jsonl(tmp_path / "question.jsonl", SPEC_BENCH_ROWS))
    assert [x.id for x in p] == ["1", "161", "401"]
    assert [x.category for x in p] == ["writing", "summarization", "rag"]
    assert [len(x.turns) for x in p] == [2, 1, 1]  # a later turn follows the target's own reply
    assert [x.grounded for x in p] == [False, True, True]
    assert [x.id for x in load_suite(tmp_path / "question.jsonl", categories=["rag"])] == ["401"]


@pytest.mark.parametrize("rows, needle", [
    ([{"question_id": "7", "category": "qa", "turns": ["Why?"]}], "question_id"),
    ([{"question_id": 7, "category": "qa", "turns": ["Why?"]}, {"question_id": 7, "category": "qa",
                                                                 "turns": ["How?"]}], "duplicate prompt id '7'"),
])
def test_spec_bench_bad_ids(tmp_path, rows, needle):
    with pytest.raises(ValueError, match=needle):
        load_suite(write_jsonl(tmp_path / "question.jsonl", rows))


def test_bench_default_methods_use_auto(tmp_path):
    """The default method set is the API's default, `auto`; fixed k runs only when asked, and
    transformers' peers then take transformers' own settings."""
    from specdec.bench.runner import build_methods
    from tiny import tiny_hf_model

    target = load_model(save_tiny(tmp_path / "t"), dtype="float32")
    hf = tiny_hf_model()
    names = lambda cfg: [m.name for m in build_methods(cfg, target, target, hf, hf)]  # noqa: E731
    cfg = BenchConfig()
    cfg.validate()
    assert cfg.ks == ["auto"]
    assert names(cfg) == ["normal", "spec-ngram-kauto", "spec-draft-kauto", "spec-composite-kauto", "hf-greedy",
                          "hf-prompt-lookup-k10", "hf-assisted-draft", "hf-assisted-draft-heuristic"]
    sweep = BenchConfig(ks=[8, "auto", 2, 4])
    sweep.validate()
    assert sweep.ks == [2, 4, 8, "auto"]
    assert [n for n in names(sweep) if n.startswith("hf-")] == [
        "hf-greedy", "hf-prompt-lookup-k10", "hf-prompt-lookup-k4", "hf-assisted-draft", "hf-assisted-draft-k4",
        "hf-assisted-draft-heuristic"]
    for bad in ([], [0], ["x"], [True]):
        with pytest.raises(ValueError, match="num_draft_tokens"):
            BenchConfig(ks=bad).validate()


def test_custom_suite_unknown_category_and_empty(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [{"category": "qa", "turns": ["Why?"]}])
    with pytest.raises(ValueError, match="nope"):
        load_suite(path, categories=["qa", "nope"])
    with pytest.raises(ValueError, match="nope"):
        load_suite(categories=["nope"])
    with pytest.raises(ValueError, match="no prompts"):
        load_suite(write_jsonl(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_suite(tmp_path / "missing.jsonl")


# ----------------------------------------------------------------------------- run_benchmark, real model

PASSAGE = ("Read the passage and answer the question.\n\nPassage: The Lindenfeld public library opened in 1892 "
           "in two rooms above the old grain exchange. It moved to its present building on Canal Street in 1958 "
           "and today holds about 310,000 books.\n\nQuestion: When did the library move to Canal Street?")
PROMPT_ROWS = [
    {"id": "rag-lib", "category": "rag", "turns": [PASSAGE]},
    {"id": "qa-sky", "category": "qa", "turns": ["Why is the sky blue?"]},
]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("bench") / "tiny.jsonl", PROMPT_ROWS)


@pytest.fixture(scope="module")
def report(prompt_file):
    cfg = BenchConfig(model=MODEL, dtype="float32", threads=TORCH_THREADS, prompts=str(prompt_file), max_tokens=12,
                      trials=2, ks=["auto", 4, 2], peers=True, llama_cpp_peers=False)
    return run_benchmark(cfg, progress=False, log=lambda msg: None)


@pytest.fixture(scope="module")
def report_with_draft(prompt_file):
    """The target as its own draft model: exercises the model drafter and assisted-generation peers."""
    cfg = BenchConfig(model=MODEL, draft=MODEL, dtype="float32", threads=TORCH_THREADS, prompts=str(prompt_file),
                      categories=["rag"], max_tokens=8, trials=1, ks=[2, "auto"], peers=True, llama_cpp_peers=False)
    return run_benchmark(cfg, progress=False, log=lambda msg: None)


def methods_by_name(rep):
    return {m["name"]: m for m in rep["methods"]}


def check_common(rep, expected_names, n_prompts, trials):
    ms = methods_by_name(rep)
    assert set(ms) == set(expected_names)
    assert rep["methods"][0]["name"] == "normal"
    assert rep["schema"] == SCHEMA
    # the baseline against itself: exactly 1
    sp = ms["normal"]["overall"]["speedup"]
    assert sp["geomean"] == 1.0 and sp["ci95"] == [1.0, 1.0] and sp["n"] == n_prompts
    assert ms["normal"]["overall"]["tokens_per_target_call"] == 1.0
    assert ms["normal"]["overall"]["decode_speedup"]["geomean"] == 1.0
    for name, m in ms.items():
        for where, s in [("overall", m["overall"]["speedup"])] + [(c, v["speedup"]) for c, v in m["categories"].items()]:
            lo, hi = s["ci95"]
            assert lo - 1e-12 <= s["geomean"] <= hi + 1e-12, (name, where, s)
            assert s["geomean"] > 0 and math.isfinite(s["geomean"]), (name, where, s)
        assert set(m["categories"]) == {r["category"] for r in PROMPT_ROWS[:n_prompts]}
        assert m["cold_seconds"] > 0
        o = m["overall"]
        assert o["tokens"] > 0 and o["seconds"] > 0 and o["tokens_per_s"] > 0
        # float32 greedy: every method reproduces plain decoding token for token
        assert isinstance(m["mismatches"], list) and m["mismatches"] == [], (name, m["mismatches"])
        if m["family"] == "transformers":  # no prefill time: no decode-only ratio
            assert "decode_speedup" not in o and all("decode_speedup" not in v for v in m["categories"].values())
        if m["family"] == "specdec":
            assert set(o["decode_speedup"]) == set(o["speedup"]), name
            assert all("decode_speedup" in v for v in m["categories"].values()), name
            assert 0.0 <= o["acceptance_rate"] <= 1.0, name
            assert 0.0 <= o["alpha"] <= 1.0, name
            assert o["tokens_per_target_call"] >= 1.0, name
            if m["k"] != "auto":  # no single k to predict from
                assert math.isfinite(o["predicted_speedup"]) and o["predicted_speedup"] > 0, name
                assert o["cost_ratio_c"] >= 0 and o["verify_cost"] > 0, name
            assert all(0.0 <= x <= 1.0 for x in o["accepted_per_position"] if not math.isnan(x)), name
            assert o["target_calls"] == o["verify_steps"] + n_prompts
            assert str(m["k"]) == name.rsplit("-k", 1)[1]
    costs = rep["costs"]
    assert costs["target_forward_ms"] > 0
    assert rep["config"]["ks"][-1] == "auto"  # fixed k values first, in order, then auto
    fixed = [k for k in rep["config"]["ks"] if k != "auto"]
    assert fixed == sorted(fixed) and set(costs["verify_cost"]) == {str(k) for k in [*fixed, 1, 2, 4, 8]}
    assert all(v > 0 and math.isfinite(v) for v in costs["verify_cost"].values())
    # records: every timed run, cold runs excluded
    records = rep["records"]
    assert len(records) == trials * n_prompts * len(ms)
    runs = defaultdict(list)
    for r in records:
        runs[(r["prompt"], r["trial"])].append(r["method"])
    for order in runs.values():
        assert sorted(order) == sorted(ms)  # each method once per prompt and trial
    tokens = defaultdict(set)
    for r in records:
        tokens[r["prompt"]].add(r["n_tokens"])
    assert all(len(v) == 1 for v in tokens.values()), tokens  # same output length for every method
    env = rep["environment"]
    import transformers

    assert env["torch"] == torch.__version__ and env["transformers"] == transformers.__version__
    assert env["threads"] == TORCH_THREADS and env["dtype"] == "float32"
    assert rep["config"]["threads"] == TORCH_THREADS
    assert {p["id"] for p in rep["prompts"]} == {r["id"] for r in PROMPT_ROWS[:n_prompts]}
    return ms


@needs_model
def test_run_benchmark_ngram_and_peers(report):
    expected = ["normal", "spec-ngram-k2", "spec-ngram-k4", "spec-ngram-kauto", "hf-greedy", "hf-prompt-lookup-k10",
                "hf-prompt-lookup-k4"]
    ms = check_common(report, expected, n_prompts=2, trials=2)
    assert report["load_seconds"]["target"] > 0 and report["load_seconds"]["transformers"] > 0
    assert report["costs"]["drafts"] == {}
    for name in ("spec-ngram-k2", "spec-ngram-k4"):
        o = ms[name]["overall"]
        assert o["draft_calls"] == 0 and o["drafted"] > 0
        rag = ms[name]["categories"]["rag"]
        assert rag["acceptance_rate"] > 0, "the passage should give the n-gram drafter accepted tokens"
        assert len(o["accepted_per_position"]) <= ms[name]["k"]
    for name in ("hf-greedy", "hf-prompt-lookup-k10", "hf-prompt-lookup-k4"):
        assert ms[name]["family"] == "transformers"
        assert "acceptance_rate" not in ms[name]["overall"] and "prefill_ms_mean" not in ms[name]["overall"]
    assert {p["id"]: p["grounded"] for p in report["prompts"]} == {"rag-lib": True, "qa-sky": False}
    assert report["ceilings"]["k_max"] == 16 and set(report["ceilings"]) == {"k_max", "lookup", "speedup", "replayed"}
    check_under_ceiling(report, {"spec-ngram-k2": "lookup", "spec-ngram-k4": "lookup", "spec-ngram-kauto": "lookup"})
    # The perfect schedule at the measured pass costs (one for every size up to k_max + 1 tokens):
    # never slower than plain decoding, since a plain step is always among its choices.
    assert sorted(map(int, report["costs"]["pass_cost"])) == list(range(1, 18))
    assert report["costs"]["pass_cost"]["1"] == 1.0
    sp = report["ceilings"]["speedup"]
    assert sp["end_to_end"] is True and sp["lookup"]["overall"] >= 1.0
    assert set(sp["lookup"]["categories"]) == set(ms["normal"]["categories"])
    # auto, replayed at the same costs (no datastore here: lookup's offers only), under the perfect schedule.
    rp = report["ceilings"]["replayed"]
    assert set(rp) == {"k_max", "lookup"} and rp["k_max"] == 16
    assert 0 < rp["lookup"]["overall"] <= sp["lookup"]["overall"] + 1e-9


def check_under_ceiling(rep, kinds):
    """No method passes more tokens per verification than its drafter's replayed best (float32: exact)."""
    ms, c = methods_by_name(rep), rep["ceilings"]
    for name, kind in kinds.items():
        assert ms[name]["overall"]["tokens_per_step"] <= c[kind]["overall"] + 1e-9, (name, c)
        for cat, v in ms[name]["categories"].items():
            assert v["tokens_per_step"] <= c[kind]["categories"][cat] + 1e-9, (name, cat, c)


@needs_model
def test_run_benchmark_interleaves_methods_in_balanced_orders(report):
    orders = defaultdict(dict)
    for r in report["records"]:
        orders[r["prompt"]].setdefault(r["trial"], []).append(r["method"])
    for prompt, by_trial in orders.items():
        assert by_trial[0] != by_trial[1], (prompt, by_trial)
    # and prompts within a trial start with different methods
    assert orders["rag-lib"][0][0] != orders["qa-sky"][0][0]
    # No method always runs right after the same one (a rotated order would keep each
    # method's predecessor fixed); the rounds follow interleaved_order.
    names = [m["name"] for m in report["methods"]]
    before = defaultdict(set)
    for i, prompt in enumerate(["rag-lib", "qa-sky"]):
        for trial in (0, 1):
            got = orders[prompt][trial]
            assert got == interleaved_order(names, trial * 2 + i)
            for a, b in zip(got, got[1:]):
                before[b].add(a)
    assert all(len(v) >= 2 for v in before.values()), before


@pytest.mark.parametrize("n", range(1, 8))
def test_balanced_orders_put_each_method_after_each_other_equally_often(n):
    orders = balanced_orders(n)
    assert all(sorted(o) == list(range(n)) for o in orders)
    pairs = Counter((a, b) for o in orders for a, b in zip(o, o[1:]))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1


@needs_model
def test_run_benchmark_report_is_strict_json(report, tmp_path):
    from specdec.bench.report import write_report

    write_report(report, tmp_path / "out")

    def no_nan(token):
        raise AssertionError(f"report.json holds {token}")

    data = json.loads((tmp_path / "out" / "report.json").read_text(), parse_constant=no_nan)
    assert [m["name"] for m in data["methods"]] == [m["name"] for m in report["methods"]]


@needs_model
def test_run_benchmark_with_draft_model(report_with_draft):
    expected = ["normal", "spec-ngram-k2", "spec-draft-k2", "spec-composite-k2", "spec-ngram-kauto", "spec-draft-kauto",
                "spec-composite-kauto", "hf-greedy", "hf-prompt-lookup-k10", "hf-prompt-lookup-k2",
                "hf-assisted-draft", "hf-assisted-draft-k2", "hf-assisted-draft-heuristic"]
    ms = check_common(report_with_draft, expected, n_prompts=1, trials=1)
    d = report_with_draft["costs"]["drafts"]["draft"]
    assert d["forward_ms"] > 0 and d["c"] > 0
    o = ms["spec-draft-k2"]["overall"]
    assert o["draft_calls"] > 0 and o["drafted"] > 0
    assert o["acceptance_rate"] >= 0.9  # the target drafting for itself (float32 greedy)
    # c as it drafts: the draft's time in the loop per drafted token, and what the ceilings charge.
    t1 = report_with_draft["costs"]["target_forward_ms"] / 1000
    assert o["cost_ratio_c"] == pytest.approx(o["draft_seconds"] / o["drafted"] / t1)
    alone = [ms[n]["overall"] for n in ("spec-draft-k2", "spec-draft-kauto")]
    charged = report_with_draft["ceilings"]["draft_cost"]
    assert charged["measured"] == "in the loop"
    assert charged["c"] == pytest.approx(sum(a["draft_seconds"] for a in alone) / sum(a["drafted"] for a in alone) / t1)
    assert report_with_draft["load_seconds"]["draft"] > 0
    assert ms["hf-assisted-draft"]["k"] == "hf-default"
    # The target drafting for itself is right to the end: one pass could take the whole answer.
    n = ms["normal"]["overall"]["tokens"]
    assert report_with_draft["ceilings"]["draft"]["overall"] == n - 1
    check_under_ceiling(report_with_draft, {"spec-ngram-k2": "lookup", "spec-draft-k2": "draft",
                                            "spec-composite-k2": "lookup_or_draft", "spec-draft-kauto": "draft",
                                            "spec-composite-kauto": "lookup_or_draft"})
    assert ms["hf-assisted-draft-k2"]["k"] == 2
    # The composite against the faster of its own parts, per k: a per-prompt paired ratio.
    vs = report_with_draft["composite_vs_sources"]
    assert sorted(vs) == ["spec-composite-k2", "spec-composite-kauto"]
    row = vs["spec-composite-k2"]["overall"]
    assert row["best_source"] in ("spec-ngram-k2", "spec-draft-k2")
    best = max(("spec-ngram-k2", "spec-draft-k2"), key=lambda n: ms[n]["overall"]["speedup"]["geomean"])
    assert row["best_source"] == best
    assert row["ratio"]["geomean"] == pytest.approx(
        ms["spec-composite-k2"]["overall"]["speedup"]["geomean"] / ms[best]["overall"]["speedup"]["geomean"])
    assert all(ms[n]["drafter"] == "draft" for n in ("hf-assisted-draft", "hf-assisted-draft-k2",
                                                     "hf-assisted-draft-heuristic", "spec-draft-k2"))


def test_time_per_token_is_taken_per_trial():
    # With k = auto (or sampling) trials may write outputs of different lengths: each trial's
    # time is divided by its own token count before the median.
    from types import SimpleNamespace

    from specdec.bench.runner import _per_prompt

    rows = [{"method": "m", "prompt": "p", "trial": 0, "seconds": 1.0, "tokens": [1] * 10, "prefill_seconds": None,
             "stats": None},
            {"method": "m", "prompt": "p", "trial": 1, "seconds": 5.0, "tokens": [1] * 100, "prefill_seconds": None,
             "stats": None}]
    per = _per_prompt(rows, "m", [SimpleNamespace(id="p")])["p"]
    assert per["per_token"] == pytest.approx((0.1 + 0.05) / 2)
    assert per["seconds"] == 3.0 and len(per["tokens"]) == 10


def test_decode_time_per_token_leaves_out_the_prefill():
    from types import SimpleNamespace

    from specdec.bench.runner import _per_prompt

    rows = [{"method": "m", "prompt": "p", "trial": t, "seconds": 1.0 + t, "tokens": [1] * 11, "prefill_seconds": 0.5,
             "stats": None} for t in range(3)]
    per = _per_prompt(rows, "m", [SimpleNamespace(id="p")])["p"]
    assert per["decode_per_token"] == pytest.approx((2.0 - 0.5) / 10)  # median trial, 10 tokens after the first
    rows[0]["tokens"] = [1]  # a one-token answer has no decode phase
    assert _per_prompt(rows, "m", [SimpleNamespace(id="p")])["p"]["decode_per_token"] is None


def test_loop_time_is_what_no_timing_holds():
    from specdec.bench.runner import _spec_metrics

    stats = {"drafted": 4, "accepted": 2, "rejections": 1, "generated": 12, "target_calls": 10, "plain_steps": 3,
             "draft_calls": 0, "proposed_at": [2], "accepted_at": [1],
             "timings": {"prefill": 0.2, "draft": 0.05, "verify": 0.7}}
    rows = [{"first_seconds": 1.0, "stats": stats}, {"first_seconds": 2.0, "stats": None}]
    m = _spec_metrics(rows)
    assert m["loop_ms_per_pass"] == pytest.approx(1000 * (1.0 - 0.95) / 10)
    assert m["draft_time_share"] == pytest.approx(0.05)


def test_batched_crossover_is_the_first_size_where_no_method_pays():
    from specdec.bench.batched import crossover

    def by(ratios):  # B -> {method: ratio}
        return {str(b): {"normal": {"throughput_ratio": {"geomean": 1.0}}}
                | {m: {"throughput_ratio": {"geomean": r}} for m, r in rs.items()} for b, rs in ratios.items()}

    c = crossover([1, 2, 4, 8], by({1: {"a": 1.5, "b": 1.2}, 2: {"a": 1.1, "b": 1.3}, 4: {"a": 0.9, "b": 0.95},
                                    8: {"a": 0.7, "b": 1.01}}))
    assert c["stops_paying_at"] == 4 and c["pays_up_to"] == 2 and c["best"]["2"] == {"method": "b", "ratio": 1.3}
    c = crossover([1, 2], by({1: {"a": 1.5}, 2: {"a": 1.2}}))
    assert c["stops_paying_at"] is None and c["pays_up_to"] == 2
    c = crossover([1, 2], by({1: {"a": 0.8}, 2: {"a": 0.7}}))
    assert c["stops_paying_at"] == 1 and c["pays_up_to"] is None
