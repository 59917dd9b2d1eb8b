"""Drafters: cheap proposers of the next few tokens.

A drafter sees the accepted sequence (prompt + generated so far, whose last token the
target has not run yet) and proposes up to k tokens, with the distribution q it drew
them from (None when it is deterministic: q is then one-hot on each proposal).

    drafter.begin(capacity)                 before a generation
    drafter.prefill(prompt_ids)             read the prompt (a draft model fills its cache)
    drafter.sources(ids)                    the proposers that could answer here, preferred first
                                            (none: the step is a plain decoding step)
    drafter.propose(ids, k, params, gen, source=None)  -> (tokens, q or None), at most k tokens
    drafter.commit(ids)                     the accepted sequence after verification
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .models.base import LanguageModel, as_language_model
from .sampling import SamplingParams, logits_to_probs, sample


class Drafter:
    """Base class: counts its forward passes and the time it spends."""

    vocab_size: int | None = None
    tokenizer = None
    max_context: int | None = None  # positions a draft model can hold (it limits only the draft); None: no limit

    def __init__(self):
        self.calls = 0
        self.seconds = 0.0

    def begin(self, capacity: int) -> None:
        self.calls, self.seconds = 0, 0.0

    def prefill(self, prompt_ids: list[int]) -> None:
        pass

    def sources(self, ids: list[int]) -> tuple[str, ...]:
        """The proposers that could answer at this context, preferred first ("model",
        "lookup3" for a 3-gram match, ...; none: nothing to propose). `num_draft_tokens="auto"`
        keeps statistics per source and may pick any of them; a fixed k takes the first."""
        return ("model",)

    def propose(self, ids: list[int], k: int, params: SamplingParams, generator, source: str | None = None):
        raise NotImplementedError

    def commit(self, ids: list[int]) -> None:
        pass


class NgramDrafter(Drafter):
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens
    (n from max_ngram down to min_ngram) and propose what followed it.

    Free to run and deterministic, so q is one-hot. It shines where the output copies
    from the input (summaries, retrieval QA, code edits) and proposes nothing elsewhere.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__()
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        # (the sequence last searched, its length, the match): the loop's sources() then
        # propose() on one step's sequence search it once. Holding the list keeps its id unique.
        self._last = None

    def begin(self, capacity: int) -> None:
        super().begin(capacity)
        self._last = None

    def _match(self, ids):
        if self._last is None or self._last[0] is not ids or self._last[1] != len(ids):
            start = time.perf_counter()
            self._last = ids, len(ids), find_match(np.asarray(ids), self.max_ngram, self.min_ngram)
            self.seconds += time.perf_counter() - start
        return self._last[2]

    def sources(self, ids):
        # A longer matched n-gram is a better bet: each length is a source of its own.
        match = self._match(ids)
        return (f"lookup{match[1]}",) if match else ()

    def propose(self, ids, k, params, generator, source=None):
        match = self._match(ids)
        return (ids[match[0]: match[0] + k] if match else []), None

    def __repr__(self) -> str:
        return f"NgramDrafter(max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"


def find_match(seq: np.ndarray, max_ngram: int, min_ngram: int) -> tuple[int, int] | None:
    """The latest earlier occurrence of the longest suffix n-gram: (where its continuation
    starts, n), or None."""
    L = len(seq)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        # Candidate starts i < L - n, so the match is not the suffix itself and has a continuation.
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == seq[L - n:]).all(axis=1))
        if hits.size:
            return int(hits[-1]) + n, n
    return None


class ModelDrafter(Drafter):
    """A small language model that shares the target's tokenizer.

    Its cache holds a prefix of the accepted sequence and never a rejected token: after
    verification `commit` rolls it back to the longest prefix it shares with the accepted
    sequence, and the next `propose` first runs whatever accepted tokens it has not seen
    (one token after a rejection; d_k and the bonus token, in one pass, after a full accept).

    Confidence stop: with `min_confidence` > 0 the draft stops proposing as soon as its top
    probability falls below it, so a block ends where the draft itself expects to be wrong
    instead of paying draft and verify time for tokens that will be rejected. The decision
    depends only on the draft's own distribution, so the acceptance rule stays exact.

    Its own context limits only the draft: proposing k tokens after n accepted ones runs
    positions up to n + k - 2, so past `max_context` it proposes fewer, then nothing (the
    loop takes plain steps), and a prompt longer than its context is never read.

    Head tokens: the draft scores only these tokens (q is 0 elsewhere, which the acceptance
    rule handles exactly like any other q). Its output head is most of a small draft's cost
    and most of its rows are tokens the target rarely writes. "auto" takes the list the
    checkpoint ships (`head_tokens.json`, written by `specdec distill`); None scores all.
    """

    def __init__(self, model, tokenizer=None, min_confidence: float = 0.0, head_tokens="auto"):
        super().__init__()
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence}")
        self.min_confidence = min_confidence
        # A cache of its own, so that the target can also serve as its own draft.
        self.model: LanguageModel = as_language_model(model, tokenizer).fork()
        if isinstance(head_tokens, str) and head_tokens == "auto":
            head_tokens = getattr(self.model, "head_tokens", None)
        if head_tokens is not None:
            if not hasattr(self.model, "restrict_head"):
                raise ValueError(f"head_tokens needs a native model; {self.model.name} runs through transformers")
            self.model.restrict_head(head_tokens)
        self.vocab_size, self.max_context = self.model.vocab_size, self.model.max_context
        self.tokenizer = self.model.tokenizer or tokenizer
        self._seen: list[int] = []  # tokens whose K/V are in the draft cache
        self._base = 0  # length of the accepted sequence at the last propose

    def begin(self, capacity: int) -> None:
        super().begin(capacity)
        self.model.reset(min(capacity, self.max_context))
        self._seen, self._base = [], 0

    def room(self, ids: list[int]) -> int:
        """How many tokens it can propose after `ids` within its context (<= 0: none)."""
        return self.max_context + 1 - len(ids)

    def sources(self, ids):
        return ("model",) if self.room(ids) > 0 else ()

    def _forward(self, tokens, last_only=False) -> torch.Tensor:
        self.calls += 1
        self._seen.extend(tokens)
        return self.model.forward(tokens, last_only=last_only)[-1]

    def prefill(self, prompt_ids):
        # Read the prompt once, up front, so that no proposal (and no cost estimate of
        # `num_draft_tokens="auto"`) carries it.
        if len(prompt_ids) > self.max_context:
            return  # it will never propose: sources() is empty from the start
        start = time.perf_counter()
        self._forward(prompt_ids, last_only=True)
        self.seconds += time.perf_counter() - start

    def propose(self, ids, k, params, generator, source=None):
        k = min(k, self.room(ids))
        if k <= 0:
            return [], None
        start = time.perf_counter()
        assert self._seen == ids[: len(self._seen)], "draft cache diverged from the accepted sequence"
        if len(self._seen) >= len(ids):  # all seen (asked twice, say): rerun the last token for its logits
            self.model.rollback(len(ids) - 1)
            del self._seen[len(ids) - 1:]
        self._base = len(ids)
        logits = self._forward(ids[len(self._seen):], last_only=True)
        tokens, qs = [], []
        for i in range(k):
            q = None if params.greedy else logits_to_probs(logits, params)
            if self.min_confidence and float((logits.softmax(-1) if q is None else q).max()) < self.min_confidence:
                break
            if params.greedy:
                tokens.append(int(logits.argmax()))
            else:
                tokens.append(sample(q, generator))
                qs.append(q)
            if i < k - 1:  # the last proposal is run later, only if it is accepted
                logits = self._forward(tokens[-1:])
        self.seconds += time.perf_counter() - start
        return tokens, (torch.stack(qs) if qs else None)

    def commit(self, ids):
        # Everything up to the last propose's sequence was accepted already; check the drafts.
        limit = min(len(self._seen), len(ids) - 1)
        keep = min(self._base, limit)
        while keep < limit and self._seen[keep] == ids[keep]:
            keep += 1
        self.model.rollback(keep)
        del self._seen[keep:]

    def __repr__(self) -> str:
        stop = f", min_confidence={self.min_confidence}" if self.min_confidence else ""
        head = getattr(self.model, "head", None)
        head = f", head_tokens={len(head[0])}" if head else ""
        return f"ModelDrafter({self.model!r}{stop}{head})"


class CompositeDrafter(Drafter):
    """Prompt lookup when the context has a match, else the model draft.

    A lookup costs microseconds and is right often where the output copies the input; the
    model covers the rest. With `num_draft_tokens="auto"` the schedule may also prefer the
    model where a match is a poor bet (a lone repeated token, say), from how each source
    has done so far. Either way the choice is made before anything is drawn, so each step's
    q is that of the drafter that proposed (one-hot for a lookup), as the acceptance rule needs.
    """

    def __init__(self, model_draft, lookup: NgramDrafter | None = None, tokenizer=None, min_confidence: float = 0.0):
        super().__init__()
        self.lookup = lookup or NgramDrafter()
        self.model = model_draft if isinstance(model_draft, ModelDrafter) else ModelDrafter(
            model_draft, tokenizer, min_confidence)
        self.vocab_size, self.tokenizer = self.model.vocab_size, self.model.tokenizer
        self.max_context = self.model.max_context

    def begin(self, capacity: int) -> None:
        super().begin(capacity)
        self.lookup.begin(capacity)
        self.model.begin(capacity)

    def prefill(self, prompt_ids):
        self.model.prefill(prompt_ids)
        self.calls, self.seconds = self.model.calls, self.model.seconds

    def sources(self, ids):
        # Past the model's context the lookup goes on alone.
        return self.lookup.sources(ids) + self.model.sources(ids)

    def propose(self, ids, k, params, generator, source=None):
        tokens, q = [], None
        if source != "model":
            tokens, q = self.lookup.propose(ids, k, params, generator)
        if not tokens:  # no match (or the schedule chose the model): the model drafts, if it has room
            tokens, q = self.model.propose(ids, k, params, generator)
        self.calls, self.seconds = self.model.calls, self.lookup.seconds + self.model.seconds
        return tokens, q

    def commit(self, ids):
        self.model.commit(ids)

    def __repr__(self) -> str:
        return f"CompositeDrafter({self.lookup!r}, {self.model!r})"


def as_drafter(draft, tokenizer=None) -> Drafter:
    if isinstance(draft, Drafter):
        return draft
    return ModelDrafter(draft, tokenizer)
