"""One call's requests: the checks every loop makes before any compute, the rows of a call
(prompt ids, outputs, stop reasons, noise, stats), streaming, and what a call returns."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .models.base import LanguageModel, Rows
from .sampling import MIN_TEMPERATURE, Noise, SamplingParams, choose, logprobs


@dataclass
class Stats:
    """What a generation cost, and how well the drafter did.

    target_calls: target forward passes, the prefill included.
    draft_calls: draft-model forward passes (0 for a model-free drafter such as n-gram).
    drafted: tokens proposed by the drafter, summed over steps.
    accepted: proposed tokens the target accepted (bonus and correction tokens excluded).
    rejections: steps in which a proposed token was rejected (accepted / (accepted +
        rejections) estimates the per-token acceptance probability alpha of Leviathan et al.).
    plain_steps: verification passes with nothing drafted, so plain decoding steps: the
        drafter had no proposal (no n-gram match, or a draft model past its own context),
        or `num_draft_tokens="auto"` chose k = 0.
    accepted_per_position[i]: among steps that proposed at least i+1 tokens, the fraction
        in which drafts 1..i+1 were all accepted. (With a fixed proposal length it can only
        fall with i; a drafter that proposes fewer tokens on some steps can break that.)
    generated: new tokens returned.
    timings: seconds spent in the target prefill, in the drafter, and in target
        verification / decode passes ("prefill", "draft", "verify").
    drafter: the drafter's own counts; a draft with another tokenizer (specdec.bridge)
        reports "bridge_steps" (steps it proposed in) and "boundary_misses" (those whose
        first rejected token read like the target's own text, cut at another place).
    """

    target_calls: int = 0
    draft_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0
    plain_steps: int = 0
    generated: int = 0
    proposed_at: list[int] = field(default_factory=list)  # steps that proposed >= i+1 tokens
    accepted_at: list[int] = field(default_factory=list)  # steps that accepted >= i+1 tokens
    timings: dict = field(default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "verify": 0.0})
    drafter: dict = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (nan when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def accepted_per_position(self) -> list[float]:
        accepted = self.accepted_at + [0] * (len(self.proposed_at) - len(self.accepted_at))
        return [a / p for a, p in zip(accepted, self.proposed_at)]

    @property
    def tokens_per_target_call(self) -> float:
        """New tokens per target forward pass, prefill included: exactly 1.0 for plain decoding
        that runs to its limit; k+1 at most per verification pass (accepted drafts + 1)."""
        return self.generated / self.target_calls if self.target_calls else math.nan

    def record_step(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += accepted < drafted
        self.plain_steps += drafted == 0
        for store, n in ((self.proposed_at, drafted), (self.accepted_at, accepted)):
            store.extend([0] * (n - len(store)))
            for i in range(n):
                store[i] += 1


@dataclass
class Generation:
    """token_ids: new tokens only, ending with the EOS token when finish_reason == "eos".
    text: their decoding with special tokens skipped (None without a tokenizer).
    finish_reason: "eos" or "length".
    logprobs: with logprobs=n, one (logprob, [(id, logprob), ...n most likely]) per token, under
    the target before temperature, top-k and top-p; else None."""

    token_ids: list[int]
    text: str | None
    finish_reason: str
    stats: Stats
    prompt_ids: list[int]
    logprobs: list | None = None


class Timer:
    """Adds wall time to stats.timings[key]; synchronizes CUDA so async kernels are counted."""

    def __init__(self, stats: "Stats | list[Stats]", device: torch.device):
        self.stats = stats if isinstance(stats, list) else [stats]  # a batch's pass counts for each row
        self.cuda = device.type == "cuda"
        self.elapsed: dict[str, float] = {}  # seconds under each key through this timer

    def __call__(self, key: str):
        self.key = key
        return self

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self.t0
        self.elapsed[self.key] = self.elapsed.get(self.key, 0.0) + elapsed
        for stats in self.stats:
            stats.timings[self.key] += elapsed


# ----------------------------------------------------------------------------- input checks


def check_sampling(temperature, top_k, top_p) -> SamplingParams:
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not math.isfinite(temperature):
        raise TypeError(f"temperature must be a finite number, got {temperature!r}")
    if temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    return SamplingParams(float(temperature), top_k, None if top_p is None else float(top_p))


def check_max_tokens(max_tokens) -> int:
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise TypeError(f"max_tokens must be an integer, got {type(max_tokens).__name__}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    return max_tokens


def encode_prompt(prompt, tokenizer, model: LanguageModel, chat: bool) -> list[int]:
    """Token ids of the prompt: a string (optionally wrapped in the chat template) or ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        if tokenizer is None:
            raise ValueError("a string prompt needs a tokenizer (or pass token ids)")
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("chat=True but the tokenizer has no chat template")
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                 tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, (Sequence, torch.Tensor)):
        if chat:
            raise ValueError("chat=True needs a string prompt, not token ids")
        ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise TypeError("prompt token ids must be integers")
    else:
        raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    bad = [t for t in ids if not 0 <= t < model.vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {model.vocab_size})")
    return ids


def check_context(limit: int | None, who: str, n_prompt: int, max_tokens: int) -> None:
    # Drafts are capped so that no pass of either model runs past prompt + max_tokens positions.
    if limit is not None and n_prompt + max_tokens > limit:
        raise ValueError(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds "
                         f"{who}'s context of {limit} tokens")


def check_logprobs(logprobs) -> None:
    if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs < 0):
        raise ValueError(f"logprobs must be None or how many alternatives to list (an integer >= 0), got {logprobs!r}")


def check_seed(seed) -> None:
    if seed is None:
        return
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an integer, got {type(seed).__name__}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")


def _finish(tokens: list[int], new: list[int], eos: tuple[int, ...], max_tokens: int) -> str | None:
    """Append `new` to `tokens`, cutting at the first EOS or at max_tokens; the reason, if it ended."""
    for t in new:
        tokens.append(t)
        if t in eos:
            return "eos"
        if len(tokens) >= max_tokens:
            return "length"
    return None


def _decode(tokenizer, ids) -> str | None:
    return None if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)


def check_request(model, tokenizer, prompt, max_tokens, temperature=0.0, top_k=None, top_p=None, seed=None,
                  chat=False, context: int | None = None, logprobs: int | None = None) -> "Request":
    """Every check a request gets, before any compute; the request, ready to run. context: the
    positions it may use (default: the model's context)."""
    params = check_sampling(temperature, top_k, top_p)
    check_max_tokens(max_tokens)
    check_seed(seed)
    check_logprobs(logprobs)
    prompt_ids = encode_prompt(prompt, tokenizer, model, chat)
    check_context(model.max_context if context is None else context, model.name, len(prompt_ids), max_tokens)
    return Request(prompt_ids, max_tokens, params, Noise(seed, model.device), model.eos_token_ids, logprobs)


class Request:
    """One prompt's generation: its ids, limits, sampling and noise (sampling.Noise), what it
    generated so far, why it stopped (None: it goes on) and its stats. logprobs: None, or how
    many of the most likely alternatives to keep beside each output token's log-probability
    (in `self.logprobs_out`, one (logprob, [(id, logprob), ...]) a token)."""

    def __init__(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams, noise: Noise,
                 eos: tuple[int, ...], logprobs: int | None = None):
        self.prompt_ids, self.max_tokens, self.params, self.noise, self.eos = prompt_ids, max_tokens, params, noise, eos
        self.out: list[int] = []
        self.logprobs, self.logprobs_out = logprobs, []
        self.reason: str | None = None if max_tokens else "length"
        self.stats = Stats()

    def sequence(self) -> list[int]:
        """The accepted sequence: the prompt and what it generated so far."""
        return self.prompt_ids + self.out

    def room(self) -> int:
        """Drafts it could still keep: a step always adds one target token after them."""
        return self.max_tokens - len(self.out) - 1

    def add(self, new: list[int], scores: torch.Tensor | None = None) -> list[int]:
        """A pass yielded `new`: keep it up to an EOS or max_tokens; the ids kept. scores: the
        logits [>= len(new), V] that chose them, row for row (for a request that keeps logprobs)."""
        self.stats.target_calls += 1
        before = len(self.out)
        self.reason = _finish(self.out, new, self.eos, self.max_tokens)
        kept = self.out[before:]
        if self.logprobs is not None and kept:
            self.logprobs_out += logprobs(scores, kept, self.logprobs)
        return kept

    def accept(self, drafted: list[int], n_accepted: int, token: int, totals: Stats | None = None,
               scores: torch.Tensor | None = None) -> list[int]:
        """A verify step kept drafted[:n_accepted] and the target's token; the ids kept. The
        step's drafts are counted in the stats (and in totals, if given); scores as in `add`."""
        new = self.add(drafted[:n_accepted] + [token], scores)
        # An EOS among the accepted drafts ends the block: the drafts after it were neither
        # accepted nor rejected, just discarded, so they are not counted at all.
        kept = min(n_accepted, len(new))
        for stats in filter(None, (self.stats, totals)):
            stats.record_step(kept if kept < n_accepted else len(drafted), kept)
        return new

    def result(self, tokenizer) -> Generation:
        self.stats.generated = len(self.out)
        return Generation(self.out, _decode(tokenizer, self.out), self.reason, self.stats, self.prompt_ids,
                          None if self.logprobs is None else self.logprobs_out)


def as_batch(prompt) -> tuple[list, bool]:
    """(prompts, is_batch): a list of strings or of token-id lists is a batch; one string or one
    flat id list (or a 1-D tensor) is a single prompt."""
    if isinstance(prompt, (list, tuple)) and prompt and all(
            isinstance(p, str) or (isinstance(p, (Sequence, torch.Tensor)) and not isinstance(p, (int, bool)))
            for p in prompt):
        return list(prompt), True
    if isinstance(prompt, (list, tuple)) and not prompt:
        raise ValueError("prompt is empty")
    return [prompt], False


def row_seeds(seed, batch: int) -> list:
    """Per-row seeds: a list gives each row its own; an int s gives row i the seed s + i (so a
    batch's row i samples as a single run with seed s + i would); None leaves each row unseeded."""
    if isinstance(seed, (list, tuple)):
        if len(seed) != batch:
            raise ValueError(f"{len(seed)} seeds for {batch} prompts")
        for s in seed:
            check_seed(s)
        return list(seed)
    check_seed(seed)
    if seed is not None and seed + batch - 1 >= 2**63:
        raise ValueError(f"seed must leave room for {batch} rows below 2**63, got {seed}")
    return [None if seed is None else seed + i for i in range(batch)]


class Run:
    """One call's requests (one per row), checked before any compute, and the target's cache as
    that many sequences."""

    def __init__(self, model: LanguageModel, tokenizer, prompt, max_tokens, temperature, top_k, top_p, seed, chat,
                 stream, logprobs=None):
        prompts, self.batched = as_batch(prompt)
        seeds = row_seeds(seed, len(prompts))
        self.rows = Rows(model, len(prompts))
        self.requests = [check_request(model, tokenizer, p, max_tokens, temperature, top_k, top_p, s, chat,
                                       logprobs=logprobs) for p, s in zip(prompts, seeds)]
        self.params = self.requests[0].params
        self.prompt_ids = [r.prompt_ids for r in self.requests]
        self.noises = [r.noise for r in self.requests]
        self.size = len(prompts)
        self.model, self.tokenizer, self.max_tokens, self.stream = model, tokenizer, max_tokens, stream

    def live(self) -> list[int]:
        return [b for b, r in enumerate(self.requests) if r.reason is None]

    def timer(self, rows) -> Timer:
        return Timer([self.requests[b].stats for b in rows], self.model.device)

    def prefill(self) -> tuple[list[int], list[torch.Tensor]]:
        """Empty the cache and run every prompt; each row's first new token, and the logits [1, V]
        that chose it."""
        self.capacity = max(len(ids) for ids in self.prompt_ids) + self.max_tokens
        self.rows.reset(self.capacity)
        with self.timer(range(self.size))("prefill"):
            logits = self.rows.forward(self.prompt_ids, last_only=True)
            return ([choose(x[-1], self.params, noise, len(ids))
                     for x, noise, ids in zip(logits, self.noises, self.prompt_ids)], [x[-1:] for x in logits])

    def sequence(self, b: int) -> list[int]:
        return self.requests[b].sequence()

    def add(self, b: int, new: list[int], scores: torch.Tensor | None = None) -> list[int]:
        return self.requests[b].add(new, scores)

    def emit(self, b: int, ids: list[int]) -> None:
        if self.stream:
            self.stream(*((b, ids) if self.batched else (ids,)))

    def results(self, drafter=None) -> Generation | list[Generation]:
        gens = []
        for b, r in enumerate(self.requests):
            if drafter is not None:
                r.stats.draft_calls, r.stats.drafter = drafter.calls, drafter.counters(b)
            gens.append(r.result(self.tokenizer))
        return gens if self.batched else gens[0]
