"""Benchmarking serving endpoints: does speculation pay on a vLLM / SGLang / llama-server deployment?

`specdec bench --endpoint plain=URL --endpoint spec=URL` sends the same prompts to each
OpenAI-compatible `/v1/chat/completions` endpoint with `stream: true` and
`stream_options.include_usage`, the same max_tokens, temperature and seed, and timestamps
every streamed chunk as it arrives (httpx, asynchronously). Requests come in a closed loop
(all sent at once, `level` in flight, the prompts going round until a trial has at least
3 x `level` requests, so that the ramp and the drain do not make most of the run) or, with a
request rate, as a Poisson process, at most `level` in flight, at the same times for every
endpoint.

Per request: TTFT (first content chunk); TPOT = (end - TTFT) / (completion_tokens - 1), with
completion_tokens from `usage`; inter-chunk latency, kept apart from TPOT (vLLM and SGLang
put a whole verification step's tokens in one chunk, llama-server sends one per token, so a
chunk is a step there and a token here); end-to-end latency; output tokens per second.
Against the first endpoint: per level, throughput over its throughput, with each trial's own
ratio (trials run in balanced orders, so trial t of each ran close in time); at 1 in flight in a
closed loop, where each prompt goes to every endpoint in turn, time per token paired per prompt.

Speculation counters come from the server, as deltas of its Prometheus counters around each
endpoint's timed requests (warm-up excluded): vLLM's `vllm:spec_decode_*`, llama-server's
`llamacpp:spec_decode_*` (with `--metrics`) and `specdec serve`'s `specdec:spec_decode_*`, plus llama-server's `timings.draft_n` /
`draft_n_accepted` in each response. SGLang exports only gauges, so its acceptance comes from
`meta_info` where a response carries it. What a server does not offer is reported as n/a.

Pitfalls handled: `cache_prompt: false` for llama-server, and each trial's prompts made
distinct (a trial tag in front), so no prompt cache flatters a repeated run (`cached_tokens`
is summed and reported); endpoints interleaved per prompt at concurrency 1 and in a balanced
order per level (`stats.interleaved_order`); a warm-up request per endpoint; timeouts and
server errors kept per request; a dead URL refused with a one-line error before anything
runs. Every request opens its own connection (TTFT includes connecting), since servers close
kept-alive ones at will.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass

import numpy as np

from .stats import interleaved_order, summarize_ratios

SPEC_COUNTERS = ("num_drafts_total", "num_draft_tokens_total", "num_accepted_tokens_total")
METRIC_LINE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)')


@dataclass
class Endpoint:
    name: str
    url: str  # the server's base URL: http://host:port (a trailing /v1 is accepted)
    model: str | None = None  # the "model" field sent; by default the first of /v1/models

    @property
    def base(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")


def parse_endpoint(text: str) -> Endpoint:
    name, sep, url = text.partition("=")
    if not sep or not name or not re.match(r"^https?://", url):
        raise ValueError(f"--endpoint takes NAME=URL (http://host:port), got {text!r}")
    return Endpoint(name, url)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name" or "name{labels}": value}."""
    out = {}
    for line in text.splitlines():
        m = METRIC_LINE.match(line)
        if m and not line.startswith("#"):
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                pass
    return out


def _by_name(metrics: dict, name: str, position: bool = False) -> dict:
    """Sum of a metric over its label sets (vLLM labels by model), keyed by `position` if asked."""
    out = {}
    for key, v in metrics.items():
        base, _, labels = key.partition("{")
        if base == name:
            m = re.search(r'position="(\d+)"', labels)
            at = int(m.group(1)) if position and m else None
            out[at] = out.get(at, 0.0) + v
    return out


def speculation_from_counters(before: dict, after: dict) -> dict | None:
    """Acceptance from the server's own counters (vLLM's or llama-server's names), or None."""
    for prefix in ("vllm:spec_decode_", "llamacpp:spec_decode_", "specdec:spec_decode_"):
        totals = [(_by_name(after, prefix + k).get(None), _by_name(before, prefix + k).get(None, 0.0))
                  for k in SPEC_COUNTERS]
        if any(a is None for a, _ in totals):
            continue
        drafts, drafted, accepted = (a - b for a, b in totals)
        per_after = _by_name(after, prefix + "num_accepted_tokens_per_pos_total", position=True)
        per_before = _by_name(before, prefix + "num_accepted_tokens_per_pos_total", position=True)
        per_pos = [(per_after[i] - per_before.get(i, 0.0)) / drafts if drafts else math.nan
                   for i in sorted(k for k in per_after if k is not None)]
        return {"source": prefix.rstrip("_"), "drafts": drafts, "draft_tokens": drafted, "accepted": accepted,
                "acceptance_rate": accepted / drafted if drafted else math.nan,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else math.nan,
                "accepted_per_position": per_pos}
    return None


class Client:
    """One endpoint's server: what it is, its counters, and streamed chat completions."""

    def __init__(self, endpoint: Endpoint, http, timeout: float):
        self.ep, self.http, self.timeout = endpoint, http, timeout
        self.kind = "openai"

    async def probe(self) -> None:
        """Fail fast on a dead URL; learn the model name and what kind of server it is."""
        try:
            r = await self.http.get(self.ep.base + "/v1/models", timeout=10.0)
            r.raise_for_status()
        except Exception as exc:  # noqa: BLE001 -- any failure here is "not answering"
            raise ValueError(f"endpoint {self.ep.name} ({self.ep.url}) is not answering: "
                             f"{type(exc).__name__}: {exc}".splitlines()[0]) from None
        models = r.json().get("data") or r.json().get("models") or []
        if self.ep.model is None and models:
            self.ep.model = models[0].get("id") or models[0].get("model") or models[0].get("name")
        metrics = await self.metrics()
        if any(k.startswith("vllm:") for k in metrics):
            self.kind = "vllm"
        elif any(k.startswith("llamacpp:") for k in metrics) or (await self._ok("/props")):
            self.kind = "llama.cpp"
        elif await self._ok("/get_server_info"):
            self.kind = "sglang"

    async def _ok(self, path: str) -> bool:
        try:
            return (await self.http.get(self.ep.base + path, timeout=5.0)).status_code == 200
        except Exception:  # noqa: BLE001
            return False

    async def metrics(self) -> dict[str, float]:
        try:
            r = await self.http.get(self.ep.base + "/metrics", timeout=10.0)
            return parse_metrics(r.text) if r.status_code == 200 else {}
        except Exception:  # noqa: BLE001 -- a server without /metrics: counters n/a
            return {}

    async def complete(self, messages, max_tokens: int, temperature: float, seed: int, ignore_eos: bool) -> dict:
        body = {"model": self.ep.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "seed": seed, "stream": True, "stream_options": {"include_usage": True}}
        if ignore_eos:
            body["ignore_eos"] = True  # vLLM, SGLang and llama-server read it
        if self.kind == "llama.cpp":
            body["cache_prompt"] = False
        out = {"chunks": [], "error": None, "usage": None, "timings": None, "meta_info": None}
        t0 = time.perf_counter()
        try:
            async with self.http.stream("POST", self.ep.base + "/v1/chat/completions", json=body,
                                        timeout=self.timeout) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    out["error"] = f"HTTP {r.status_code}: {text[:200]}"
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                            continue
                        now = time.perf_counter() - t0
                        chunk = json.loads(line[5:])
                        if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                            out["chunks"].append(now)
                        for key in ("usage", "timings", "meta_info"):
                            if chunk.get(key):
                                out[key] = chunk[key]
        except Exception as exc:  # noqa: BLE001 -- timeouts, resets: kept, per request
            out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        out["seconds"] = time.perf_counter() - t0
        return request_metrics(out)


def request_metrics(r: dict) -> dict:
    """TTFT, TPOT, inter-chunk latencies, end-to-end and tokens/s of one streamed request."""
    chunks, usage = r["chunks"], r.get("usage") or {}
    n = usage.get("completion_tokens")
    if r["error"] is None and (not chunks or n is None):
        r["error"] = "no content chunks" if not chunks else "no usage in the stream (stream_options unsupported?)"
    if r["error"] is None:
        r["ttft"] = chunks[0]
        r["tpot"] = (r["seconds"] - chunks[0]) / (n - 1) if n > 1 else math.nan
        r["itl"] = list(np.diff(chunks))
        r["tokens"] = n
        r["tokens_per_s"] = n / r["seconds"]
        r["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return r


def _pct(values, q):
    v = [x for x in values if x is not None and not math.isnan(x)]
    return float(np.percentile(v, q)) if v else math.nan


def summarize_level(results: list[dict], walls: list[float], spec: dict | None) -> dict:
    """One endpoint at one level; walls[t]: trial t's seconds. Throughput is over all trials, and
    per trial too, so that a comparison of two endpoints can pair their trials (run back to back)
    and show how far it moved between them."""
    ok = [r for r in results if r["error"] is None]
    wall = sum(walls)
    itl = [x for r in ok for x in r["itl"]]
    drafted = [r["timings"].get("draft_n") for r in ok if r.get("timings") and "draft_n" in r["timings"]]
    out = {"requests": len(results), "errors": [r["error"] for r in results if r["error"]],
           "throughput_tokens_per_s": sum(r["tokens"] for r in ok) / wall if wall else math.nan,
           "trial_throughputs": [sum(r["tokens"] for r in ok if r["trial"] == t) / w if w else math.nan
                                 for t, w in enumerate(walls)],
           "cached_tokens": sum(r["cached_tokens"] for r in ok), "speculation": spec}
    for key in ("ttft", "tpot", "seconds", "tokens_per_s"):
        out[key] = {"p50": _pct([r[key] for r in ok], 50), "p90": _pct([r[key] for r in ok], 90),
                    "p99": _pct([r[key] for r in ok], 99)}
    out["itl"] = {"p50": _pct(itl, 50), "p90": _pct(itl, 90), "p99": _pct(itl, 99)}
    if drafted:  # llama-server's own per-response counts
        acc = sum(r["timings"].get("draft_n_accepted", 0) for r in ok if r.get("timings"))
        out["response_timings"] = {"draft_n": sum(drafted), "draft_n_accepted": acc,
                                   "acceptance_rate": acc / sum(drafted) if sum(drafted) else math.nan}
    return out


async def _run(endpoints, prompts, cfg, log, progress: bool) -> dict:
    import httpx
    from tqdm.auto import tqdm

    # A fresh connection per request: a server may close a kept-alive one between requests
    # (llama-server's HTTP library does after five), and a POST on it then fails unanswered.
    limits = httpx.Limits(max_connections=max(cfg.concurrency) * len(endpoints) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as http:
        clients = [Client(ep, http, cfg.request_timeout) for ep in endpoints]
        for c in clients:  # a dead URL fails here, before anything is timed
            await c.probe()
        log(f"{len(prompts)} prompts to {', '.join(f'{c.ep.name} ({c.kind})' for c in clients)} at concurrency "
            f"{cfg.concurrency}, {cfg.trials} trial(s) ...")
        sp = dict(max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=0, ignore_eos=cfg.ignore_eos)
        for c in clients:  # warm-up: outside the counters' window and the timings
            await c.complete([{"role": "user", "content": "Hello."}], min(cfg.max_tokens, 8), cfg.temperature, 0, False)
        levels, records = {}, []
        sent = sum(repeats(level, len(prompts), cfg.request_rate) for level in cfg.concurrency) * len(prompts)
        bar = tqdm(total=sent * cfg.trials * len(clients), desc="bench (endpoints)",
                   unit="request", disable=not progress)
        for level in cfg.concurrency:
            results = {c.ep.name: [] for c in clients}
            walls = {c.ep.name: [0.0] * cfg.trials for c in clients}
            before = {c.ep.name: await c.metrics() for c in clients}
            rounds = repeats(level, len(prompts), cfg.request_rate)
            for trial in range(cfg.trials):
                tagged = [(p.id, [{"role": "user", "content": tag(trial, rep) + p.turns[0]}])
                          for rep in range(rounds) for p in prompts]
                if level == 1 and not cfg.request_rate:  # interleaved per prompt, in balanced orders
                    for i, (pid, messages) in enumerate(tagged):
                        for c in interleaved_order(clients, trial * len(tagged) + i):
                            r = await c.complete(messages, **sp)
                            results[c.ep.name].append(r | {"prompt": pid, "trial": trial})
                            walls[c.ep.name][trial] += r["seconds"]
                            bar.update()
                else:  # each endpoint under `level` requests in flight, in a balanced order per trial
                    arrivals = poisson_arrivals(len(tagged), cfg.request_rate, seed=trial)
                    for c in interleaved_order(clients, trial):
                        gate, t0 = asyncio.Semaphore(level), time.perf_counter()

                        async def one(i, pid, messages, c=c, gate=gate, t0=t0):
                            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
                            async with gate:
                                r = await c.complete(messages, **sp)
                            bar.update()
                            return r | {"prompt": pid, "trial": trial}
                        results[c.ep.name] += await asyncio.gather(*(one(i, *t) for i, t in enumerate(tagged)))
                        walls[c.ep.name][trial] += time.perf_counter() - t0
            after = {c.ep.name: await c.metrics() for c in clients}
            levels[str(level)] = over_baseline({c.ep.name: summarize_level(results[c.ep.name], walls[c.ep.name],
                                                                          speculation_from_counters(before[c.ep.name],
                                                                                                    after[c.ep.name]))
                                                for c in clients})
            records += [{k: v for k, v in r.items() if k != "chunks"} | {"endpoint": name, "concurrency": level}
                        for name, rs in results.items() for r in rs]
        bar.close()
        # Per prompt only where each prompt's requests went to the endpoints one after another:
        # under load a request's speed is its trial's, so prompts are no longer independent units.
        interleaved = 1 in cfg.concurrency and not cfg.request_rate
        return {"arrivals": f"Poisson, {cfg.request_rate:g} requests/s" if cfg.request_rate else "closed loop",
                "endpoints": [{"name": c.ep.name, "url": c.ep.url, "model": c.ep.model, "kind": c.kind}
                              for c in clients],
                "levels": levels, "paired": paired(records, [c.ep.name for c in clients], 1,
                                                   {p.id: p.category for p in prompts}) if interleaved else {},
                "records": records,
                "prompts": [p.id for p in prompts]}


WAVES = 3  # a closed loop at c in flight sends at least WAVES * c requests a trial


def repeats(level: int, prompts: int, rate: float | None) -> int:
    """How many times a trial sends each prompt at `level` in flight. A closed loop starts all
    its requests at once and drains at the end, with fewer than `level` in flight; with as many
    requests as prompts at 16 in flight (26 prompts) that ramp and drain were most of the run,
    and a server whose rows finish apart (speculation) drained longer than one whose rows run in
    lock-step. So the prompts go round until the trial has WAVES * level requests, as vLLM's
    benchmark sends many more prompts than its concurrency. A Poisson trial is paced by its
    arrivals and sends each prompt once."""
    return 1 if rate or level == 1 else -(-WAVES * level // prompts)


def tag(trial: int, rep: int) -> str:
    """The text in front of a prompt that makes each trial's and each round's requests
    distinct, so that no prompt cache serves a repeat."""
    return "" if trial == rep == 0 else f"(request {trial}) " if rep == 0 else f"(request {trial}.{rep}) "


def poisson_arrivals(n: int, rate: float | None, seed: int) -> list[float]:
    """Seconds after the start at which each of n requests is sent: all at once without a rate,
    else a Poisson process (exponential gaps of mean 1/rate), the same for every endpoint."""
    if not rate:
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def throughput_ratio(mine: dict, base: dict) -> dict:
    """Two endpoints' entries at one level (summarize_level): mine's throughput over base's, over
    all trials and trial by trial (each endpoint's trial t ran beside the other's trial t). Their
    spread is the interval: a busy neighbour moves a whole trial, so two runs' ratios differ by
    more than a bootstrap over the prompts of one run would say. nan where base made nothing."""
    def ratio(x, y):
        return x / y if y else math.nan

    return {"throughput": ratio(mine["throughput_tokens_per_s"], base["throughput_tokens_per_s"]),
            "trials": [ratio(x, y) for x, y in zip(mine["trial_throughputs"], base["trial_throughputs"])]}


def over_baseline(level: dict[str, dict]) -> dict[str, dict]:
    """One level's entries (endpoint -> summarize_level), the first the baseline: each other gets
    `vs_baseline`, its throughput_ratio over the baseline."""
    (base, b), *others = level.items()
    for name, v in others:
        v["vs_baseline"] = {"baseline": base, **throughput_ratio(v, b)}
    return level


def paired(records: list[dict], names: list[str], level: int, categories: dict[str, str]) -> dict:
    """At `level` in flight, per prompt: the first endpoint's end-to-end time per token over
    each other's (median over trials), geometric mean with a bootstrap CI over prompts, overall
    and per category."""
    def per_prompt(name):
        by = {}
        for r in records:
            if r["endpoint"] == name and r["concurrency"] == level and r["error"] is None:
                by.setdefault(r["prompt"], []).append(r["seconds"] / r["tokens"])
        return {p: float(np.median(v)) for p, v in by.items()}
    base = per_prompt(names[0])
    out = {}
    for name in names[1:]:
        mine = per_prompt(name)
        ratios = {p: base[p] / mine[p] for p in base if p in mine}
        out[name] = {"baseline": names[0], "concurrency": level, "speedup": summarize_ratios(list(ratios.values())),
                     "categories": {cat: summarize_ratios([r for p, r in ratios.items() if categories[p] == cat])
                                    for cat in sorted(set(categories.values()))}}
    return out


def run_endpoints(cfg, prompts, progress=True, log=print) -> dict:
    return asyncio.run(_run([parse_endpoint(e) for e in cfg.endpoints], prompts, cfg, log, progress))
