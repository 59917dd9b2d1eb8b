"""Drafters: cheap proposers of the next few tokens.

A drafter sees the accepted sequence (prompt + generated so far, whose last token the
target has not run yet) and proposes up to k tokens. A sampled model draft draws each with
the row's noise at that token's position (sampling.Noise), as the target will. It drafts
for B rows at once (a batch; B = 1 for one prompt), each with its own state:

    drafter.begin(capacity, batch=1)        before a generation
    drafter.prefill(prompts)                the rows' prompts (a draft model reads one when first asked to propose)
    drafter.sources(ids, row=0)             the proposers that could answer here, preferred first
                                            (none: the step is a plain decoding step)
    drafter.propose(ids, k, params, noise, source=None, row=0)  -> (tokens, None), at most k
    drafter.propose_rows({row: (ids, k, source)}, params, noises) -> {row: (tokens, None)}: several
                                            rows in one go (a model draft runs them in shared passes)
    drafter.commit(ids, row=0)              the row's accepted sequence after verification

A drafter with `side_rows` (a [E, hidden] tensor; None for most) also reads the target's own
passes: each pass scores those rows on the target's last hidden state beside its logits, and
the loop hands each row's outputs over before anything is proposed from them:

    drafter.observe(row, first, logits, side)  the pass's rows at positions first.. of that row

A model-free drafter with `tree_size` > 0 also proposes trees, which engines that verify
trees (the native one) check in one pass, for one prompt at a time:

    drafter.propose_tree(ids, k, source=None, row=0, size=0, depth=None) -> (tokens, parents, n):
                                            the chain of n `propose` would give, then other
                                            continuations hung on it, up to `size` nodes
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .datastore import Datastore
from .models.base import LanguageModel, Rows, as_language_model
from .sampling import SamplingParams, choose, warp


class Drafter:
    """Base class: counts its forward passes and the time it spends. A subclass implements
    `propose` (one row at a time) or `propose_rows` (all rows together); each defaults to the other."""

    vocab_size: int | None = None
    tokenizer = None
    max_context: int | None = None  # positions a draft model can hold (it limits only the draft); None: no limit
    batches = True  # can draft for a batch of rows (a model draft needs an engine that batches)
    tree_size = 0  # drafted nodes a tree may hold; 0: chains only
    side_rows = None  # rows the target's passes score for it (see observe)

    def __init__(self):
        self.calls = 0
        self.seconds = 0.0
        self.setup_seconds = 0.0  # the part of `seconds` spent on one-off work (reading a prompt), not on drafting

    def begin(self, capacity: int, batch: int = 1) -> None:
        self.calls, self.seconds, self.setup_seconds = 0, 0.0, 0.0

    def prefill(self, prompts: list[list[int]]) -> None:
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
                row: int = 0):
        return self.propose_rows({row: (ids, k, source)}, params, {row: noise}).get(row, ([], None))

    def propose_rows(self, requests: dict, params: SamplingParams, noises) -> dict:
        """requests[row] = (ids, k, source); noises[row]: that row's sampling.Noise."""
        return {row: self.propose(ids, k, params, noises[row], source, row)
                for row, (ids, k, source) in requests.items()}

    def commit(self, ids: list[int], row: int = 0) -> None:
        pass

    def observe(self, row: int, first: int, logits: torch.Tensor, side: torch.Tensor) -> None:
        """A target pass's logits and side outputs for `row`, at positions first, first + 1, ..."""

    def propose_tree(self, ids: list[int], k: int, source: str | None = None, row: int = 0, size: int = 0,
                     depth: int | None = None):
        """Deterministic drafts as a tree of at most max(k, size) nodes, none deeper than
        max(k, depth): tokens, each one's parent (an earlier node, or -1 for the context), and
        how many lead as the chain of k `propose` gives (nodes 0..n-1, each the child of the
        one before). Here that chain alone."""
        tokens, _ = self.propose(ids, k, SamplingParams(0.0), None, source, row)
        return tokens, list(range(-1, len(tokens) - 1)), len(tokens)


def check_tree_size(tree_size) -> int:
    if not isinstance(tree_size, int) or isinstance(tree_size, bool) or tree_size < 0:
        raise ValueError(f"tree_size must be an integer >= 0, got {tree_size!r}")
    return tree_size


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

    def _search(self, ids):
        raise NotImplementedError

    def _match(self, ids, row):
        last = self._last.get(row)
        if last is None or last[0] is not ids or last[1] != len(ids):
            start = time.perf_counter()
            last = self._last[row] = ids, len(ids), self._search(ids)
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

    def _search(self, ids):
        return find_match(np.asarray(ids), self.max_ngram, self.min_ngram)

    def sources(self, ids, row=0):
        # A longer matched n-gram is a better bet: each length is a source of its own.
        match = self._match(ids, row)
        return (f"lookup{match[1]}",) if match else ()

    def propose(self, ids, k, params, noise, source=None, row=0):
        match = self._match(ids, row)
        return (ids[match[0]: match[0] + k] if match else []), None

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

    def __init__(self, store, tree_size: int = 0):
        super().__init__()
        self.store = store if isinstance(store, Datastore) else Datastore.load(store)
        self.vocab_size = self.store.vocab_size
        self.tree_size = check_tree_size(tree_size)

    def _search(self, ids):
        return self.store.match(ids)

    def sources(self, ids, row=0):
        found = self._match(ids, row)
        return (f"store{found[0]}",) if found else ()

    def propose(self, ids, k, params, noise, source=None, row=0):
        found = self._match(ids, row)
        start = time.perf_counter()
        tokens = self.store.continuation(found, k) if found else []
        self.seconds += time.perf_counter() - start
        return tokens, None

    def propose_tree(self, ids, k, source=None, row=0, size=0, depth=None):
        return self.widen(ids, *super().propose_tree(ids, k, source, row), size, depth, row)

    def widen(self, ids, tokens, parents, chain, size, depth=None, row=0):
        """The store's other continuations of the context hung on a tree, to `size` nodes."""
        found = self._match(ids, row)
        if not found or len(tokens) >= size:
            return tokens, parents, chain
        start = time.perf_counter()
        tokens, parents = self.store.tree(found, tokens, parents, size, depth)
        self.seconds += time.perf_counter() - start
        return tokens, parents, chain

    def __repr__(self) -> str:
        tree = f", tree_size={self.tree_size}" if self.tree_size else ""
        return f"DatastoreDrafter({self.store.name}, {len(self.store):,} tokens{tree})"


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

    Head tokens: the draft scores only these tokens and so never proposes another (the
    target still chooses among all of them). Its output head is most of a small draft's cost
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

    def prefill(self, prompts):
        # Lazily: a row's prompt is read when the row is first asked to propose, so that a
        # composite whose lookup carries a whole answer never runs its model at all. That
        # read is timed apart (setup_seconds), so that no cost estimate of
        # `num_draft_tokens="auto"` carries it. A prompt past its context is never read:
        # sources() is empty for that row from the start.
        self._unread = set(range(len(prompts)))

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
        out = {row: ([], None) for row in requests}
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
                if self.min_confidence:
                    p = (x.float() if params.greedy else warp(x, params)).softmax(-1)
                    if float(p.max()) < self.min_confidence:
                        continue  # this row's block ends here
                # The draw with the noise the target will draw with at that position.
                tokens[row].append(choose(x, params, noises[row], len(requests[row][0]) + i))
                if i < ks[row] - 1:  # the last proposal is run later, only if it is accepted
                    going[row] = tokens[row][-1:]
            if not going:
                break
            logits = self._forward(going)
        self.seconds += time.perf_counter() - start
        for row in ks:
            out[row] = tokens[row], None
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
        stop = f", min_confidence={self.min_confidence}" if self.min_confidence else ""
        head = getattr(self.model, "head", None)
        head = f", head_tokens={len(head[0])}" if head else ""
        return f"ModelDrafter({self.model!r}{stop}{head})"


class CompositeDrafter(Drafter):
    """Prompt lookup when the context has a match, else a datastore's continuation (if it
    has one), else the model draft; a model draft or a datastore, or both, beside the lookup.

    A lookup or a datastore costs microseconds and is right often where the output copies
    the input (the lookup) or repeats the target's usual phrases (the datastore); the model
    covers the rest. With `num_draft_tokens="auto"` the schedule may also prefer a later
    source where an earlier one is a poor bet (a lone repeated token, say), from how each
    has done so far. Whatever proposed, the target keeps only drafts equal to its own choices.

    With a hidden-state head (`specdec.head`; beside a datastore, without a model draft) the
    target's own passes choose too: where the store proposes, its candidate next token the head
    scores best leads the chain; where neither lookup nor the store has anything, the head's
    own best token does ("head", a source of its own). Lookup's copies it leaves as they are.
    """

    def __init__(self, model_draft=None, lookup: NgramDrafter | None = None, tokenizer=None,
                 min_confidence: float = 0.0, datastore=None, tree_size: int = 0, head=None):
        super().__init__()
        if model_draft is None and datastore is None:
            raise ValueError("a composite drafter needs a model draft or a datastore beside its lookup")
        if check_tree_size(tree_size) and (model_draft is not None or datastore is None):
            raise ValueError("trees grow from a datastore, without a model draft (whose drafts are sampled)")
        if head is not None and (datastore is None or model_draft is not None or tree_size):
            raise ValueError("a hidden-state head chooses among the lookups' chains: it needs a datastore, and "
                             "neither a model draft nor trees")
        self.lookup = lookup or NgramDrafter()
        self.store = (None if datastore is None else
                      datastore if isinstance(datastore, DatastoreDrafter) else DatastoreDrafter(datastore))
        if tree_size:
            self.store.tree_size = self.tree_size = tree_size
        self.model = (None if model_draft is None else model_draft if isinstance(model_draft, ModelDrafter) else
                      ModelDrafter(model_draft, tokenizer, min_confidence))
        if self.model is None:
            self.vocab_size, self.tokenizer = self.store.vocab_size, tokenizer
        else:
            self.vocab_size, self.tokenizer = self.model.vocab_size, self.model.tokenizer
            self.max_context, self.batches = self.model.max_context, self.model.batches
            if self.store and self.store.vocab_size != self.vocab_size:
                raise ValueError(f"the datastore's vocabulary ({self.store.vocab_size}) is not the draft's "
                                 f"({self.vocab_size})")
        self.parts = [d for d in (self.lookup, self.store, self.model) if d is not None]  # preferred first
        if head is not None and head.target.vocab_size != self.vocab_size:
            raise ValueError(f"the head's target vocabulary ({head.target.vocab_size}) is not the datastore's "
                             f"({self.vocab_size})")
        self.head, self.side_rows = head, None if head is None else head.side
        self._passes: dict[int, tuple] = {}  # per row: the target's last pass (first position, logits, side)
        self._head_seconds = 0.0
        self._led: dict[int, int] = {}  # per row: chains the head led with a token of its choosing

    def begin(self, capacity: int, batch: int = 1) -> None:
        super().begin(capacity, batch)
        self._head_seconds, self._led = 0.0, {}  # (the prompts' passes, observed before this, stay)
        for part in self.parts:
            part.begin(capacity, batch)

    def prefill(self, prompts):
        if self.model:
            self.model.prefill(prompts)

    def check_prompts(self, prompts):
        if self.model:
            self.model.check_prompts(prompts)

    def counters(self, row=0):
        if self.head is not None:
            return {"head_led": self._led.get(row, 0)}
        return self.model.counters(row) if self.model else {}

    def sources(self, ids, row=0):
        # Past the model's context the lookup and the datastore go on alone; where neither has
        # a match, a head proposes its own token.
        found = sum((part.sources(ids, row) for part in self.parts), ())
        return found or (("head",) if self.head is not None and self._seen(ids, row) is not None else ())

    def observe(self, row, first, logits, side):
        # numpy views (on a GPU, copies): a row of them costs nanoseconds to index, torch's microseconds
        self._passes[row] = first, logits.cpu().numpy(), side.cpu().numpy()

    def _seen(self, ids, row):
        """The target's logits and side outputs at the row that chose ids' last token, if its
        last pass held that position."""
        if (got := self._passes.get(row)) is None:
            return None
        first, logits, side = got
        i = len(ids) - 2 - first
        return (logits[i], side[i]) if 0 <= i < logits.shape[0] else None

    def _owner(self, source: str) -> Drafter:
        if source == "model":
            return self.model
        return self.store if source.startswith("store") else self.lookup

    def _led_by(self, ids, first: int, k: int) -> list[int]:
        """`first`, then what the lookups would draft after it (the prompt's, else the store's)."""
        after = ids + [first]
        if match := self.lookup._search(after):
            return [first] + after[match[0]: match[0] + k - 1]
        found = self.store._search(after)
        return [first] + (self.store.store.continuation(found, k - 1) if found else [])

    def _head_choice(self, ids, row, k, source, chain):
        """The chain the head leads: its own best token's where it is the source; where the
        store is, the chain of the store's candidate next token it scores best (unchanged if
        that is the store's own choice). Lookup's copies it leaves alone: choosing over them
        broke long copies (docs/benchmark.md, "the target's hidden state as a judge")."""
        seen = self._seen(ids, row)
        if seen is None or not (source == "head" or (chain and source.startswith("store"))):
            return chain
        logits, side = seen
        z = self.head.z(side, ids[-1])
        if source == "head":
            first = self.head.best(logits, z)
        else:
            store = self.store.store
            nxt = store.tokens[store.voters(self.store._match(ids, row))]
            cands = np.unique(np.append(nxt[nxt != store.gap], chain[0]))
            first = int(cands[int(self.head.scores(logits, z, cands).argmax())]) if len(cands) > 1 else chain[0]
            if first == chain[0]:
                return chain
        self._led[row] = self._led.get(row, 0) + 1
        return self._led_by(ids, first, k)

    def propose_rows(self, requests, params, noises):
        out, to_model = {}, {}
        for row, (ids, k, source) in requests.items():
            source = source or next(iter(self.sources(ids, row)), "model")
            if self.head is not None:  # (no model draft beside it)
                chain = [] if source == "head" else self._owner(source).propose(ids, k, params, None, row=row)[0]
                start = time.perf_counter()
                if chain := self._head_choice(ids, row, k, source, chain):
                    out[row] = chain, None
                self._head_seconds += time.perf_counter() - start
                continue
            owner = self._owner(source)
            if owner is not self.model:
                tokens, _ = owner.propose(ids, k, params, noises[row], row=row)
                if tokens:
                    out[row] = tokens, None
                    continue
            if self.model:  # nothing there (or the schedule chose the model): the model drafts, if it has room
                to_model[row] = ids, k, "model"
        if to_model:
            out.update(self.model.propose_rows(to_model, params, noises))
        self.calls = self.model.calls if self.model else 0
        self.seconds = self._head_seconds + sum(part.seconds for part in self.parts)
        self.setup_seconds = self.model.setup_seconds if self.model else 0.0
        return out

    def commit(self, ids, row=0):
        if self.model:
            self.model.commit(ids, row)

    def propose_tree(self, ids, k, source=None, row=0, size=0, depth=None):
        tree = self.store.widen(ids, *super().propose_tree(ids, k, source, row), size, depth, row)
        self.seconds = sum(part.seconds for part in self.parts)
        return tree

    def __repr__(self) -> str:
        return f"CompositeDrafter({', '.join(map(repr, [*self.parts, *([self.head] if self.head else [])]))})"


def as_drafter(draft, tokenizer=None) -> Drafter:
    if isinstance(draft, Drafter):
        return draft
    return ModelDrafter(draft, tokenizer)
