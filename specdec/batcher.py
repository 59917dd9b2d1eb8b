"""Continuous batching: requests join and leave one running batch between steps.

The target's cache holds `max_batch` sequences (slots), allocated once. A request waits in a
bounded queue until a slot is free; its prompt is then read in chunks: up to PREFILL_CHUNK tokens
a step while no row decodes, and while rows decode, as many as take about as long as their
decode pass (from the prompt rate measured, at least PREFILL_MIN), so that a newcomer delays
them by about a pass a step, not by a long prefill; from then on every step drafts for
each running row and verifies all of them in one pass, as `speculative_generate` does for a
static batch. A row that ends (EOS, max_tokens, cancelled) frees its slot at once: rolling
its length back to 0 is all it takes.

Each row keeps its own sampling, seed and noise, so on the bf16 kernel, whose rows are each
exactly a one-token pass, every row's output is its solo `generate` output whatever else
shares the batch and whatever was drafted (sampling.py).

One engine thread runs the steps (`run`); `submit` and `cancel` may be called from any thread,
and a job's `emit` is called on the engine thread (the server hands it over to its event loop).
"""
from __future__ import annotations

import collections
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from .bridge import for_target
from .decoding import auto_k_max, speculative_step
from .drafters import Drafter, NoDrafter
from .models.base import Rows
from .request import Request, Stats, Timer
from .sampling import choose, logprobs
from .schedule import AdaptiveK, FixedCosts, LoadGate, as_schedule

PREFILL_CHUNK = 512  # the most prompt tokens read in one step, over all newcomers (a multiple of kernel.MAX_ROWS)
PREFILL_MIN = 64  # the fewest while rows decode: a prompt moves on at any load (fewer cost more a token on a CPU)


class QueueFull(Exception):
    """The queue holds as many requests as it may: refuse, do not wait."""


class Closed(Exception):
    """The batcher is shutting down and takes no new requests."""


@dataclass(eq=False)
class Job:
    """A request in the batcher. emit(new ids, finish reason or None) is called on the engine
    thread: with the first token once the prompt is read, after each step, and with the reason
    ("eos", "length", "error", or the one it was cancelled for: "cancelled", "stop") when it ends."""

    request: Request
    emit: Callable[[list[int], str | None], None]
    speculative: bool = True
    cancelled: str | None = None  # why it was cancelled: it ends at the next step boundary
    read: int = 0  # prompt tokens in the cache
    prompt_logprobs: list | None = None  # [] to have each prompt token after the first scored (sampling.logprobs)
    started: float = field(default_factory=time.perf_counter)

    @property
    def prompt_read(self) -> bool:
        """Its whole prompt is in the cache: the row decodes."""
        return self.read == len(self.request.prompt_ids)


@dataclass
class Counters:
    """Totals since start, as /metrics shows them (vLLM's spec_decode names)."""

    speculation: Stats = field(default_factory=Stats)  # every row's drafts (proposed_at[0]: steps that drafted)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: collections.Counter = field(default_factory=collections.Counter)  # by finish reason


class Batcher:
    """The target (a native model: it batches), its drafter (None: plain decoding) and schedule,
    `max_batch` slots of `context` positions each, and a queue of at most `queue_size` requests
    waiting for a slot."""

    def __init__(self, model, drafter: Drafter | None, *, max_batch: int = 16, context: int | None = None,
                 queue_size: int = 64, num_draft_tokens="auto", prefill_chunk: int = PREFILL_CHUNK):
        if not model.batches:
            raise ValueError(f"{model.name} on {type(model).__name__} runs one sequence at a time; serving needs an "
                             "engine that batches (the native engine)")
        for name, value in (("max_batch", max_batch), ("queue_size", queue_size), ("prefill_chunk", prefill_chunk)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.model = model.fork()  # a cache of its own: the model stays free for other calls (generate, say)
        self.max_batch, self.queue_size, self.prefill_chunk = max_batch, queue_size, prefill_chunk
        self.context = min(context or model.max_context, model.max_context)
        self.speculating = drafter is not None
        self.drafter = NoDrafter() if drafter is None else for_target(drafter, model, model.tokenizer)
        if not self.drafter.batches:
            raise ValueError(f"the draft ({self.drafter!r}) runs one prompt at a time; serving needs a draft that "
                             "batches")
        self.schedule = as_schedule(num_draft_tokens, auto_k_max(model, max_batch), model.pass_tile)
        # As in speculative_generate: where rows are not invariant, clocks must not choose the blocks.
        self.fixed = None if model.row_invariant else FixedCosts(*model.block_cost)
        # Whether to draft at all at this load, from whole steps timed (again clocks: the kernel only).
        self.gate = LoadGate() if self.fixed is None and isinstance(self.schedule, AdaptiveK) else None
        self.rows = Rows(self.model, max_batch)
        self.rows.reset(self.context)
        self.drafter.begin(self.context, max_batch)
        self.slots: list[Job | None] = [None] * max_batch
        self.waiting: collections.deque[Job] = collections.deque()
        self.counters = Counters()
        self.closing = False
        self.seconds_per_prompt_token: float | None = None  # measured, decayed
        self.decode_seconds: float | None = None  # the last decode pass
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ any thread

    def submit(self, *jobs: Job) -> None:
        """Queue checked requests (request.check_request), all or none; QueueFull or Closed if they
        cannot wait."""
        with self._wake:
            if self.closing:
                raise Closed("the server is shutting down")
            free = self.slots.count(None)  # rows the engine fills at its next step
            if len(self.waiting) + len(jobs) - free > self.queue_size:
                raise QueueFull(f"{max(len(self.waiting) - free, 0)} requests are waiting for a row already "
                                f"(--queue-size {self.queue_size})")
            self.waiting.extend(jobs)
            self._wake.notify()

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """The job ends at the next step boundary (its slot is freed then), finished for `reason`
        unless it ended meanwhile: "cancelled" (a client gone), or "stop" (a stop string seen)."""
        job.cancelled = job.cancelled or reason
        with self._wake:
            self._wake.notify()

    @property
    def running(self) -> int:
        return sum(job is not None for job in self.slots)

    def start(self) -> None:
        """Run the steps on a thread of their own (`run` runs them on the calling thread)."""
        self._thread = threading.Thread(target=self.run, name="specdec-batcher", daemon=True)
        self._thread.start()

    def close(self, cancel: bool = False) -> None:
        """Take no new request; `run` returns once what is in flight has finished (or, with
        cancel, has been cancelled)."""
        with self._wake:
            self.closing = True
            if cancel:
                for job in [*self.waiting, *filter(None, self.slots)]:
                    job.cancelled = job.cancelled or "cancelled"
            self._wake.notify()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Close, and wait for the thread `start` started; what still runs after `timeout`
        seconds is cancelled."""
        self.close(cancel=not drain)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self.close(cancel=True)
                self._thread.join()

    # ------------------------------------------------------------------ the engine thread

    def run(self) -> None:
        """Run steps while there is work, until closed. Best on the thread that loaded the model:
        the OpenMP runtimes keep a team of threads per calling thread, and a second team on
        2 cores makes them all stop spinning between passes (on the AMX VM a token took 19.5 ms
        on a second thread, 11.3 on the loading one)."""
        while True:
            with self._wake:
                while not self.waiting and not any(self.slots) and not self.closing:
                    self._wake.wait()
                if self.closing and not self.waiting and not any(self.slots):
                    return
            try:
                self.step()
            except Exception:  # noqa: BLE001 -- a bug must not leave requests hanging: end them, go on
                traceback.print_exc()
                for b, job in enumerate(self.slots):
                    if job is not None:
                        self._end(b, "error")

    def step(self) -> None:
        """One step: admit newcomers, read a chunk of prompts, then draft and verify every running row."""
        self._admit()
        self._read_prompts(self._prompt_budget())
        live = [b for b, job in enumerate(self.slots) if job is not None and job.prompt_read]
        if live:
            self._decode(live)

    def _admit(self) -> None:
        with self._wake:
            for job in [j for j in self.waiting if j.cancelled]:
                self.waiting.remove(job)
                self._finish(job, job.cancelled)
            while self.waiting and None in self.slots:
                b = self.slots.index(None)
                self.slots[b] = job = self.waiting.popleft()
                self.drafter.prefill([job.request.prompt_ids], [b])
        for b, job in enumerate(self.slots):
            if job is not None and job.cancelled:
                self._end(b, job.cancelled)

    def _prompt_budget(self) -> int:
        """Prompt tokens this step reads: prefill_chunk while no row decodes; otherwise about as
        many as take as long as the last decode pass, at least PREFILL_MIN. Where rows are not
        invariant (self.fixed), blocks must not depend on clocks: prefill_chunk always."""
        decoding = any(job is not None and job.prompt_read for job in self.slots)
        if self.fixed is not None or not decoding or self.seconds_per_prompt_token is None \
                or self.decode_seconds is None:
            return self.prefill_chunk
        fits = int(self.decode_seconds / self.seconds_per_prompt_token)
        return max(min(fits, self.prefill_chunk), min(PREFILL_MIN, self.prefill_chunk))

    def _read_prompts(self, budget: int) -> None:
        """Up to `budget` prompt tokens, oldest request first; a row whose prompt is read
        chooses its first token from the last position, as generate's prefill does."""
        blocks = [[] for _ in self.slots]
        for b in sorted((b for b, j in enumerate(self.slots) if j and not j.prompt_read),
                        key=lambda b: self.slots[b].started):
            job = self.slots[b]
            blocks[b] = job.request.prompt_ids[job.read: job.read + budget]
            budget -= len(blocks[b])
            if not budget:
                break
        rows = [b for b, block in enumerate(blocks) if block]
        if not rows:
            return
        scored = [b for b in rows if self.slots[b].prompt_logprobs is not None]  # their prompt's logprobs
        timer = Timer([self.slots[b].request.stats for b in rows], self.model.device)
        with timer("prefill"):
            logits = self.rows.forward(blocks, last_only=not scored)
        rate = timer.elapsed["prefill"] / sum(map(len, blocks))
        old = self.seconds_per_prompt_token
        self.seconds_per_prompt_token = rate if old is None else 0.5 * old + 0.5 * rate
        for b in rows:
            job = self.slots[b]
            if b in scored:  # row j scores the prompt token after it
                after = job.request.prompt_ids[job.read + 1: job.read + len(blocks[b]) + 1]
                job.prompt_logprobs += logprobs(logits[b], after, job.request.logprobs or 0)
            job.read += len(blocks[b])
            self.counters.prompt_tokens += len(blocks[b])
            r = job.request
            if job.prompt_read:
                new = r.add([choose(logits[b][-1], r.params, r.noise, len(r.prompt_ids))], logits[b][-1:])
                self._emit(b, new)

    def _decode(self, live: list[int]) -> None:
        """speculative_generate's step over the running rows, with drafts for the rows that asked
        for them, where the gate finds drafting pays at this load."""
        start, requests = time.perf_counter(), {b: self.slots[b].request for b in live}
        asking = {b for b in live if self.speculating and self.slots[b].speculative}
        drafting = asking if asking and (self.gate is None or self.gate.drafting(len(live))) else set()
        new = speculative_step(self.rows, self.drafter, self.schedule, self.fixed, requests, drafting,
                               self.counters.speculation)
        self.decode_seconds = time.perf_counter() - start
        if self.gate is not None and asking:
            self.gate.update(len(live), bool(drafting), sum(map(len, new.values())), self.decode_seconds)
        for b in live:
            self._emit(b, new[b])

    def _emit(self, b: int, new: list[int]) -> None:
        job = self.slots[b]
        self.counters.generation_tokens += len(new)
        if new:
            job.emit(new, None)
        if job.request.reason is not None:
            self._end(b, job.request.reason)

    def _end(self, b: int, reason: str) -> None:
        """Free slot b (its cache rows are reused from length 0) and tell its job why it ended."""
        job, self.slots[b] = self.slots[b], None
        lengths = self.rows.lengths
        lengths[b] = 0
        self.rows.rollback(lengths)
        self._finish(job, reason)

    def _finish(self, job: Job, reason: str) -> None:
        if job.request.reason is None or reason in ("cancelled", "error"):
            job.request.reason = reason
        self.counters.finished[job.request.reason] += 1
        job.emit([], job.request.reason)
