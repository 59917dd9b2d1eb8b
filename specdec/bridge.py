"""Drafts with another tokenizer: a draft model that works in its own token space, on the text.

The target's accepted ids are decoded to text; the draft's context is that text encoded by
the draft's own tokenizer; what the draft writes is decoded, and the new text is encoded
by the target's tokenizer into the proposal the target verifies as usual.

The invariant, per row: the draft's context is the draft-encoding of the accepted text
*minus its last draft token*, and that last token's text is "pending". The accepted text
can end anywhere inside a draft token (the target's tokens cut the text elsewhere), and a
token at the very end of an encoding is the one most likely to merge with what follows
(" th" before "e"): leaving it in would put a split into the draft's context that its
tokenizer would never make there. So the draft's first token is chosen among the tokens
whose text starts with the pending text (token healing: the held-back token itself is one
of them, so there always is one), and only the text past the pending text is a proposal.
After each step the draft's cache is rolled back to the longest prefix its ids share with
the re-encoded context, and the rest is run.

What the bridge loses at token boundaries is counted: a step whose first rejected token
had the same text as the target's own continuation, cut differently (" the" proposed where
the target wrote " th" + "e"), was lost to the tokenizers, not to the draft.

Exactness does not rest on any of this: the target keeps drafts only where they equal its
own choice at their position (sampling.verify), whatever proposed them. The draft drafts
greedily, so under sampling its proposal is accepted with probability p(x), as prompt
lookup's is.
"""
from __future__ import annotations

import bisect

import torch

from .drafters import CompositeDrafter, Drafter, ModelDrafter
from .sampling import SamplingParams

GREEDY = SamplingParams(0.0)
# Draft tokens per target token of the same text, at most (for sizing the draft's cache and
# bounding its context without encoding; past that bound the draft just stops proposing).
DRAFT_PER_TARGET = 4


def token_texts(tokenizer) -> tuple[list[str], list[int]]:
    """Every token's text (as it reads after another token: a SentencePiece "▁x" is " x"),
    sorted, with the ids in the same order; computed once per tokenizer object."""
    cached = getattr(tokenizer, "_specdec_token_texts", None)
    if cached is None:
        anchor = tokenizer("a", add_special_tokens=False)["input_ids"][-1:]
        head = tokenizer.decode(anchor)
        texts = tokenizer.batch_decode([anchor + [i] for i in range(len(tokenizer))])
        pairs = sorted((t[len(head):], i) for i, t in enumerate(texts) if t.startswith(head))
        cached = tokenizer._specdec_token_texts = ([t for t, _ in pairs], [i for _, i in pairs])
    return cached


def tokens_starting_with(tokenizer, text: str) -> list[int]:
    """The ids of the tokens whose text starts with `text`."""
    texts, ids = token_texts(tokenizer)
    lo = bisect.bisect_left(texts, text)
    hi = lo
    while hi < len(texts) and texts[hi].startswith(text):
        hi += 1
    return ids[lo:hi]


class TextBridge(Drafter):
    """A model draft (`ModelDrafter`) whose tokenizer differs from the target's."""

    def __init__(self, draft: ModelDrafter, target_tokenizer, target_vocab_size: int):
        super().__init__()
        # (A draft without a tokenizer of its own falls back to the caller's: the target's.)
        if draft.tokenizer is None or target_tokenizer is None or draft.tokenizer is target_tokenizer:
            raise ValueError("the draft's vocabulary differs from the target's, and bridging them through text "
                             "needs both tokenizers")
        self.inner, self.draft_tok, self.tokenizer = draft, draft.tokenizer, target_tokenizer
        self.vocab_size, self.batches = target_vocab_size, draft.batches
        self._memo: dict[int, tuple] = {}
        self._proposed: dict[int, tuple] = {}  # row -> (where its last proposal starts, the proposal)
        # Per row: steps with a proposal, and those of them whose rejection was a token-boundary cut.
        self.steps: dict[int, int] = {}
        self.boundary_misses: dict[int, int] = {}

    def begin(self, capacity: int, batch: int = 1) -> None:
        super().begin(capacity, batch)
        self._memo, self._proposed = {}, {}
        self.steps, self.boundary_misses = {}, {}
        self.inner.begin(DRAFT_PER_TARGET * capacity + 8, batch)  # its context counts its own tokens

    def text(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def check_prompts(self, prompts) -> None:
        """Refuse text the draft's tokenizer cannot give back as it was (before any compute)."""
        for ids in prompts:
            text = self.text(ids)
            back = self.draft_tok.decode(self._encode(text), skip_special_tokens=True)
            if back != text:
                i = next((j for j, (a, b) in enumerate(zip(text, back)) if a != b), min(len(text), len(back)))
                raise ValueError(f"the draft's tokenizer cannot round-trip the prompt's text: at character {i}, "
                                 f"{text[max(0, i - 12): i + 12]!r} comes back as {back[max(0, i - 12): i + 12]!r}")

    def _encode(self, text: str) -> list[int]:
        return self.draft_tok(text)["input_ids"]  # with the draft's own BOS, where it uses one

    def _context(self, ids, row):
        """(draft context ids, pending text) for the accepted target ids of a row, memoized per step."""
        memo = self._memo.get(row)
        if memo is not None and memo[0] is ids and memo[1] == len(ids):
            return memo[2]
        text = self.text(ids)
        enc = self.draft_tok(text, return_offsets_mapping=True)
        ctx, offsets = enc["input_ids"], enc["offset_mapping"]
        cut = next((i for i in range(len(ctx) - 1, -1, -1) if offsets[i][1] > offsets[i][0]), None)
        if cut is None or text.endswith("\ufffd"):  # nothing to hold back, or a character cut in two
            out = (ctx, None)
        else:
            out = (ctx[:cut], text[offsets[cut][0]:])
        self._memo[row] = (ids, len(ids), out)
        return out

    def prefill(self, prompts, rows=None):
        rows = list(range(len(prompts))) if rows is None else rows
        for row in rows:
            for per_row in (self._memo, self._proposed, self.steps, self.boundary_misses):
                per_row.pop(row, None)
        self.inner.prefill([self._context(ids, b)[0] for b, ids in zip(rows, prompts)], rows)

    def sources(self, ids, row=0):
        # Without encoding the text (a step that `auto` makes a plain one should not pay for
        # it): the draft context's length is at most the last one plus a few draft tokens per
        # target token since. propose() then encodes, and proposes nothing where it must not.
        memo = self._memo.get(row)
        if memo is None:
            ctx_len = len(self._context(ids, row)[0])
        else:
            ctx_len = len(memo[2][0]) + DRAFT_PER_TARGET * (len(ids) - memo[1])
        return ("model",) if self.inner.room_after(ctx_len) > 1 else ()

    def propose_rows(self, requests, params, noises):
        asks, pendings, first = {}, {}, {}
        for row, (ids, k, _) in requests.items():
            ctx, pending = self._context(ids, row)
            healing = tokens_starting_with(self.draft_tok, pending) if pending is not None else []
            if not ctx or not healing:
                continue
            self.inner.keep_prefix(ctx, row)
            asks[row], pendings[row] = (ctx, k + 1, "model"), pending
            first[row] = torch.tensor(healing, device=self.inner.model.device)
        drafts = self.inner.propose_rows(asks, GREEDY, noises, first) if asks else {}
        out = {row: [] for row in requests}
        for row, tokens in drafts.items():
            ctx, pending = asks[row][0], pendings[row]
            anchor = ctx[-1:]  # decoding from the token before keeps the first one's leading space
            head = self.draft_tok.decode(anchor, skip_special_tokens=True)
            written = self.draft_tok.decode(anchor + tokens, skip_special_tokens=True)[len(head):]
            proposal = self.tokenizer(written[len(pending):], add_special_tokens=False)["input_ids"][: requests[row][1]]
            if written.startswith(pending) and proposal:
                out[row] = proposal
                self._proposed[row] = (len(requests[row][0]), proposal)
        self.calls, self.seconds, self.setup_seconds = self.inner.calls, self.inner.seconds, self.inner.setup_seconds
        return out

    def commit(self, ids, row=0):
        # Was a rejection lost at a token boundary? The first rejected token and what the
        # target wrote there read alike up to the shorter of the two.
        base, proposal = self._proposed.pop(row, (None, None))
        if proposal is None:
            return
        self.steps[row] = self.steps.get(row, 0) + 1
        got = ids[base: base + len(proposal)]
        j = next((i for i, (a, b) in enumerate(zip(proposal, got)) if a != b), None)
        if j is not None:
            mine, theirs = self.text(proposal[j:]), self.text(ids[base + j:])
            cut = bool(mine) and bool(theirs) and (mine.startswith(theirs) or theirs.startswith(mine))
            self.boundary_misses[row] = self.boundary_misses.get(row, 0) + cut

    def counters(self, row=0) -> dict:
        return {"bridge_steps": self.steps.get(row, 0), "boundary_misses": self.boundary_misses.get(row, 0)}

    def __repr__(self) -> str:
        return f"TextBridge({self.inner!r})"


def vocab_fingerprint(tokenizer) -> int:
    # get_vocab() builds a 49k-entry dict (~30 ms): do it once per tokenizer object, not per call.
    fingerprint = getattr(tokenizer, "_specdec_vocab_fingerprint", None)
    if fingerprint is None:
        fingerprint = hash(frozenset(tokenizer.get_vocab().items()))
        tokenizer._specdec_vocab_fingerprint = fingerprint
    return fingerprint


def needs_bridge(target, drafter: Drafter, tokenizer) -> bool:
    t_tok, d_tok = target.tokenizer or tokenizer, drafter.tokenizer
    if drafter.vocab_size is not None and drafter.vocab_size != target.vocab_size:
        return True
    return (t_tok is not None and d_tok is not None and t_tok is not d_tok
            and vocab_fingerprint(t_tok) != vocab_fingerprint(d_tok))


def for_target(drafter: Drafter, target, tokenizer) -> Drafter:
    """The drafter as it drafts for `target`, decided once, before any compute: as it is where
    it shares the target's vocabulary; a model draft with another tokenizer through a TextBridge
    (also as a composite's part); anything else with another vocabulary refused (ValueError)."""
    if isinstance(drafter, CompositeDrafter):
        parts = [for_target(part, target, tokenizer) for part in drafter.parts]
        return drafter if parts == drafter.parts else drafter.with_parts(parts)
    if not needs_bridge(target, drafter, tokenizer):
        return drafter
    if isinstance(drafter, ModelDrafter):
        return TextBridge(drafter, target.tokenizer or tokenizer, target.vocab_size)
    raise ValueError(f"the draft ({drafter!r}) has another vocabulary ({drafter.vocab_size}) than the target's "
                     f"({target.vocab_size}); only a model draft can be bridged through text")
