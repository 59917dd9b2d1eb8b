"""`specdec serve`: an OpenAI-compatible HTTP server over the batcher (Starlette on uvicorn).

    POST /v1/chat/completions   POST /v1/completions   (stream: true for server-sent events)
    GET  /v1/models             GET  /health            GET  /metrics (Prometheus text)
    GET  /tokenizer_info        POST /tokenize          POST /detokenize (as vLLM's)

Every request is checked before any compute and refused with 400 naming the field; a full
queue gets 429; a client that disconnects cancels its request; the one model it serves is
the only one it ever loads. A stop string ends the answer before it (`Output`). Extensions to
OpenAI's fields: `top_k`, `ignore_eos` and `return_token_ids` (as vLLM reads them) and
`speculative: false` (decode this request without drafts; its output is the same, only its
speed changes).
"""
from __future__ import annotations

import asyncio
import collections
import json
import time
import uuid
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .batcher import Batcher, Closed, Job, QueueFull
from .request import check_request, row_seeds

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
          "n", "ignore_eos", "speculative", "return_token_ids", "user"}
FIELDS = {"chat": COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"},
          "text": COMMON | {"prompt", "logprobs", "echo"}}
MAX_LOGPROBS = 20  # alternatives a token may ask for (OpenAI's bound for chat)
# Our finish reasons in OpenAI's words (and vLLM's metrics'): EOS and a stop string are both "stop".
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


class TextDelta:
    """New text as tokens arrive, held back while it ends in half a character. Each call decodes
    a short window (the tokens since the last text sent, and those before it that text came from,
    so a tokenizer sees a word's start), not the whole output again."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.start, self.sent = tokenizer, [], 0, 0  # window: ids[start:]; sent: ids[:sent]

    def __call__(self, new: list[int], final: bool = False) -> str:
        self.ids += new
        before, text = self._decode(self.ids[self.start:self.sent]), self._decode(self.ids[self.start:])
        if (text.endswith("\ufffd") and not final) or len(text) <= len(before):
            return ""
        self.start, self.sent = self.sent, len(self.ids)
        return text[len(before):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class Output:
    """A request's answer as it arrives: the text to send now, and the ids it came from. With
    stop strings, the text ends before the first one, and the ids with the token that completed
    it; text that could be the start of one is held back until the next tokens tell."""

    def __init__(self, tokenizer, stop: list[str] = ()):
        self.delta, self.stop = TextDelta(tokenizer), list(stop)
        self.ids, self.text = [], ""  # all the answer's ids (up to the stop) and its text
        self.sent, self.searched, self.stopped = 0, 0, False  # text handed out; text searched for stops

    def __call__(self, new: list[int], final: bool = False) -> tuple[str, list[int]]:
        start = len(self.ids)
        if self.stopped:
            return "", []
        if not self.stop:
            self.ids += new
            self.text += self.delta(new, final)
        else:
            for i, token in enumerate(new):  # one at a time, to know which one completes a stop string
                self.ids.append(token)
                self.text += self.delta([token], final and i == len(new) - 1)
                cut = self._stop_at()
                if cut is not None:
                    self.text, self.stopped = self.text[:cut], True
                    break
        end = len(self.text) if final or self.stopped else len(self.text) - self._held()
        text, self.sent = self.text[self.sent:end], max(self.sent, end)
        return text, self.ids[start:]

    def _stop_at(self) -> int | None:
        """Where the first stop string starts, if one has appeared since the last search."""
        frm = max(0, self.searched - max(map(len, self.stop)) + 1)
        self.searched = len(self.text)
        found = [i for i in (self.text.find(s, frm) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _held(self) -> int:
        """How much of the text's end is the start of a stop string (0: none of it)."""
        return max((n for s in self.stop for n in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:n])), default=0)


class Logprobs:
    """A choice's `logprobs`, in its endpoint's form, for the output's tokens as they are sent:
    chat's list of {token, logprob, bytes, top_logprobs}, or completions' parallel lists."""

    def __init__(self, tokenizer, kind: str, request, prompt: list | None = None):
        self.tokenizer, self.kind, self.request = tokenizer, kind, request
        self.given, self.offset = 0, 0  # tokens given so far; their text's length (text_offset)
        self.prompt = prompt  # echo: the prompt's entries (filled at prefill), given before the first token's

    def __call__(self, n: int) -> dict | None:
        """The next n tokens' entries (None: the request did not ask for logprobs)."""
        if self.request.logprobs is None:
            return None
        start, self.given = self.given, self.given + n
        ids, entries = self.request.out[start:self.given], self.request.logprobs_out[start:self.given]
        if self.prompt is not None:  # the first prompt token has nothing before it to score it
            ids, entries, self.prompt = self.request.prompt_ids + ids, [(None, None), *self.prompt, *entries], None
        tokens = [self._text(t) for t in ids]
        if self.kind == "chat":
            return {"content": [self._entry(s, lp) | {"top_logprobs": [self._entry(self._text(i), v) for i, v in top]}
                                for s, (lp, top) in zip(tokens, entries)]}
        offsets = []
        for s in tokens:
            offsets.append(self.offset)
            self.offset += len(s)
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in entries],
                "top_logprobs": [None if top is None else {self._text(i): v for i, v in top} for _, top in entries],
                "text_offset": offsets}

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    @staticmethod
    def _entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", errors="replace"))}


def _logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives a token's logprobs list (None: no logprobs): chat asks with
    `logprobs: true` and `top_logprobs`, completions with `logprobs: n`."""
    name = "logprobs"
    if kind == "chat":
        want, top = _field(body, "logprobs", (bool,), False), _field(body, "top_logprobs", (int,))
        if top is not None and not want:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        name, top = "top_logprobs", (top or 0) if want else None
    else:
        top = _field(body, "logprobs", (int,))
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise BadRequest(f"{name} must be in [0, {MAX_LOGPROBS}], got {top}", name)
    return top


def _is_ids(value: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of them", "stop")
    return stop


def _field(body: dict, name: str, kinds, default=None):
    value = body.get(name, default)
    if value is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
        names = " or ".join(k.__name__ for k in kinds)
        raise BadRequest(f"{name} must be {names}, got {type(value).__name__}", name)
    return value


class Server:
    """The routes, over one batcher and the model it serves."""

    def __init__(self, batcher: Batcher, name: str):
        self.batcher, self.name = batcher, name
        self.model, self.tokenizer = batcher.model, batcher.model.tokenizer
        self.created = int(time.time())

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/health", self.health), Route("/v1/models", self.models), Route("/metrics", self.metrics),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/tokenizer_info", self.tokenizer_info), Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ])

    async def health(self, _: HTTPRequest) -> Response:
        if self.batcher.closing:
            return error(503, "shutting down", kind="unavailable")
        return JSONResponse({"status": "ok"})

    async def models(self, _: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.name, "object": "model", "created": self.created, "owned_by": "specdec",
             "max_model_len": self.batcher.context}]})

    async def metrics(self, _: HTTPRequest) -> Response:
        c, label = self.batcher.counters, f'model_name="{self.name}"'
        spec = c.speculation
        lines = []

        def metric(name, kind, value, labels=""):
            lines.append(f"# TYPE specdec:{name} {kind}")
            lines.append(f"specdec:{name}{{{label}{labels}}} {value}")
        metric("num_requests_running", "gauge", self.batcher.running)
        metric("num_requests_waiting", "gauge", len(self.batcher.waiting))
        metric("prompt_tokens_total", "counter", c.prompt_tokens)
        metric("generation_tokens_total", "counter", c.generation_tokens)
        metric("spec_decode_num_drafts_total", "counter", spec.proposed_at[0] if spec.proposed_at else 0)
        metric("spec_decode_num_draft_tokens_total", "counter", spec.drafted)
        metric("spec_decode_num_accepted_tokens_total", "counter", spec.accepted)
        lines.append("# TYPE specdec:spec_decode_num_accepted_tokens_per_pos_total counter")
        for i, n in enumerate(spec.accepted_at):
            lines.append(f'specdec:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{i}"}} {n}')
        lines.append("# TYPE specdec:request_success_total counter")
        finished = collections.Counter()
        for reason, n in c.finished.items():
            finished[FINISH.get(reason, reason)] += n
        for reason, n in sorted(finished.items()):
            lines.append(f'specdec:request_success_total{{{label},finished_reason="{reason}"}} {n}')
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    # The tokenizer, as vLLM serves it: what lm-eval's remote tokenizer reads, so that a client
    # needs no copy of the model's files.

    async def tokenizer_info(self, _: HTTPRequest) -> Response:
        tok = self.tokenizer
        return JSONResponse({"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token,
                             "bos_token": tok.bos_token, "pad_token": tok.pad_token,
                             "chat_template": getattr(tok, "chat_template", None),
                             "model_max_length": self.batcher.context})

    async def tokenize(self, request: HTTPRequest) -> Response:
        """{"prompt": text, "add_special_tokens": true} or {"messages": [...]}: the ids."""
        try:
            body = await _body(request, {"model", "prompt", "add_special_tokens", "messages"})
            if "messages" in body:
                ids = self._chat_ids(body)
            elif isinstance(body.get("prompt"), str):
                special = _field(body, "add_special_tokens", (bool,), True)
                ids = self.tokenizer(body["prompt"], add_special_tokens=special)["input_ids"]
            else:
                raise BadRequest("prompt must be a string (or send messages)", "prompt")
        except BadRequest as exc:
            return error(400, str(exc), exc.param)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.batcher.context})

    async def detokenize(self, request: HTTPRequest) -> Response:
        """{"tokens": ids}: their text."""
        try:
            body = await _body(request, {"model", "tokens"})
            ids = body.get("tokens")
            if not isinstance(ids, list) or not _is_ids(ids) or not all(0 <= t < self.model.vocab_size for t in ids):
                raise BadRequest(f"tokens must be a list of token ids in [0, {self.model.vocab_size})", "tokens")
        except BadRequest as exc:
            return error(400, str(exc), exc.param)
        return JSONResponse({"prompt": self.tokenizer.decode(ids)})

    async def chat(self, request: HTTPRequest) -> Response:
        return await self._serve(request, "chat")

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._serve(request, "text")

    # ------------------------------------------------------------------ checks

    def _prompts(self, body: dict, kind: str) -> list[list[int]]:
        """Each prompt's ids: chat's one, or completions' one or more (a string, token ids, or a
        list of either)."""
        if kind == "chat":
            return [self._chat_ids(body)]
        prompt = body.get("prompt")
        one = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_ids(prompt))
        prompts = [prompt] if one else prompt if isinstance(prompt, list) else None
        if not prompts or not all((isinstance(p, str) and p) or (isinstance(p, list) and p and _is_ids(p))
                                  for p in prompts):
            raise BadRequest("prompt must be a non-empty string or list of token ids, or a list of them", "prompt")
        return [self.tokenizer(p)["input_ids"] if isinstance(p, str) else p for p in prompts]

    def _chat_ids(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a role and content", "messages")
            content = m.get("content")
            if isinstance(content, list):  # OpenAI's content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
                m = {**m, "content": "".join(p["text"] for p in content)}
                messages[i] = m
            elif not isinstance(content, str):
                raise BadRequest(f"messages[{i}].content must be a string", "messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest(f"{self.name} has no chat template: use /v1/completions", "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 -- a template that refuses these messages
            raise BadRequest(f"messages: the chat template refused them: {exc}", "messages") from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _check(self, body, kind: str):
        """The request as the batcher takes it, and how to answer; BadRequest before any compute."""
        model = _field(body, "model", (str,))
        if model is not None and model != self.name:
            raise BadRequest(f"model {model!r} is not served here (this server serves {self.name!r})", "model")
        n = _field(body, "n", (int,), 1)
        if not 1 <= n <= self.batcher.max_batch:
            raise BadRequest(f"n must be in [1, {self.batcher.max_batch}] (--max-batch), got {n}", "n")
        stream = _field(body, "stream", (bool,), False)
        options = _field(body, "stream_options", (dict,), {}) or {}
        if set(options) - {"include_usage"}:
            raise BadRequest(f"unknown stream_options field {sorted(set(options) - {'include_usage'})[0]!r}",
                             "stream_options")
        stop, logprobs = _stop_strings(body), _logprobs(body, kind)
        echo = kind == "text" and _field(body, "echo", (bool,), False)
        prompts = self._prompts(body, kind)
        where = "messages" if kind == "chat" else "prompt"
        if len(prompts) * n > self.batcher.max_batch:
            raise BadRequest(f"{len(prompts)} prompts x n = {n} answers, past --max-batch {self.batcher.max_batch}",
                             "n" if n > 1 else "prompt")
        longest = max(map(len, prompts))
        if longest >= self.batcher.context:
            raise BadRequest(f"{where}: {longest} tokens, past the server's context of {self.batcher.context} "
                             "(--context)", where)
        name = "max_completion_tokens" if kind == "chat" and "max_completion_tokens" in body else "max_tokens"
        max_tokens = _field(body, name, (int,))
        if max_tokens is None:
            max_tokens = max(self.batcher.context - longest, 0)
        elif max_tokens < 1:
            raise BadRequest(f"{name} must be >= 1, got {max_tokens}", name)
        sampling = {k: body.get(k, d) for k, d in (("temperature", 1.0), ("top_p", None), ("top_k", None))}
        try:  # a prompt's answer j samples with seed + j, as row j of a batch does (request.row_seeds)
            seeds = row_seeds(body.get("seed"), n)
            requests = [check_request(self.model, self.tokenizer, ids, max_tokens, context=self.batcher.context,
                                      seed=seed, logprobs=logprobs, **sampling) for ids in prompts for seed in seeds]
            self.batcher.drafter.check_prompts(prompts)
        except (ValueError, TypeError) as exc:
            message = str(exc)  # each check's message starts with what it checks
            param = next((k for k in ("temperature", "top_p", "top_k", "seed", "max_tokens") if message.startswith(k)),
                         None)
            if param is None:  # the prompt's ids, or prompt + max_tokens over the context (the prompt fits)
                param = name if message.startswith("prompt (") else where
            raise BadRequest(message.replace("max_tokens", name), name if param == "max_tokens" else param) from None
        ignore_eos = _field(body, "ignore_eos", (bool,), False)
        for req in requests:
            req.eos = () if ignore_eos else req.eos
        flags = {"stream": stream, "usage": bool(options.get("include_usage")), "n": n, "echo": echo,
                 "ids": _field(body, "return_token_ids", (bool,), False), "stop": stop}
        return requests, _field(body, "speculative", (bool,), True), flags

    # ------------------------------------------------------------------ answering

    async def _serve(self, request: HTTPRequest, kind: str) -> Response:
        try:
            requests, speculative, flags = self._check(await _body(request, FIELDS[kind]), kind)
        except BadRequest as exc:
            return error(400, str(exc), exc.param)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        # A whole answer without stop strings has nothing to do before its end: its steps do not
        # wake the event loop, whose work would take a core from the engine's pass.
        quiet = not flags["stream"] and not flags["stop"]

        def emitter(i: int):
            def emit(new, reason):  # on the engine thread
                if quiet and reason is None:
                    return
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (i, requests[i].out if quiet else new, reason))
                except RuntimeError:  # the loop has closed (shutdown): nobody is waiting
                    pass
            return emit
        score_prompt = flags["echo"] and requests[0].logprobs is not None  # the prompt's own logprobs too
        choices = []
        for i, req in enumerate(requests):
            job = Job(req, emitter(i), speculative, prompt_logprobs=[] if score_prompt else None)
            choices.append(Choice(job, Output(self.tokenizer, flags["stop"]),
                                  Logprobs(self.tokenizer, kind, req, job.prompt_logprobs),
                                  self.tokenizer.decode(req.prompt_ids, skip_special_tokens=True) if flags["echo"]
                                  else ""))
        try:
            self.batcher.submit(*(c.job for c in choices))
        except QueueFull as exc:
            return error(429, f"the queue is full: {exc}", kind="rate_limit_exceeded")
        except Closed as exc:
            return error(503, str(exc), kind="unavailable")
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        answer = (self._stream if flags["stream"] else self._whole)(request, choices, events, kind, rid, flags)
        if flags["stream"]:
            return StreamingResponse(answer, media_type="text/event-stream")
        return await answer

    def _next(self, c: "Choice", new: list[int], reason: str | None):
        """A choice's news: the text and ids to send, and its finish reason if it ended (a stop
        string ends it here, and its job at the next step)."""
        text, ids = c.output(new, final=reason is not None)
        if c.output.stopped:
            self.batcher.cancel(c.job, "stop")
            reason = "stop"
        c.reason = reason
        return text, ids, reason

    def _usage(self, choices: list["Choice"], flags: dict) -> dict:
        """completion_tokens: the answers' tokens (those up to a stop string; the engine may
        have gone past it)."""
        n, stats = sum(len(c.output.ids) for c in choices), [c.job.request.stats for c in choices]
        prompt = sum(len(c.job.request.prompt_ids) for c in choices[::flags["n"]])  # each prompt once
        return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                "speculation": {"drafted": sum(s.drafted for s in stats), "accepted": sum(s.accepted for s in stats),
                                "target_passes": sum(s.target_calls for s in stats)}}

    def _choice(self, kind: str, index: int, text: str, reason: str | None, ids=None, logprobs=None,
                delta: bool = False) -> dict:
        if kind == "chat":
            body = {"index": index, "delta" if delta else "message": ({"content": text} if delta else
                                                                        {"role": "assistant", "content": text})}
        else:
            body = {"index": index, "text": text}
        body["logprobs"] = logprobs
        body["finish_reason"] = FINISH.get(reason) if reason else None
        if ids is not None:
            body["token_ids"] = ids
        return body

    def _envelope(self, kind: str, rid: str, stream: bool) -> dict:
        obj = {"chat": "chat.completion", "text": "text_completion"}[kind] + (".chunk" if stream and kind == "chat"
                                                                               else "")
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.name}

    def _cancel(self, choices: list["Choice"]) -> None:
        for c in choices:
            if c.reason is None:
                self.batcher.cancel(c.job)

    async def _whole(self, request: HTTPRequest, choices, events: asyncio.Queue, kind, rid, flags) -> Response:
        """Wait for every whole answer (or its stop string); a client gone meanwhile cancels them."""
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while any(c.reason is None for c in choices):
                get = asyncio.ensure_future(events.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    self._cancel(choices)
                    return Response(status_code=499)
                i, new, reason = get.result()
                if choices[i].reason is not None:
                    continue  # tokens past a stop string
                if reason in ("cancelled", "error"):
                    self._cancel(choices)
                    return error(503 if reason == "cancelled" else 500, f"the request was {reason}: the server is "
                                 "shutting down" if reason == "cancelled" else "the engine failed on this request",
                                 kind="server_error")
                self._next(choices[i], new, reason)
        finally:
            gone.cancel()
        return JSONResponse(self._envelope(kind, rid, False) | {
            "choices": [self._choice(kind, i, c.echo + c.output.text, c.reason, c.output.ids if flags["ids"] else None,
                                     c.logprobs(len(c.output.ids))) for i, c in enumerate(choices)],
            "usage": self._usage(choices, flags)})

    async def _stream(self, _: HTTPRequest, choices, events: asyncio.Queue, kind, rid, flags):
        """Server-sent events: a chunk a step for each choice; closing the stream (a client gone)
        cancels the jobs."""
        head = self._envelope(kind, rid, True)
        try:
            if kind == "chat":
                for i in range(len(choices)):
                    yield _sse(head | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
            while any(c.reason is None for c in choices):
                i, new, reason = await events.get()
                c = choices[i]
                if c.reason is not None:
                    continue  # tokens past a stop string
                if reason in ("cancelled", "error"):
                    yield _sse({"error": {"message": f"the request was {reason}", "type": "server_error"}})
                    return
                text, ids, reason = self._next(c, new, reason)
                text, c.echo = c.echo + text, ""  # an echoed prompt comes with the first token
                if text or reason or (ids and (flags["ids"] or c.job.request.logprobs is not None)):
                    yield _sse(head | {"choices": [self._choice(kind, i, text, reason, ids if flags["ids"] else None,
                                                                c.logprobs(len(ids)), delta=True)]})
            if flags["usage"]:
                yield _sse(head | {"choices": [], "usage": self._usage(choices, flags)})
            yield "data: [DONE]\n\n"
        finally:
            self._cancel(choices)


@dataclass(eq=False)
class Choice:
    """One of a request's n answers: its job in the batcher, its text and logprobs as they come,
    and its finish reason once it has ended (here: a stop string ends it before its job does)."""

    job: Job
    output: Output
    logprobs: Logprobs
    echo: str = ""  # the prompt's text, before the answer (completions' echo)
    reason: str | None = None


async def _body(request: HTTPRequest, fields: set[str]) -> dict:
    """A JSON object with only these fields, or BadRequest."""
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}", unknown[0])
    return body


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _disconnected(request: HTTPRequest) -> None:
    """Returns once the client has gone (the body is read already, so only a disconnect comes)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def serve(batcher: Batcher, name: str, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
          log=print) -> None:
    """Serve until SIGINT or SIGTERM; then take nothing new, let what is in flight finish for up
    to `shutdown_timeout` seconds, cancel the rest, and return. The engine runs on this thread
    (the one that loaded the model: Batcher.run says why), HTTP on another."""
    import signal
    import threading

    import uvicorn

    http = uvicorn.Server(uvicorn.Config(Server(batcher, name).app(), host=host, port=port, log_level="warning",
                                         timeout_graceful_shutdown=shutdown_timeout))

    def on_signal(sig, _):
        http.force_exit = http.should_exit  # a second one: stop waiting for what is in flight
        http.should_exit = True

    def listen():
        try:
            http.run()  # off the main thread uvicorn installs no signal handlers: on_signal is ours
        finally:
            batcher.close(cancel=True)  # what outlasted the graceful shutdown

    before = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=listen, name="specdec-http")
    thread.start()
    while not http.started and thread.is_alive():
        time.sleep(0.01)
    try:
        if not http.started:
            raise OSError(f"cannot listen on {host}:{port} (in use, or not an address of this machine)")
        log(f"specdec: serving {name} on http://{host}:{port} ({batcher.max_batch} rows, context "
            f"{batcher.context}, draft {batcher.drafter!r})")
        batcher.run()
    finally:
        http.should_exit = True
        thread.join()
        for sig, handler in before.items():
            signal.signal(sig, handler)
    log("specdec: stopped")
