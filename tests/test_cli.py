"""The command line: `specdec generate | demo | bench`.

Contract: success exits 0; every user mistake exits 2 with no traceback. Mistakes our own
checks catch print exactly one line, `specdec: error: ...`, on stderr. Mistakes argparse
catches (unknown subcommand or flag, a value of the wrong type or range) also exit 2, but
argparse prints its usage first: a usage block (one or more lines) then one
`specdec <command>: error: ...` line. Cheap checks run before any model is loaded.

Most tests call `specdec.cli.main` in-process (fast); two subprocesses prove the real entry
points and their exit statuses.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import specdec.bench.runner as runner
import specdec.models.loading as loading
from specdec import generate
from specdec.cli import TextStream, _explain_divergence, main
from specdec.models.loading import load_model
from tiny import needs_model, save_tiny

MODEL = "smollm2-135m-instruct"
SUMMARY = re.compile(r"^\[(\d+) tokens, [\d.]+ tok/s, finish=(eos|length)"
                     r"(, acceptance (nan|[\d.]+), [\d.]+ tokens/target call)?\]$")


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)




def run(capsys, *argv):
    """main() in-process -> (exit status, stdout, stderr); argparse's SystemExit included."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, out, err, *needles):
    assert rc == 2, (rc, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got {lines}"
    assert lines[0].startswith("specdec: error: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def assert_argparse_error(rc, out, err, *needles):
    """argparse: exit 2, a usage block, then exactly one `specdec[ cmd]: error: ...` line."""
    assert rc == 2, (rc, err)
    assert "Traceback" not in err and out == ""
    lines = err.strip().splitlines()
    assert lines[0].startswith("usage: specdec"), lines
    assert re.match(r"^specdec( \w+)?: error: ", lines[-1]), lines
    assert sum("error:" in line for line in lines) == 1, lines
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if a model is loaded: cheap checks must come first."""
    def refuse(*args, **kwargs):
        pytest.fail(f"a model was loaded before the input was checked: load_model{args}")

    monkeypatch.setattr(loading, "load_model", refuse)
    monkeypatch.setattr(runner, "load_model", refuse)
    monkeypatch.setattr(runner, "load_hf", refuse)


# ----------------------------------------------------------------------------- generate: mistakes


@pytest.mark.parametrize("args, needles", [
    (["--max-tokens", "-1"], ["max_tokens", "-1"]),
    (["--temperature", "-1"], ["temperature", "-1"]),
    (["--temperature", "nan"], ["temperature"]),
    (["--temperature", "inf"], ["temperature"]),
    (["--top-p", "0"], ["top_p", "(0, 1]"]),
    (["--top-p", "1.5"], ["top_p", "1.5"]),
    (["--top-p", "nan"], ["top_p"]),
])
def test_generate_bad_values_fail_before_loading(capsys, no_load, args, needles):
    assert_one_line_error(*run(capsys, "generate", "hi", *args), *needles)


def test_generate_empty_prompt(capsys, no_load):
    assert_one_line_error(*run(capsys, "generate", ""), "prompt is empty")


@pytest.mark.parametrize("args, needles", [
    (["generate", "hi", "--num-draft-tokens", "0"], ["--num-draft-tokens", ">= 1"]),
    (["generate", "hi", "--num-draft-tokens", "-2"], ["--num-draft-tokens"]),
    (["generate", "hi", "--top-k", "0"], ["--top-k", ">= 1"]),
    (["generate", "hi", "--max-tokens", "ten"], ["--max-tokens", "not an integer"]),
    (["generate", "hi", "--max-tokens", "1.5"], ["--max-tokens", "not an integer"]),
    (["generate", "hi", "--temperature", "hot"], ["--temperature", "not a number"]),
    (["generate", "hi", "--top-p", "x"], ["--top-p", "not a number"]),
    (["generate", "hi", "--seed", "abc"], ["--seed", "not an integer"]),
    (["generate", "hi", "--dtype", "float64"], ["--dtype", "invalid choice"]),
    (["generate", "hi", "--bogus"], ["unrecognized arguments", "--bogus"]),
    (["generate"], ["prompt"]),
    (["frobnicate"], ["invalid choice", "frobnicate"]),
    ([], ["command"]),
    (["bench", "--num-draft-tokens", "0"], ["--num-draft-tokens"]),
    (["bench", "--num-draft-tokens", "2,x"], ["--num-draft-tokens", "not an integer"]),
    (["bench", "--num-draft-tokens", ","], ["--num-draft-tokens"]),
    (["bench", "--num-draft-tokens", "auto,0"], ["--num-draft-tokens", ">= 1"]),
    (["bench", "--no-auto"], ["unrecognized arguments", "--no-auto"]),
    (["bench", "--threads", "0"], ["--threads"]),
    (["bench", "--trials", "0"], ["--trials"]),
    (["demo", "--max-tokens", "0"], ["--max-tokens"]),
    (["generate", "hi", "--engine", "vllm"], ["--engine", "invalid choice"]),
])
def test_argparse_mistakes_exit_2_with_usage(capsys, no_load, args, needles):
    assert_argparse_error(*run(capsys, *args), *needles)


def test_missing_model_path(capsys, tmp_path):
    missing = tmp_path / "missing" / "path"
    assert_one_line_error(*run(capsys, "generate", "hi", "--model", missing), str(missing))


def test_model_path_not_a_checkpoint(capsys, tmp_path):
    (tmp_path / "empty-dir").mkdir()
    assert_one_line_error(*run(capsys, "generate", "hi", "--model", tmp_path / "empty-dir"), "config.json")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    assert_one_line_error(*run(capsys, "generate", "hi", "--model", tmp_path / "weights.bin"), ".gguf")


@pytest.fixture
def fake_target(monkeypatch):
    """load_model returns a stand-in for the target (no weights); any other name loads for real.
    Lets draft-side mistakes be tested without loading the 135M target."""
    real = loading.load_model
    target = types.SimpleNamespace(tokenizer=object(), device=torch.device("cpu"), name=MODEL)
    calls = []

    def fake(name=MODEL, **kwargs):
        calls.append(str(name))
        return target if str(name) == MODEL else real(name, **kwargs)

    monkeypatch.setattr(loading, "load_model", fake)
    return calls


def test_missing_draft_path(capsys, tmp_path, fake_target):
    missing = tmp_path / "no-draft"
    assert_one_line_error(*run(capsys, "generate", "hi", "--draft", missing), str(missing))
    # The draft path is checked before the target is loaded.
    assert fake_target == []


def test_demo_refuses_draft_none(capsys, fake_target):
    rc, out, err = run(capsys, "demo", "--draft", "none")
    # Refused before anything is loaded.
    assert_one_line_error(rc, out, err, "--draft", "none")
    assert fake_target == []


# ----------------------------------------------------------------------------- bench: mistakes


def test_bench_out_is_a_file(capsys, tmp_path, no_load):
    out = tmp_path / "report.txt"
    out.write_text("keep me")
    assert_one_line_error(*run(capsys, "bench", "--out", out), str(out), "not a directory")
    assert out.read_text() == "keep me"


def test_bench_unknown_category(capsys, tmp_path, no_load):
    out = tmp_path / "out"
    assert_one_line_error(*run(capsys, "bench", "--categories", "nope", "--out", out), "nope")
    assert not out.exists()


def test_bench_unknown_category_quick(capsys, tmp_path, no_load):
    assert_one_line_error(*run(capsys, "bench", "--quick", "--categories", "qa,nope", "--out", tmp_path / "o"),
                          "nope")


def test_bench_missing_prompts_file(capsys, tmp_path, no_load):
    missing = tmp_path / "missing.jsonl"
    assert_one_line_error(*run(capsys, "bench", "--prompts", missing, "--out", tmp_path / "o"), "missing.jsonl")


def test_bench_bad_prompts_file(capsys, tmp_path, no_load):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"category": "qa", "turns": ["fine"]}\n{"category": "qa"}\n')
    assert_one_line_error(*run(capsys, "bench", "--prompts", bad, "--out", tmp_path / "o"), "bad.jsonl:2")


def test_bench_batch_sizes_mistakes(capsys, tmp_path, no_load):
    rc, out, err = run(capsys, "bench", "--batch-sizes", "2,0", "--out", tmp_path / "o")
    assert rc == 2 and "--batch-sizes" in err and "Traceback" not in err
    assert_one_line_error(*run(capsys, "bench", "--batch-sizes", "2", "--engine", "llama.cpp", "--out", tmp_path / "o"),
                          "batch sizes need an engine that batches")
    two = tmp_path / "two.jsonl"
    two.write_text('{"category": "qa", "turns": ["a"]}\n{"category": "qa", "turns": ["b"]}\n')
    assert_one_line_error(*run(capsys, "bench", "--batch-sizes", "1,4", "--prompts", two, "--out", tmp_path / "o"),
                          "batch size 4 needs at least as many prompts", "has 2")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_bench_cuda_without_gpu(capsys, tmp_path, no_load):
    assert_one_line_error(*run(capsys, "bench", "--device", "cuda", "--out", tmp_path / "o"), "cuda")


# ----------------------------------------------------------------------------- generate: success


class Writes(io.StringIO):
    def __init__(self):
        super().__init__()
        self.chunks = []

    def write(self, s):
        self.chunks.append(s)
        return super().write(s)


@needs_model
def test_text_stream_holds_back_split_characters():
    tok = loading.load_tokenizer(MODEL)
    text = "Rainbows 🌈 appear after rain, café ☕."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    sink = Writes()
    stream = TextStream(tok, out=sink)
    for t in ids:
        stream([t])
    assert sink.getvalue() == tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in sink.getvalue()
    assert len([c for c in sink.chunks if c]) > 1  # printed as it went, not once at the end


@pytest.fixture
def spy_load(monkeypatch):
    """Record the models the CLI loads (so the test can check the output against the API)."""
    real = loading.load_model
    loaded = []

    def spy(*args, **kwargs):
        model = real(*args, **kwargs)
        loaded.append(model)
        return model

    monkeypatch.setattr(loading, "load_model", spy)
    return loaded


def test_text_stream_follows_sys_stdout():
    sink = io.StringIO()
    tok = types.SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "x" * len(ids))
    with contextlib.redirect_stdout(sink):
        TextStream(tok)([1, 2])
    assert sink.getvalue() == "xx"


def test_datastore_command_refuses_what_is_not_a_distill_run(capsys, tmp_path):
    rc, _, err = run(capsys, "datastore", tmp_path, "--out", tmp_path / "s.safetensors")
    assert rc == 2 and "not a distill run directory" in err
    rc, _, err = run(capsys, "generate", "hi", "--datastore", tmp_path / "missing.safetensors")
    assert rc == 2 and "no such file" in err


def test_the_default_drafter_is_lookup_with_the_shipped_datastore():
    from specdec import CompositeDrafter, NgramDrafter
    from specdec.cli import build_parser, load_datastore_arg, make_drafter, resolve_draft

    args = build_parser().parse_args(["generate", "hi"])
    drafter = make_drafter(resolve_draft(args), None, None, datastore=load_datastore_arg(args))
    assert isinstance(drafter, CompositeDrafter) and drafter.model is None
    assert drafter.store.store.vocab_size == 49152 and len(drafter.store.store) > 500_000
    args = build_parser().parse_args(["generate", "hi", "--datastore", "none"])
    assert isinstance(make_drafter(resolve_draft(args), None, None, datastore=load_datastore_arg(args)), NgramDrafter)
    # Another target: no datastore ships for it; prompt lookup alone.
    args = build_parser().parse_args(["generate", "hi", "--model", "some/dir"])
    assert resolve_draft(args) == "ngram" and load_datastore_arg(args) is None


def test_the_apis_default_drafter_is_the_clis():
    # specdec.default_drafter(target) gives an API user what `specdec generate` drafts with.
    from types import SimpleNamespace

    from specdec import default_drafter
    from specdec.cli import build_parser, load_datastore_arg, make_drafter, resolve_draft

    args = build_parser().parse_args(["generate", "hi"])
    cli = make_drafter(resolve_draft(args), None, None, datastore=load_datastore_arg(args))
    api = default_drafter(SimpleNamespace(name=MODEL))  # only the target's name decides
    assert repr(api) == repr(cli) and api.store.store is cli.store.store


@needs_model
def test_generate_streams_text_and_summary(capsys, spy_load, monkeypatch):
    prompt = "What is 2+2?"
    rc, out, err = run(capsys, "generate", prompt, "--max-tokens", 8, "--dtype", "float32")
    assert rc == 0, err
    assert "Traceback" not in err
    summary = err.strip().splitlines()[-1]
    m = SUMMARY.match(summary)
    assert m and m.group(3), summary  # a draft is the default: acceptance is reported
    n = int(m.group(1))
    assert 1 <= n <= 8
    # The default drafter of the default target: prompt lookup with its shipped datastore, no draft model.
    (target,) = spy_load
    assert target.dtype == torch.float32
    expected = generate(target, target.tokenizer, prompt, 8, chat=True)
    assert n == len(expected.token_ids) and m.group(2) == expected.finish_reason
    assert out == expected.text + "\n"
    assert out.strip()

    # --draft none: plain decoding, no acceptance in the summary, and (float32 greedy) the same text.
    rc, out_none, err_none = run(capsys, "generate", prompt, "--max-tokens", 8, "--dtype", "float32",
                                 "--draft", "none")
    assert rc == 0, err_none
    m = SUMMARY.match(err_none.strip().splitlines()[-1])
    assert m and m.group(3) is None, err_none
    assert out_none == out


# ----------------------------------------------------------------------------- the real entry points


def _env():
    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_DEBUG"}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


@needs_model
def test_subprocess_generate_exit_0():
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "What is 2+2?", "--max-tokens", "8"],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.strip(), "no text streamed"
    assert SUMMARY.match(proc.stderr.strip().splitlines()[-1]), proc.stderr


def test_subprocess_user_mistake_exit_2():
    """The installed console script (or `python -m specdec.cli`) turns main()'s 2 into the exit status."""
    script = Path(sys.executable).parent / "specdec"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "specdec.cli"]
    proc = subprocess.run(cmd + ["generate", "hi", "--top-p", "1.5"], capture_output=True, text=True,
                          timeout=120, env=_env())
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, "top_p")


@needs_model
def test_demo_prints_both_outputs_match_speedup_and_acceptance(capsys):
    rc, out, err = run(capsys, "demo", "--max-tokens", 12, "--trials", 1, "--dtype", "float32")
    assert rc == 0, err
    assert "=== normal decoding ===" in out and "=== speculative decoding" in out
    assert "outputs match token for token: True" in out  # float32 greedy: identical
    assert re.search(r"speedup \d+\.\d\dx", out) and re.search(r"acceptance rate \d\.\d\d", out)


@needs_model
def test_generate_with_auto_draft_length(capsys):
    rc, out, err = run(capsys, "generate", "What is 2+2?", "--max-tokens", 6, "--num-draft-tokens", "auto",
                       "--dtype", "float32")
    assert rc == 0, err
    assert SUMMARY.match(err.strip().splitlines()[-1])


@needs_model
def test_bench_runs_a_spec_bench_file_with_the_default_methods(capsys, tmp_path):
    import json

    from test_bench import SPEC_BENCH_ROWS

    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps(r) + "\n" for r in SPEC_BENCH_ROWS[:2]))
    rc, out, err = run(capsys, "bench", "--prompts", questions, "--no-peers", "--no-llama-cpp", "--max-tokens", 6,
                       "--trials", 1, "--threads", 2, "--dtype", "float32", "--out", tmp_path / "out")
    assert rc == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [p["id"] for p in report["prompts"]] == ["1", "161"]
    # the defaults: the shipped draft and datastore, every drafter with k = auto, no fixed k
    assert [m["name"] for m in report["methods"]] == ["normal", "spec-ngram-kauto", "spec-store-kauto",
                                                      "spec-draft-kauto", "spec-composite-kauto"]
    assert report["config"]["datastore"] == "smollm2-135m-instruct"
    assert set(report["composite_vs_sources"]["spec-composite-kauto"]["overall"]) >= {"best_source", "ratio"}
    for m in report["methods"]:
        assert set(m["categories"]) == {"writing", "summarization"}
        assert m["mismatches"] == []  # float32 greedy
    assert "spec-composite-kauto" in out


@needs_model
def test_bench_batch_sizes_runs_the_batched_study(capsys, tmp_path):
    import json

    from test_bench import SPEC_BENCH_ROWS

    questions = tmp_path / "question.jsonl"
    extra = {"question_id": 7, "category": "qa", "turns": ["Name three metals that conduct electricity."]}
    questions.write_text("".join(json.dumps(r) + "\n" for r in SPEC_BENCH_ROWS + [extra]))
    rc, out, err = run(capsys, "bench", "--prompts", questions, "--batch-sizes", "1,2,4", "--max-tokens", 10,
                       "--trials", 1, "--threads", 2, "--dtype", "bfloat16", "--out", tmp_path / "out")
    assert rc == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    b = report["batched"]
    assert b["batch_sizes"] == [1, 2, 4] and len(b["prompts"]) == 4
    assert b["methods"] == ["normal", "spec-ngram-kauto", "spec-store-kauto", "spec-draft-kauto", "spec-composite-kauto"]
    for size in ("1", "2", "4"):
        for name, e in b["by_batch"][size].items():
            assert e["tokens_per_s"] > 0 and e["latency_ms_per_token"]["p90"] >= e["latency_ms_per_token"]["median"]
            if name != "normal":
                assert e["row_mismatches"] == 0  # bf16 greedy through the kernel: every row is plain's row
    # every batch of every method ran once (one trial): 4 + 2 + 1 batches
    assert len(b["records"]) == 7 * len(b["methods"])
    assert set(b["verify_costs"]["ratio"]) == {"1", "2", "4"}
    assert b["verify_costs"]["ratio"]["4"]["8"] > b["verify_costs"]["ratio"]["1"]["0"]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Batched requests" in md and "Verify pass cost" in md and "![batch_scaling]" in md
    assert (tmp_path / "out" / "batch_scaling.png").stat().st_size > 0
    assert "spec-composite-kauto" in out


def test_num_draft_tokens_must_be_a_number_or_auto(capsys):
    rc, out, err = run(capsys, "generate", "hi", "--num-draft-tokens", "many")
    assert rc == 2 and "--num-draft-tokens" in err and "Traceback" not in err


def test_demo_explains_where_outputs_part(tmp_path):
    path = save_tiny(tmp_path / "tiny")
    target = load_model(path, dtype="bfloat16")
    args = types.SimpleNamespace(model=str(path), device="cpu", engine="native")
    gen = lambda ids: types.SimpleNamespace(prompt_ids=[3, 7, 11], token_ids=ids)  # noqa: E731
    assert "prefix of the other (3 vs 2 tokens)" in _explain_divergence(gen([5, 6, 7]), gen([5, 6]), target, args)
    exact = load_model(path, dtype="float32")
    exact.reset(8)
    logits = exact.forward([3, 7, 11, 5], last_only=True)[-1]
    best, worst = int(logits.argmax()), int(logits.argmin())
    said = _explain_divergence(gen([5, best]), gen([5, worst]), target, args)
    assert said.startswith("  they part at new token 1:") and "NOT a tie" in said and "in float32" in said
