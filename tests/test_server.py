"""`specdec serve`: real servers started on 127.0.0.1 by the tests (the CLI, in a subprocess)
and stopped after them. Streaming and not, the same output as solo `generate` under
concurrency, bad requests refused before any compute, a full queue, cancellation on
disconnect, metrics equal to the counts, a clean shutdown, and a soak."""
from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from specdec.bench.serving import parse_metrics, poisson_arrivals, speculation_from_counters

from test_serving import free_port
from tiny import needs_model, save_tiny

pytestmark = needs_model
MODEL = "smollm2-135m-instruct"
TORCH_THREADS = 2


def start(*args: str, port: int | None = None, model: str = MODEL) -> tuple[subprocess.Popen, str]:
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--model", model, "--dtype", "bfloat16",
                             "--port", str(port), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"specdec serve did not come up on {url}: {proc.stderr.read()[-2000:]}")


def tiny_with_the_embedded_tokenizer(path) -> str:
    """A 2-layer random model of SmolLM2's vocabulary, saved with SmolLM2's tokenizer; its heads of
    32 dimensions run on the bf16 kernel, as the embedded model does."""
    from specdec.models.loading import hf_checkpoint

    save_tiny(path, "llama", seed=0, vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=2,
              num_key_value_heads=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(hf_checkpoint(MODEL) / name, path / name)
    return str(path)


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGINT)
    return proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server():
    proc, url = start("--max-batch", "4", "--context", "1024", "--queue-size", "8")
    try:
        yield url
    finally:
        assert stop(proc) == 0


@pytest.fixture(scope="module")
def drafting_server():
    """The shipped draft model at a fixed k: every step drafts (`auto`, timed, may choose plain
    steps for a whole short test on a busy machine, and did)."""
    proc, url = start("--draft", f"{MODEL}-draft", "--num-draft-tokens", "3", "--max-batch", "4", "--context", "512")
    try:
        yield url
    finally:
        assert stop(proc) == 0


@pytest.fixture(scope="module")
def model():
    from specdec.models.loading import load_model

    return load_model(MODEL, dtype="bfloat16")


def chat_ids(model, content: str) -> list[int]:
    tok = model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def solo(model, content: str, max_tokens: int, **sampling) -> list[int]:
    from specdec import generate

    return generate(model, model.tokenizer, chat_ids(model, content), max_tokens, **sampling).token_ids


def metrics(url: str) -> dict:
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


def total(m: dict, name: str, **labels) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in m.items() if k.split("{")[0] == f"specdec:{name}" and all(w in k for w in want))


def idle(url: str, timeout: float = 30) -> dict:
    """The metrics once nothing runs or waits (a cancelled request frees its row at the next step)."""
    deadline = time.time() + timeout
    while True:
        m = metrics(url)
        if total(m, "num_requests_running") == 0 and total(m, "num_requests_waiting") == 0:
            return m
        assert time.time() < deadline, "requests still running"
        time.sleep(0.05)


PROMPTS = ["Write a short poem about the sea.", "Name three prime numbers and say why they are prime.",
           "Translate to French: the cat sits on the mat.",
           "Repeat this line twice: the quick brown fox jumps over the lazy dog.",
           "Summarize in one sentence: the council kept the old bridge open to cyclists while a new one is built."]


def post(url: str, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


def test_chat_and_completions_answer_with_usage_streamed_and_not(server, model):
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 24,
            "temperature": 0, "return_token_ids": True}
    whole = post(server, "/v1/chat/completions", body).json()
    choice = whole["choices"][0]
    assert choice["token_ids"] == solo(model, PROMPTS[0], 24)
    assert choice["message"]["content"] == model.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert whole["usage"]["completion_tokens"] == len(choice["token_ids"])
    assert whole["usage"]["prompt_tokens"] == len(chat_ids(model, PROMPTS[0]))

    with httpx.stream("POST", server + "/v1/chat/completions", timeout=120,
                      json=body | {"stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == \
        choice["message"]["content"]
    assert sum((c["choices"][0].get("token_ids") or [] for c in chunks if c["choices"]), []) == choice["token_ids"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(choice["token_ids"])
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == choice["finish_reason"] == "length"

    ids = chat_ids(model, PROMPTS[1])
    text = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 16, "temperature": 0,
                                            "return_token_ids": True}).json()
    assert text["object"] == "text_completion"
    assert text["choices"][0]["token_ids"] == solo(model, PROMPTS[1], 16)
    listed = httpx.get(server + "/v1/models").json()["data"]
    assert [m["id"] for m in listed] == [MODEL]


def test_streamed_text_is_the_whole_decoding_read_in_short_windows(model):
    from specdec.server import TextDelta

    tok, calls = model.tokenizer, []

    class Counting:  # the tokenizer, counting the ids each decode reads
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return tok.decode(ids, **kw)

    text = "Naïve café: 東京は晴れ 🌊🐟 — x² ≥ 0, ok.\n  Indented line; the end. " * 20
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rng = random.Random(0)
    for trial in range(3):
        delta, out, i, calls[:] = TextDelta(Counting()), [], 0, []
        while i < len(ids):
            n = rng.choice([1, 1, 2, 5])
            out.append(delta(ids[i:i + n], final=i + n >= len(ids)))
            i += n
        assert "".join(out) == tok.decode(ids, skip_special_tokens=True)
        # Windows, not the whole output each time: a window spans at most a run of tokens that split
        # characters (the 12 of the CJK here) and the text sent before it.
        assert max(calls) <= len(ids) // 10 and sum(calls) <= 8 * len(ids), (max(calls), sum(calls), len(ids))


def first_stop(tok, ids: list[int], stops: list[str]) -> tuple[str, int]:
    """The text before the first stop string, and how many ids it took to write the stop string."""
    text = tok.decode(ids, skip_special_tokens=True)
    cut = min((text.find(s) for s in stops if s in text), default=len(text))
    n = next((k for k in range(1, len(ids) + 1)
              if any(s in tok.decode(ids[:k], skip_special_tokens=True) for s in stops)), len(ids))
    return text[:cut], n


def test_stop_strings_cut_the_text_and_hold_back_what_may_begin_one(model):
    """Fed in random chunks, the text sent is the whole decoding up to the first stop string
    (none of it, nor any text after it), and the ids end with the token that completed it. A stop
    string's start at the very end is held until the end, then sent."""
    from specdec.server import Output

    tok = model.tokenizer
    text = "Naïve café: 東京は晴れ 🌊🐟 — x² ≥ 0, ok.\n  Indented line; the end. " * 3
    ids = tok(text, add_special_tokens=False)["input_ids"]
    cases = [["晴れ"], ["🐟"], ["line;", "x²"], [" ok.\n  Ind"], ["the end. Na"], ["end. " * 2], ["absent"], ["."]]
    rng = random.Random(1)
    for stops in cases:
        want, n = first_stop(tok, ids, stops)
        for trial in range(4):
            output, sent, consumed, i = Output(tok, stops), [], [], 0
            while i < len(ids) and not output.stopped:
                k = rng.choice([1, 1, 2, 3, 7])
                text_now, ids_now = output(ids[i:i + k], final=i + k >= len(ids))
                sent.append(text_now)
                consumed += ids_now
                i += k
                assert not any(s in "".join(sent) for s in stops), (stops, sent)
            assert "".join(sent) == want and output.text == want, (stops, trial)
            assert consumed == ids[:n] == output.ids, (stops, trial, len(consumed), n)
            assert output.stopped == any(s in tok.decode(ids) for s in stops)


def answers_at_once(url: str, cases: list) -> list[list[int]]:
    """Each case (prompt, sampling, speculative) sent by its own client, all at once: the ids."""
    async def one(client, prompt, sampling, spec):
        r = await client.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": prompt}], "max_tokens": 32, "return_token_ids": True,
            "speculative": spec, **sampling}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    async def all_at_once():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, *c) for c in cases))
    return asyncio.run(all_at_once())


def test_concurrent_clients_get_their_solo_output(server, model):
    """Greedy and seeded, speculative or not, 12 clients at once on 4 rows: each answer is its
    solo `generate` output, token for token."""
    cases = [(p, sampling, spec) for p in PROMPTS[:3]
             for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 11}) for spec in (True, False)]
    for (prompt, sampling, spec), ids in zip(cases, answers_at_once(server, cases)):
        assert ids == solo(model, prompt, 32, **sampling), (prompt, sampling, spec)


def test_a_newcomers_prompt_is_read_between_the_running_rows_tokens(model):
    """With nothing decoding, a long prompt is read in one pass. While a row decodes, a
    newcomer's prompt is read a chunk a step, sized by time (on a CPU a token of prompt costs
    far more than 1/PREFILL_CHUNK of a decode pass, so the chunks are small, but at least
    PREFILL_MIN tokens), and the running row gets a token every one of those steps. Both answers
    are their solo output. In process, one step at a time."""
    from specdec.batcher import PREFILL_CHUNK, PREFILL_MIN, Batcher, Job
    from specdec.request import check_request

    batcher = Batcher(model, None, max_batch=2, context=1024)
    long = "Summarize this: " + " ".join(PROMPTS * 6)
    running, newcomer = (Job(check_request(model, model.tokenizer, long, 64, chat=True, context=1024),
                             lambda *_: None) for _ in range(2))
    running.request.eos = newcomer.request.eos = ()  # the running row must outlast the newcomer's prompt
    running.prompt_logprobs, newcomer.prompt_logprobs = [], []  # scored in one pass, and in chunks
    assert 4 * PREFILL_MIN < len(running.request.prompt_ids) < PREFILL_CHUNK
    batcher.submit(running)
    batcher.step()  # its whole prompt and the first token, then a decode pass
    assert running.read == len(running.request.prompt_ids) and len(running.request.out) == 2
    batcher.submit(newcomer)
    chunks = []
    while newcomer.read < len(newcomer.request.prompt_ids):
        read, out = newcomer.read, len(running.request.out)
        batcher.step()
        chunks.append(newcomer.read - read)
        assert len(running.request.out) == out + 1
    assert len(chunks) > 2 and all(c >= PREFILL_MIN for c in chunks[:-1]), chunks
    while any(batcher.slots):
        batcher.step()
    want = solo(model, long, 64)
    assert running.request.out[:len(want)] == want and newcomer.request.out[:len(want)] == want
    assert newcomer.prompt_logprobs == running.prompt_logprobs


def test_a_prompt_whose_last_chunk_is_one_token_is_scored_as_in_one_pass(model):
    """The last position of a prompt scores nothing: a last chunk of one token scores no token."""
    from specdec.batcher import Batcher, Job
    from specdec.request import check_request

    scores = []
    for chunk in (512, len(chat_ids(model, PROMPTS[0])) - 1):
        batcher = Batcher(model, None, max_batch=1, context=256, prefill_chunk=chunk)
        job = Job(check_request(model, model.tokenizer, PROMPTS[0], 4, chat=True, context=256), lambda *_: None)
        job.prompt_logprobs = []
        batcher.submit(job)
        while any(batcher.slots) or batcher.waiting:
            batcher.step()
        assert job.request.reason == "length"
        scores.append(job.prompt_logprobs)
    assert len(scores[0]) == len(chat_ids(model, PROMPTS[0])) - 1 and scores[1] == scores[0]


def test_a_model_draft_serves_the_solo_output_too(drafting_server, model):
    """The shipped draft model: its rows batch like the target's, its drafts are accepted, and
    each answer is still the solo output. A fixed k: `auto` may learn to leave the draft idle."""
    url = drafting_server
    cases = [(p, sampling, True) for p in PROMPTS[:4] for sampling in ({"temperature": 0},
                                                                      {"temperature": 0.8, "seed": 3})]
    for (prompt, sampling, _), ids in zip(cases, answers_at_once(url, cases)):
        assert ids == solo(model, prompt, 32, **sampling), (prompt, sampling)
    assert total(idle(url), "spec_decode_num_accepted_tokens_total") > 0


def test_a_stop_string_ends_the_answer_streamed_and_not(server, model):
    """The answer ends before the first stop string, finished for "stop", its usage counting the
    tokens up to the one that completed it; the row is freed, and /metrics counts a "stop"."""
    want_ids = solo(model, PROMPTS[3], 48)
    whole = model.tokenizer.decode(want_ids, skip_special_tokens=True)
    word = whole.split()[len(whole.split()) // 2]  # a word from the middle of the answer
    text, n = first_stop(model.tokenizer, want_ids, [word, "zzqx"])
    assert 0 < n < len(want_ids)
    before = idle(server)
    body = {"messages": [{"role": "user", "content": PROMPTS[3]}], "max_tokens": 48, "temperature": 0,
            "stop": [word, "zzqx"], "return_token_ids": True}
    r = post(server, "/v1/chat/completions", body).json()
    choice = r["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (text, "stop")
    assert choice["token_ids"] == want_ids[:n] and r["usage"]["completion_tokens"] == n
    with httpx.stream("POST", server + "/v1/chat/completions", timeout=120,
                      json=body | {"stop": word, "stream": True, "stream_options": {"include_usage": True}}) as s:
        chunks = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    parts = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(p["delta"].get("content", "") for p in parts) == whole[:whole.index(word)]
    assert [p["finish_reason"] for p in parts] == [None] * (len(parts) - 1) + ["stop"]
    assert chunks[-1]["usage"]["completion_tokens"] == n == len(sum((p.get("token_ids") or [] for p in parts), []))
    after = idle(server)
    assert total(after, "request_success_total", finished_reason="stop") - \
        total(before, "request_success_total", finished_reason="stop") == 2


def reference_logprobs(model, prompt_ids: list[int], ids: list[int], top: int):
    """Each token of ids' log-probability after the prompt and the tokens before it, and the top
    alternatives, from one pass over prompt and ids: on the kernel each row of it is exactly the
    one-token pass that chose the token."""
    import torch

    model.reset(len(prompt_ids) + len(ids))
    logits = model.forward(prompt_ids + ids)[len(prompt_ids) - 1: -1]
    lp = torch.log_softmax(logits.float(), -1)
    values, indices = lp.topk(top, -1)
    return lp[torch.arange(len(ids)), torch.tensor(ids)].tolist(), indices.tolist(), values.tolist()


def test_completions_take_several_prompts_and_echo_them_with_their_logprobs(server, model):
    """A list of prompts, n answers each: answer j of prompt p is choice p * n + j, the solo
    output with seed + j. With echo the text starts with the prompt, and with logprobs the prompt's
    tokens are scored too (none for the first), as lm-eval's loglikelihood asks of a server."""
    from specdec import generate

    tok = model.tokenizer
    raw, ids_in = PROMPTS[2], chat_ids(model, PROMPTS[1])
    r = post(server, "/v1/completions", {"prompt": [raw, ids_in], "n": 2, "max_tokens": 8, "temperature": 0.8,
                                         "seed": 9, "return_token_ids": True}).json()
    want = [generate(model, tok, p, 8, temperature=0.8, seed=9 + j).token_ids
            for p in (tok(raw)["input_ids"], ids_in) for j in range(2)]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in r["choices"]] == want
    assert r["usage"]["prompt_tokens"] == len(tok(raw)["input_ids"]) + len(ids_in)

    body = {"prompt": [ids_in], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0,
            "return_token_ids": True}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    out = choice["token_ids"]
    assert choice["text"] == tok.decode(ids_in, skip_special_tokens=True) + tok.decode(out, skip_special_tokens=True)
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in ids_in + out]
    chosen, top_ids, top_values = reference_logprobs(model, ids_in[:1], ids_in[1:] + out, 1)
    assert lp["token_logprobs"] == [None, *chosen] and lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1:] == [{tok.decode(i): v} for (i,), (v,) in zip(top_ids, top_values)]
    with httpx.stream("POST", server + "/v1/completions", timeout=120, json=body | {"stream": True}) as s:
        chunks = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"]
    # A prompt read in two chunks (512 tokens a step): scored across the boundary alike.
    long = tok(" ".join(PROMPTS * 30))["input_ids"][:700]
    got = post(server, "/v1/completions", body | {"prompt": long}).json()["choices"][0]
    chosen, _, _ = reference_logprobs(model, long[:1], long[1:] + got["token_ids"], 1)
    assert got["logprobs"]["token_logprobs"] == [None, *chosen]


def test_logprobs_are_the_targets_own_streamed_and_not(server, model):
    """A sampled, speculated request's logprobs: each token's log-probability under the target
    (before temperature) and its top alternatives, exactly those of the passes that chose it,
    in chat's form and in completions'; streamed, the same entries in order."""
    tok, ids_in = model.tokenizer, chat_ids(model, PROMPTS[1])
    body = {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 20, "temperature": 0.8, "seed": 4,
            "logprobs": True, "top_logprobs": 3, "return_token_ids": True}
    choice = post(server, "/v1/chat/completions", body).json()["choices"][0]
    ids = choice["token_ids"]
    assert ids == solo(model, PROMPTS[1], 20, temperature=0.8, seed=4)
    chosen, top_ids, top_values = reference_logprobs(model, ids_in, ids, 3)
    content = choice["logprobs"]["content"]
    assert [e["logprob"] for e in content] == chosen
    assert [e["token"] for e in content] == [tok.decode([t]) for t in ids]
    assert [[(a["token"], a["logprob"]) for a in e["top_logprobs"]] for e in content] == \
        [[(tok.decode([i]), v) for i, v in zip(row_i, row_v)] for row_i, row_v in zip(top_ids, top_values)]
    assert all(bytes(e["bytes"]).decode("utf-8", errors="replace") == e["token"] for e in content)
    with httpx.stream("POST", server + "/v1/chat/completions", timeout=120, json=body | {"stream": True}) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    assert sum(((c["choices"][0]["logprobs"] or {"content": []})["content"] for c in chunks), []) == content

    text = post(server, "/v1/completions", {"prompt": ids_in, "max_tokens": 20, "temperature": 0, "logprobs": 2,
                                            "return_token_ids": True}).json()["choices"][0]
    chosen, top_ids, top_values = reference_logprobs(model, ids_in, text["token_ids"], 2)
    lp = text["logprobs"]
    assert lp["token_logprobs"] == chosen and lp["tokens"] == [tok.decode([t]) for t in text["token_ids"]]
    assert lp["top_logprobs"] == [{tok.decode([i]): v for i, v in zip(a, b)} for a, b in zip(top_ids, top_values)]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert [next(iter(t)) for t in lp["top_logprobs"]] == lp["tokens"]  # greedy: each token is the likeliest
    assert post(server, "/v1/completions", {"prompt": ids_in, "max_tokens": 2}).json()["choices"][0]["logprobs"] is None


def test_n_choices_are_the_rows_of_a_seeded_batch_streamed_and_not(server, model):
    """n answers to one request: choice i samples with seed + i, so it is the solo output with
    that seed (as row i of a batch is); streamed, each chunk names its choice; usage sums them."""
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 16, "temperature": 0.8, "seed": 7,
            "n": 3, "return_token_ids": True}
    r = post(server, "/v1/chat/completions", body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    want = [solo(model, PROMPTS[0], 16, temperature=0.8, seed=7 + i) for i in range(3)]
    assert [c["token_ids"] for c in r["choices"]] == want and len({tuple(w) for w in want}) > 1
    assert r["usage"]["completion_tokens"] == sum(map(len, want))
    assert r["usage"]["prompt_tokens"] == len(chat_ids(model, PROMPTS[0]))
    with httpx.stream("POST", server + "/v1/chat/completions", timeout=120,
                      json=body | {"stream": True, "stream_options": {"include_usage": True}}) as s:
        chunks = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    for i, c in enumerate(r["choices"]):
        mine = [ch["choices"][0] for ch in chunks if ch["choices"] and ch["choices"][0]["index"] == i]
        assert "".join(p["delta"].get("content", "") for p in mine) == c["message"]["content"]
        assert sum((p.get("token_ids") or [] for p in mine), []) == c["token_ids"]
        assert [p["finish_reason"] for p in mine if p["finish_reason"]] == [c["finish_reason"]]
    tokens = ("prompt_tokens", "completion_tokens", "total_tokens")  # (what was drafted may differ: clocks choose k)
    assert [chunks[-1]["usage"][k] for k in tokens] == [r["usage"][k] for k in tokens]


def test_the_tokenizer_is_served_as_vllm_serves_it(server, model):
    """/tokenizer_info, /tokenize and /detokenize (what lm-eval's remote tokenizer reads): the
    served model's own tokenizer and chat template; bad input gets 400 naming the field."""
    tok = model.tokenizer
    info = httpx.get(server + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    text = "Naïve café: the quick brown fox."
    r = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == tok(text, add_special_tokens=False)["input_ids"] and r["count"] == len(r["tokens"])
    messages = [{"role": "user", "content": PROMPTS[0]}]
    assert post(server, "/tokenize", {"messages": messages}).json()["tokens"] == chat_ids(model, PROMPTS[0])
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == text
    for path, body, field in (("/tokenize", {"prompt": 3}, "prompt"), ("/tokenize", {"text": "x"}, "text"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": "ab"}, "tokens")):
        bad = post(server, path, body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, (path, body, bad.text)


def test_defaults_temperature_1_and_the_rest_of_the_context(server, model):
    """Without temperature a request samples at 1.0 (OpenAI's default); without max_tokens it may
    use the rest of the context (1024 here), and no more."""
    body = {"messages": [{"role": "user", "content": PROMPTS[2]}], "seed": 5, "max_tokens": 16,
            "return_token_ids": True}
    got = post(server, "/v1/chat/completions", body).json()["choices"][0]["token_ids"]
    assert got == solo(model, PROMPTS[2], 16, temperature=1.0, seed=5)
    long = model.tokenizer.decode(list(range(1000, 2010)))
    ids = model.tokenizer(long)["input_ids"][:1010]
    r = post(server, "/v1/completions", {"prompt": ids, "temperature": 0, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 1024 - 1010 and r["choices"][0]["finish_reason"] == "length"


BAD = [({"messages": "hi"}, "messages"), ({"messages": [{"role": "user", "content": 3}]}, "messages"),
       ({"messages": [{"role": "user", "content": "hi"}], "model": f"{MODEL}-draft"}, "model"),
       ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
       ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}, "max_tokens"),
       ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, "max_tokens"),
       ({"messages": [{"role": "user", "content": "hi " * 1100}], "max_tokens": 4}, "messages"),
       ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
       ({"messages": [{"role": "user", "content": "hi"}], "top_p": 2}, "top_p"),
       ({"messages": [{"role": "user", "content": "hi"}], "seed": -3}, "seed"),
       ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
       ({"messages": [{"role": "user", "content": "hi"}], "n": 5}, "n"),
       ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
       ({"messages": [{"role": "user", "content": "hi"}], "speculative": "no"}, "speculative"),
       ({"messages": [{"role": "user", "content": "hi"}], "stop": ["\n", ""]}, "stop"),
       ({"messages": [{"role": "user", "content": "hi"}], "stop": 3}, "stop"),
       ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}, "logprobs"),
       ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
       ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
       ({"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, "frobnicate")]


def test_bad_requests_get_400_naming_the_field_before_any_compute(server):
    before = idle(server)
    for body, field in BAD:
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == field, (body, r.json())
        assert field.split("_")[0] in r.json()["error"]["message"], r.json()
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = httpx.post(server + "/v1/completions", content=raw, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["message"], raw
    for prompt in ([], ["a", 3], ["a"] * 5):  # empty, mixed, more answers than rows (4 here)
        r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (prompt, r.text)
    after = metrics(server)
    for name in ("prompt_tokens_total", "generation_tokens_total", "request_success_total"):
        assert total(after, name) == total(before, name), name  # nothing ran, nothing was queued


def test_metrics_equal_the_counts(drafting_server):
    server = drafting_server
    before = idle(server)
    answers = [post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": p}], "max_tokens": 40,
                                                     "temperature": 0}).json() for p in PROMPTS]
    after = metrics(server)
    usage = [a["usage"] for a in answers]

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)
    assert delta("prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert delta("generation_tokens_total") == sum(u["completion_tokens"] for u in usage)
    # Drafts were made (a fixed k); the model-draft test asks for kept ones.
    assert delta("spec_decode_num_draft_tokens_total") == sum(u["speculation"]["drafted"] for u in usage) > 0
    assert delta("spec_decode_num_accepted_tokens_total") == sum(u["speculation"]["accepted"] for u in usage)
    assert delta("spec_decode_num_accepted_tokens_per_pos_total", position=0) <= delta("spec_decode_num_drafts_total")
    assert delta("request_success_total") == len(PROMPTS)
    spec = speculation_from_counters(before, after)  # as `specdec bench --endpoint` reads them
    assert spec["source"] == "specdec:spec_decode"
    assert spec["draft_tokens"] == sum(u["speculation"]["drafted"] for u in usage)
    assert spec["accepted"] == sum(u["speculation"]["accepted"] for u in usage)
    reasons = [a["choices"][0]["finish_reason"] for a in answers]
    for reason in set(reasons):
        assert delta("request_success_total", finished_reason=reason) == reasons.count(reason)


def test_a_full_queue_gets_429_and_every_other_request_is_answered(server):
    """4 rows and 8 places in the queue: of 20 requests at once, those past the 12th are
    refused at once with 429; none waits unbounded, none is lost."""
    async def one(client, i):
        r = await client.post(server + "/v1/completions", json={
            "prompt": f"Count from {i}:", "max_tokens": 48, "temperature": 0, "ignore_eos": True}, timeout=300)
        return r.status_code, r.json()

    async def burst():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(20)))

    before = idle(server)
    got = asyncio.run(burst())
    codes = [c for c, _ in got]
    assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 12, codes
    for code, body in got:
        if code == 429:
            assert "queue" in body["error"]["message"]
        else:
            assert body["usage"]["completion_tokens"] == 48
    assert total(metrics(server), "request_success_total") - total(before, "request_success_total") == \
        codes.count(200)


def test_a_client_that_disconnects_cancels_its_request(server):
    before = idle(server)
    long = {"messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 900,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=long | {"stream": True}, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # leaving the block closes the connection
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting
        post(server, "/v1/chat/completions", long, timeout=1.0)
    after = idle(server)  # both rows are freed long before 900 tokens
    assert total(after, "request_success_total", finished_reason="abort") - \
        total(before, "request_success_total", finished_reason="abort") == 2
    assert total(after, "generation_tokens_total") - total(before, "generation_tokens_total") < 2 * 900


def test_shutdown_finishes_what_is_in_flight_and_exits_cleanly():
    proc, url = start("--max-batch", "2", "--context", "512")
    body = {"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        proc.send_signal(signal.SIGTERM)  # mid-stream: the request still gets all its tokens
        events = [line[5:].strip() for line in lines if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=60) == 0
    assert "stopped" in proc.stderr.read()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)


def test_shutdown_cancels_what_outlasts_its_timeout():
    proc, url = start("--max-batch", "2", "--context", "2048", "--shutdown-timeout", "1")
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.time()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(httpx.RemoteProtocolError):  # the stream is cut, not finished
            list(lines)
    assert proc.wait(timeout=60) == 0
    assert time.time() - t0 < 60  # 2000 tokens would take longer


def test_it_binds_127_0_0_1_unless_told_and_refuses_bad_flags():
    from specdec.cli import build_parser, main

    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"
    for argv in (["serve", "--port", "70000"], ["serve", "--max-batch", "0"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    assert main(["serve", "--engine", "llama.cpp"]) == 2  # before loading anything


def test_soak_memory_flat_and_nothing_lost(tmp_path):
    """Two thousand requests, mixed lengths, streamed and not, some ended by a stop string, some
    with logprobs or echoed, one in ten cancelled by its client: every request is answered,
    refused with a reason or cancelled; the server's RSS after the second thousand is within a
    few MB of what it was after the first. The target is a tiny random model with the embedded
    model's tokenizer: the soak tries the server, not the model (on a Zen 3 VM the same requests
    took 207 s on SmolLM2, 36 s on this one)."""
    proc, url = start("--max-batch", "8", "--context", "256", "--queue-size", "64",
                      model=tiny_with_the_embedded_tokenizer(tmp_path / "tiny"))
    rng = random.Random(0)

    def rss() -> int:
        with open(f"/proc/{proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024

    async def one(client, i):
        body = {"prompt": f"{i}: " + "word " * rng.randint(1, 24), "max_tokens": rng.randint(1, 12),
                "temperature": rng.choice([0, 0.7]), "seed": i, "stream": rng.random() < 0.5,
                "speculative": rng.random() < 0.8, "stop": rng.choice([None, None, "\n", " word"]),
                "logprobs": rng.choice([None, None, None, 2]), "echo": rng.random() < 0.1}
        call = client.post(url + "/v1/completions", json=body, timeout=120)
        if rng.random() < 0.1:
            task = asyncio.ensure_future(call)
            await asyncio.sleep(rng.random() * 0.05)
            task.cancel()
            try:
                await task
                return "answered"
            except asyncio.CancelledError:
                return "cancelled"
        r = await call
        if r.status_code == 200:
            text = r.text
            assert ("[DONE]" in text) if body["stream"] else r.json()["usage"]["completion_tokens"] >= 1
            return "answered"
        assert r.status_code == 429 and "queue" in r.json()["error"]["message"], r.text
        return "refused"

    async def thousand(client, start):
        gate = asyncio.Semaphore(24)

        async def gated(i):
            async with gate:
                return await one(client, i)
        return await asyncio.gather(*(gated(i) for i in range(start, start + 1000)))

    async def soak():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32)) as client:
            first = await thousand(client, 0)
            mid = rss()
            second = await thousand(client, 1000)
            return first + second, mid

    try:
        outcomes, mid = asyncio.run(soak())
        m = idle(url)
        end = rss()
        assert len(outcomes) == 2000 and set(outcomes) <= {"answered", "refused", "cancelled"}
        ended = total(m, "request_success_total")
        answered = outcomes.count("answered")
        # Each admitted request ended once, with a reason; a cancelled client's request may have
        # been admitted or refused before it went.
        assert answered <= ended <= answered + outcomes.count("cancelled"), (ended, outcomes.count("answered"))
        assert end - mid < 32, (mid, end)
    finally:
        assert stop(proc) == 0


def test_poisson_arrivals_are_a_poisson_process_the_same_for_every_endpoint():
    import numpy as np

    from specdec.bench.runner import BenchConfig

    a = poisson_arrivals(4000, 5.0, seed=1)
    assert a == poisson_arrivals(4000, 5.0, seed=1) and a[0] == 0.0
    gaps = np.diff(a)
    assert (gaps > 0).all()
    assert abs(gaps.mean() - 0.2) < 0.01  # mean gap 1/rate
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # exponential gaps: coefficient of variation 1
    assert poisson_arrivals(3, None, seed=0) == [0.0, 0.0, 0.0]  # a closed loop sends all at once
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="request rate"):
            BenchConfig(endpoints=["a=http://x"], request_rate=bad).validate()
