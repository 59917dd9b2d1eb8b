"""Drafters: cheap proposers of the next few tokens.

A drafter sees the accepted sequence (prompt + generated so far, whose last token the
target has not run yet) and proposes up to k tokens; between a row's prefills its sequence
only grows. A sampled model draft draws each with
the row's noise at that token's position (sampling.Noise), as the target will. It drafts
for B rows at once (a batch; B = 1 for one prompt), each with its own state:

    drafter.begin(capacity, batch=1)        before a generation
    drafter.prefill(prompts, rows=None)     rows start over with these prompts (default rows 0..B-1; a draft
                                            model reads one when first asked to propose; a server reuses rows)
    drafter.sources(ids, row=0)             the proposers that could answer here, preferred first
                                            (none: the step is a plain decoding step)
    drafter.propose(ids, k, params, noise, source=None, row=0)  -> at most k tokens
    drafter.propose_rows({row: (ids, k, source)}, params, noises) -> {row: tokens}: several
                                            rows in one go (a model draft runs them in shared passes)
    drafter.commit(ids, row=0)              the row's accepted sequence after verification
"""
from __future__ import annotations

import copy
import time

import numpy as np
import torch

from .datastore import Datastore
from .models.base import LanguageModel, Rows
from .models.hf import as_language_model
from .sampling import SamplingParams, choose


class Drafter:
    """Base class: counts its forward passes and the time it spends. A subclass implements
    `propose` (one row at a time) or `propose_rows` (all rows together); each defaults to the other."""

    vocab_size: int | None = None
    tokenizer = None
    max_context: int | None = None  # positions a draft model can hold (it limits only the draft); None: no limit
    batches = True  # can draft for a batch of rows (a model draft needs an engine that batches)

    def __init__(self):
        self.calls = 0
        self.seconds = 0.0
        self.setup_seconds = 0.0  # the part of `seconds` spent on one-off work (reading a prompt), not on drafting

    def begin(self, capacity: int, batch: int = 1) -> None:
        self.calls, self.seconds, self.setup_seconds = 0, 0.0, 0.0

    def prefill(self, prompts: list[list[int]], rows: list[int] | None = None) -> None:
        pass

    def check_prompts(self, prompts: list[list[int]]) -> None:
        """Refuse prompts this drafter cannot work with, before any compute (a ValueError)."""

    def counters(self, row: int = 0) -> dict:
        """Counts of its own for a row's generation, reported in `Stats.drafter` (none here)."""
        return {}

    def sources(self, ids: list[int], row: int = 0) -> tuple[str, ...]:
        """The proposers that could answer at this context, preferred first ("model",
        "lookup3" for a 3-gram match, ...; none: nothing to propose). `num_draft_tokens="auto"`
        keeps statistics per source and may pick any of them; a fixed k takes the first."""
        return ("model",)

    def propose(self, ids: list[int], k: int, params: SamplingParams, noise, source: str | None = None,
                row: int = 0) -> list[int]:
        return self.propose_rows({row: (ids, k, source)}, params, {row: noise}).get(row, [])

    def propose_rows(self, requests: dict, params: SamplingParams, noises) -> dict:
        """requests[row] = (ids, k, source); noises[row]: that row's sampling.Noise."""
        return {row: self.propose(ids, k, params, noises[row], source, row)
                for row, (ids, k, source) in requests.items()}

    def commit(self, ids: list[int], row: int = 0) -> None:
        pass


class NoDrafter(Drafter):
    """Never proposes: every step is a plain decoding step (a server run without drafts)."""

    def sources(self, ids, row=0):
        return ()


class _Lookup(Drafter):
    """A model-free drafter that searches the context. The loop calls sources() then propose()
    on one step's sequence: each row keeps (the sequence last searched, its length, what the
    search found), so that the two search it once. Holding the list keeps its id unique."""

    def __init__(self):
        super().__init__()
        self._last: dict[int, tuple] = {}

    def begin(self, capacity: int, batch: int = 1) -> None:
        super().begin(capacity, batch)
        self._last = {}

    def _search(self, ids, row=0):
        raise NotImplementedError

    def _match(self, ids, row):
        last = self._last.get(row)
        if last is None or last[0] is not ids or last[1] != len(ids):
            start = time.perf_counter()
            last = self._last[row] = ids, len(ids), self._search(ids, row)
            self.seconds += time.perf_counter() - start
        return last[2]


class NgramDrafter(_Lookup):
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens
    (n from max_ngram down to min_ngram) and propose what followed it.

    Free to run and deterministic. It shines where the output copies
    from the input (summaries, retrieval QA, code edits) and proposes nothing elsewhere.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__()
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._arrays: dict[int, tuple[np.ndarray, int]] = {}

    def begin(self, capacity: int, batch: int = 1) -> None:
        super().begin(capacity, batch)
        self._arrays = {}

    def prefill(self, prompts, rows=None):
        for row in range(len(prompts)) if rows is None else rows:
            self._arrays.pop(row, None)

    def _search(self, ids, row=0):
        return find_match(self._array(ids, row), self.max_ngram, self.min_ngram)

    def _array(self, ids, row) -> np.ndarray:
        """ids as an array, from a buffer per row that only appends what is new: a row's
        accepted sequence only grows (on 2 cores, converting a 400-token list took 19 us of a
        25 us search)."""
        buf, n = self._arrays.get(row, (None, 0))
        if buf is None or n > len(ids) or any(buf[i] != ids[i] for i in {0, n // 2, n - 1} if n):
            buf, n = np.empty(max(2 * len(ids), 256), dtype=np.int64), 0
        if len(ids) > len(buf):
            buf = np.concatenate([buf[:n], np.empty(len(ids), dtype=np.int64)])
        buf[n:len(ids)] = ids[n:]
        self._arrays[row] = (buf, len(ids))
        return buf[:len(ids)]

    def sources(self, ids, row=0):
        # A longer matched n-gram is a better bet: each length is a source of its own.
        match = self._match(ids, row)
        return (f"lookup{match[1]}",) if match else ()

    def propose(self, ids, k, params, noise, source=None, row=0):
        match = self._match(ids, row)
        return ids[match[0]: match[0] + k] if match else []

    def __repr__(self) -> str:
        return f"NgramDrafter(max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"


def find_match(seq: np.ndarray, max_ngram: int, min_ngram: int) -> tuple[int, int] | None:
    """The latest earlier occurrence of the longest suffix n-gram: (where its continuation
    starts, n), or None.

    One pass over the sequence finds where its last token occurred before (a match of any
    length ends there); only those few places are extended backwards, so a step costs about
    one comparison a token instead of one n-wide window a token for each n."""
    L = len(seq)
    ends = np.flatnonzero(seq[:-1] == seq[-1])  # j < L - 1: a match ending at j has a continuation
    if not ends.size:
        return None
    n = np.ones(ends.size, dtype=np.int64)  # how many tokens match, ending at each j
    live = np.ones(ends.size, dtype=bool)
    for d in range(1, min(max_ngram, L - 1)):
        live &= (ends >= d) & (seq[np.maximum(ends - d, 0)] == seq[L - 1 - d])
        n += live
    for want in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        hits = np.flatnonzero(n >= want)
        if hits.size:
            return int(ends[hits[-1]]) + 1, want
    return None


class DatastoreDrafter(_Lookup):
    """Proposes the store's continuation of the context's longest stored suffix.

    Each suffix length is a source of its own ("store2" .. "store8"), as prompt lookup's
    match lengths are: a longer match is a better bet, and `num_draft_tokens="auto"` learns
    by how much."""

    def __init__(self, store):
        super().__init__()
        self.store = store if isinstance(store, Datastore) else Datastore.load(store)
        self.vocab_size = self.store.vocab_size

    def _search(self, ids, row=0):
        return self.store.match(ids)

    def sources(self, ids, row=0):
        found = self._match(ids, row)
        return (f"store{found[0]}",) if found else ()

    def propose(self, ids, k, params, noise, source=None, row=0):
        found = self._match(ids, row)
        start = time.perf_counter()
        tokens = self.store.continuation(found, k) if found else []
        self.seconds += time.perf_counter() - start
        return tokens

    def __repr__(self) -> str:
        return f"DatastoreDrafter({self.store.name}, {len(self.store):,} tokens)"


class ModelDrafter(Drafter):
    """A small language model that shares the target's tokenizer.

    Its cache holds a prefix of the accepted sequence and never a rejected token: after
    verification `commit` rolls it back to the longest prefix it shares with the accepted
    sequence, and the next `propose` first runs whatever accepted tokens it has not seen
    (one token after a rejection; d_k and the bonus token, in one pass, after a full accept).

    Its own context limits only the draft: proposing k tokens after n accepted ones runs
    positions up to n + k - 2, so past `max_context` it proposes fewer, then nothing (the
    loop takes plain steps), and a prompt longer than its context is never read.

    Head tokens: the draft scores only these tokens and so never proposes another (the
    target still chooses among all of them). Its output head is most of a small draft's cost
    and most of its rows are tokens the target rarely writes. "auto" takes the list the
    checkpoint ships (`head_tokens.json`, written by `specdec distill`); None scores all.
    """

    def __init__(self, model, tokenizer=None, head_tokens="auto"):
        super().__init__()
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
        self.batches = self.model.batches
        self._rows = Rows(self.model, 1, "the draft")
        self.capacity = self.max_context
        self._seen: list[list[int]] = [[]]  # per row: tokens whose K/V are in the draft cache
        self._base = [0]  # per row: length of the accepted sequence at its last propose
        self._unread: set[int] = set()  # rows whose prompt it has not read yet

    def begin(self, capacity: int, batch: int = 1) -> None:
        super().begin(capacity, batch)
        self._rows = Rows(self.model, batch, "the draft")
        self.capacity = min(capacity, self.max_context)
        self._rows.reset(self.capacity)
        self._seen, self._base, self._unread = [[] for _ in range(batch)], [0] * batch, set()

    def room(self, ids: list[int]) -> int:
        """How many tokens it can propose after `ids` within its context and cache (<= 0: none)."""
        return self.room_after(len(ids))

    def room_after(self, n: int) -> int:
        return min(self.max_context, self.capacity) + 1 - n

    def sources(self, ids, row=0):
        return ("model",) if self.room(ids) > 0 else ()

    def _forward(self, blocks: dict[int, list[int]], last_only=False) -> dict[int, torch.Tensor]:
        """One pass over blocks[row] for the rows given (the others sit it out); last logits per row."""
        self.calls += 1
        for row, tokens in blocks.items():
            self._seen[row].extend(tokens)
        logits = self._rows.forward([blocks.get(b, []) for b in range(len(self._seen))], last_only=last_only)
        return {row: logits[row][-1] for row in blocks}

    def prefill(self, prompts, rows=None):
        # Lazily: a row's prompt is read when the row is first asked to propose, so that a
        # composite whose lookup carries a whole answer never runs its model at all. That
        # read is timed apart (setup_seconds), so that no cost estimate of
        # `num_draft_tokens="auto"` carries it. A prompt past its context is never read:
        # sources() is empty for that row from the start.
        rows = list(range(len(prompts))) if rows is None else rows
        lengths = self._rows.lengths
        for row in rows:
            lengths[row], self._seen[row], self._base[row] = 0, [], 0
        self._rows.rollback(lengths)
        self._unread |= set(rows)

    def _read_prompts(self, requests, rows):
        """Run each fresh row's accepted sequence but its last token (that one the proposal runs)."""
        blocks = {row: requests[row][0][:-1] for row in rows if len(requests[row][0]) > 1}
        self._unread -= set(rows)
        if blocks:
            start = time.perf_counter()
            self._forward(blocks, last_only=True)
            elapsed = time.perf_counter() - start
            self.seconds += elapsed
            self.setup_seconds += elapsed

    def propose_rows(self, requests, params, noises, first: dict | None = None):
        """first[row] (optional): the token ids the row's first proposal must be one of."""
        out = {row: [] for row in requests}
        ks = {row: min(k, self.room(ids)) for row, (ids, k, _) in requests.items()}
        ks = {row: k for row, k in ks.items() if k > 0}
        if not ks:
            return out
        if fresh := [row for row in ks if row in self._unread]:
            self._read_prompts(requests, fresh)
        start = time.perf_counter()
        lengths = self._rows.lengths
        for row in ks:
            ids, seen = requests[row][0], self._seen[row]
            assert seen == ids[: len(seen)], "draft cache diverged from the accepted sequence"
            if len(seen) >= len(ids):  # all seen (asked twice, say): rerun the last token for its logits
                lengths[row] = len(ids) - 1
                del seen[len(ids) - 1:]
            self._base[row] = len(ids)
        self._rows.rollback(lengths)
        logits = self._forward({row: requests[row][0][len(self._seen[row]):] for row in ks}, last_only=True)
        tokens = {row: [] for row in ks}
        for i in range(max(ks.values())):
            going = {}
            for row, x in logits.items():
                if i == 0 and first and row in first:
                    x = torch.full_like(x, -torch.inf).index_copy_(-1, first[row], x[first[row]])
                # The draw with the noise the target will draw with at that position.
                tokens[row].append(choose(x, params, noises[row], len(requests[row][0]) + i))
                if i < ks[row] - 1:  # the last proposal is run later, only if it is accepted
                    going[row] = tokens[row][-1:]
            if not going:
                break
            logits = self._forward(going)
        self.seconds += time.perf_counter() - start
        out.update(tokens)
        return out

    def commit(self, ids, row=0):
        # Everything up to the last propose's sequence was accepted already; check the drafts.
        self.keep_prefix(ids, row, self._base[row])

    def keep_prefix(self, ids, row=0, start=0):
        """Roll row's cache back to the longest prefix it shares with `ids`, short of ids' last
        token (the next propose runs that one for its logits); `start`: a length known shared."""
        seen = self._seen[row]
        limit = min(len(seen), len(ids) - 1)
        keep = min(start, limit)
        while keep < limit and seen[keep] == ids[keep]:
            keep += 1
        lengths = self._rows.lengths
        lengths[row] = keep
        self._rows.rollback(lengths)
        del seen[keep:]

    def __repr__(self) -> str:
        head = getattr(self.model, "head", None)
        head = f", head_tokens={len(head[0])}" if head else ""
        return f"ModelDrafter({self.model!r}{head})"


class CompositeDrafter(Drafter):
    """Prompt lookup when the context has a match, else a datastore's continuation (if it
    has one), else the model draft; a model draft or a datastore, or both, beside the lookup.

    A lookup or a datastore costs microseconds and is right often where the output copies
    the input (the lookup) or repeats the target's usual phrases (the datastore); the model
    covers the rest. With `num_draft_tokens="auto"` the schedule may also prefer a later
    source where an earlier one is a poor bet (a lone repeated token, say), from how each
    has done so far. Whatever proposed, the target keeps only drafts equal to its own choices.
    It sees its parts through the drafter protocol only, so any part may be replaced by a
    drafter that keeps it (`with_parts`: a model draft behind a TextBridge, say).
    """

    def __init__(self, model_draft=None, lookup: NgramDrafter | None = None, tokenizer=None, datastore=None):
        super().__init__()
        if model_draft is None and datastore is None:
            raise ValueError("a composite drafter needs a model draft or a datastore beside its lookup")
        store = (None if datastore is None else
                 datastore if isinstance(datastore, DatastoreDrafter) else DatastoreDrafter(datastore))
        model = (None if model_draft is None else model_draft if isinstance(model_draft, Drafter) else
                 ModelDrafter(model_draft, tokenizer))
        self.tokenizer = tokenizer
        self._join(lookup or NgramDrafter(), store, model)

    def _join(self, lookup: Drafter, store: Drafter | None, model: Drafter | None) -> None:
        self.lookup, self.store, self.model = lookup, store, model
        self.parts = [d for d in (lookup, store, model) if d is not None]  # preferred first
        if model is None:
            self.vocab_size, self.max_context, self.batches = store.vocab_size, None, True
        else:
            self.vocab_size, self.tokenizer = model.vocab_size, model.tokenizer
            self.max_context, self.batches = model.max_context, model.batches
            if store and store.vocab_size != self.vocab_size:
                raise ValueError(f"the datastore's vocabulary ({store.vocab_size}) is not the draft's "
                                 f"({self.vocab_size})")

    def with_parts(self, parts: list[Drafter]) -> "CompositeDrafter":
        """A composite of `parts` in place of its own, in the same order (this one stays as it is)."""
        twin = copy.copy(self)
        twin._join(*(parts[self.parts.index(d)] if d is not None else None
                     for d in (self.lookup, self.store, self.model)))
        return twin

    def begin(self, capacity: int, batch: int = 1) -> None:
        super().begin(capacity, batch)
        for part in self.parts:
            part.begin(capacity, batch)

    def prefill(self, prompts, rows=None):
        for part in self.parts:
            part.prefill(prompts, rows)

    def check_prompts(self, prompts):
        if self.model:
            self.model.check_prompts(prompts)

    def counters(self, row=0):
        return self.model.counters(row) if self.model else {}

    def sources(self, ids, row=0):
        # Past the model's context the lookup and the datastore go on alone.
        return sum((part.sources(ids, row) for part in self.parts), ())

    def _owner(self, source: str) -> Drafter:
        if source == "model":
            return self.model
        return self.store if source.startswith("store") else self.lookup

    def propose_rows(self, requests, params, noises):
        out, to_model = {}, {}
        for row, (ids, k, source) in requests.items():
            owner = self._owner(source or next(iter(self.sources(ids, row)), "model"))
            if owner is not self.model and (tokens := owner.propose(ids, k, params, noises[row], row=row)):
                out[row] = tokens
            elif self.model:  # nothing there (or the schedule chose the model): the model drafts, if it has room
                to_model[row] = ids, k, "model"
        if to_model:
            out.update(self.model.propose_rows(to_model, params, noises))
        self.calls = self.model.calls if self.model else 0
        self.seconds = sum(part.seconds for part in self.parts)
        self.setup_seconds = self.model.setup_seconds if self.model else 0.0
        return out

    def commit(self, ids, row=0):
        if self.model:
            self.model.commit(ids, row)

    def __repr__(self) -> str:
        return f"CompositeDrafter({', '.join(map(repr, self.parts))})"


def as_drafter(draft, tokenizer=None) -> Drafter:
    if isinstance(draft, Drafter):
        return draft
    return ModelDrafter(draft, tokenizer)


def default_drafter(target: LanguageModel) -> Drafter:
    """What `specdec generate` drafts with for `target` when told nothing: prompt lookup, beside
    the datastore of the target's own writing where one ships for it (the default target's), else
    beside its shipped draft model, else alone."""
    from .datastore import load_datastore
    from .models.loading import load_model
    from .models.registry import DEFAULT_DRAFTS, SHIPPED_DATASTORES

    if target.name in SHIPPED_DATASTORES:
        return CompositeDrafter(datastore=load_datastore(target.name))
    if target.name in DEFAULT_DRAFTS:
        return CompositeDrafter(load_model(DEFAULT_DRAFTS[target.name], dtype=target.dtype, device=target.device))
    return NgramDrafter()
