"""Retrieval drafting: what the target wrote before, looked up by the context's last tokens.

Prompt lookup proposes what followed the context's last n-gram in the prompt, so it pays
only where the output copies the input. A datastore (REST, He et al. 2024) holds text the
target wrote on other prompts, and proposes the continuation most occurrences of the same
suffix share there: the phrases a model writes again and again ("Here are some tips",
"In conclusion, the") whatever the prompt. Looking it up is a binary search, so it drafts
for free, like prompt lookup.

The index is a suffix order: every position of the token array, sorted by the MAX_NGRAM
tokens that start there, packed `64 // bits` to a 64-bit word. The positions whose tokens
start with a given n-gram are then one contiguous range, found by `searchsorted` a word at
a time. `specdec distill` writes one from the target's own replies
(`datastore/datastore.safetensors` in its run folder), `specdec datastore` from several
runs, and one ships for the default target; `specdec.drafters.DatastoreDrafter` drafts
from it.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from .models.registry import SHIPPED_DATASTORES

MAX_NGRAM = 8  # longest suffix looked up: longer ones are rare in a store of this size
MIN_NGRAM = 2  # a lone token recurs everywhere: its continuations say little
MAX_HITS = 256  # occurrences voted over: enough to find the common continuation, bounded in time


class Datastore:
    """Token sequences (one array, a gap between them) and their suffix order."""

    def __init__(self, sequences, vocab_size: int, name: str = "datastore"):
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        arrays = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences]
        if not arrays or not sum(map(len, arrays)):
            raise ValueError(f"{name}: no tokens to store")
        for a in arrays:
            if a.size and (a.min() < 0 or a.max() >= vocab_size):
                raise ValueError(f"{name}: token ids must be in [0, {vocab_size}), got {a.min()}..{a.max()}")
        self.vocab_size, self.name = vocab_size, name
        self.gap = vocab_size  # between sequences; no token has this id, so no match crosses it
        self.tokens = np.concatenate([np.append(a, self.gap) for a in arrays])
        self.bits = self.gap.bit_length()
        self.per_word = 64 // self.bits
        self._index()

    def _index(self) -> None:
        n, bits = len(self.tokens), np.uint64(self.bits)
        padded = np.concatenate([self.tokens, np.full(MAX_NGRAM, self.gap)]).astype(np.uint64)
        words = []
        for first in range(0, MAX_NGRAM, self.per_word):
            key = np.zeros(n, dtype=np.uint64)
            for i in range(first, first + self.per_word):
                key = (key << bits) | (padded[i: i + n] if i < MAX_NGRAM else np.uint64(0))
            words.append(key)
        self.order = np.lexsort(words[::-1])  # the first word is the primary key
        self.words = [w[self.order] for w in words]

    def __len__(self) -> int:
        return len(self.tokens) - int((self.tokens == self.gap).sum())

    def _range(self, gram: list[int]) -> tuple[int, int]:
        """The slice of self.order whose positions start with gram (1..MAX_NGRAM tokens)."""
        lo, hi = 0, len(self.order)
        for j, keys in enumerate(self.words):
            part = gram[j * self.per_word: (j + 1) * self.per_word]
            if not part:
                break
            key = 0
            for t in part:
                key = (key << self.bits) | int(t)
            shift = self.bits * (self.per_word - len(part))  # a shorter part: every value of the rest
            lo, hi = (lo + int(np.searchsorted(keys[lo:hi], np.uint64(key << shift), "left")),
                      lo + int(np.searchsorted(keys[lo:hi], np.uint64(((key + 1) << shift) - 1), "right")))
            if hi <= lo:
                break
        return lo, hi

    def match(self, ids: list[int]) -> tuple[int, int, int] | None:
        """The longest suffix of ids (MAX_NGRAM down to MIN_NGRAM tokens) found in the store:
        (its length, the slice of self.order holding its occurrences), or None. Each occurrence
        of a suffix holds one of every shorter suffix, so as n grows the store has the last n
        tokens until it has not: a binary search finds the longest in 3 lookups, not up to 7."""
        shortest, longest, found = MIN_NGRAM, min(MAX_NGRAM, len(ids)), None
        while shortest <= longest:
            n = (shortest + longest) // 2
            lo, hi = self._range(ids[-n:])
            if hi > lo:
                found, shortest = (n, lo, hi), n + 1
            else:
                longest = n - 1
        return found

    def voters(self, found: tuple[int, int, int]) -> np.ndarray:
        """Where the continuations of a match's occurrences start, up to MAX_HITS of them. The
        occurrences sit in the order of what follows them, so the first MAX_HITS would see only
        the smallest continuations: the voters are spread evenly over the range."""
        n, lo, hi = found
        return self.order[np.linspace(lo, hi - 1, min(hi - lo, MAX_HITS)).astype(np.int64)] + n

    def continuation(self, found: tuple[int, int, int], k: int) -> list[int]:
        """Up to k tokens after a match, each the one most of the occurrences still agreeing
        with the proposal so far write next (ties: the smaller id)."""
        at = self.voters(found)
        out = []
        for _ in range(k):
            nxt = self.tokens[at]  # the gap after each sequence keeps `at` inside the array
            live = nxt != self.gap
            if not live.any():
                break
            values, counts = np.unique(nxt[live], return_counts=True)
            best = int(values[counts.argmax()])
            out.append(best)
            at = at[nxt == best] + 1
        return out

    def save(self, path, recipe: str = "") -> Path:
        """One safetensors file: the tokens (16 bits each where the vocabulary allows), the
        vocabulary size, and `recipe` (how the store was made) as metadata."""
        from safetensors.numpy import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        dtype = np.uint16 if self.gap < 2 ** 16 else np.uint32
        save_file({"tokens": self.tokens.astype(dtype)}, str(path),
                  metadata={"format": "specdec-datastore", "vocab_size": str(self.vocab_size), "recipe": recipe})
        return path

    @classmethod
    def load(cls, path) -> "Datastore":
        """A datastore file as `save` writes it (safetensors; its suffix order is rebuilt, in
        about 0.3 s for 724k tokens). Loads are cached by path for the process."""
        return _load(str(Path(path).resolve()))


def load_datastore(name_or_path) -> Datastore:
    """A datastore by the name of the target it was written for (a shipped one), or its file."""
    return Datastore.load(SHIPPED_DATASTORES.get(str(name_or_path), Path(str(name_or_path)).expanduser()))


@lru_cache(maxsize=4)
def _load(path: str) -> Datastore:
    from safetensors import safe_open

    if not Path(path).is_file():
        raise ValueError(f"datastore {path!r}: no such file")
    try:
        with safe_open(path, "np") as f:
            meta = f.metadata() or {}
            tokens = f.get_tensor("tokens").astype(np.int64)
    except Exception as e:  # not a safetensors file, or no "tokens" in it
        raise ValueError(f"datastore {path!r}: not a specdec datastore ({e})") from None
    if meta.get("format") != "specdec-datastore" or not meta.get("vocab_size", "").isdigit():
        raise ValueError(f"datastore {path!r}: not a specdec datastore (no format/vocab_size metadata)")
    vocab = int(meta["vocab_size"])
    if tokens.ndim != 1 or not tokens.size or tokens[-1] != vocab or tokens.max() > vocab:
        raise ValueError(f"datastore {path!r}: its tokens do not fit its vocabulary of {vocab}")
    sequences = np.split(tokens, np.flatnonzero(tokens == vocab) + 1)[:-1]  # each ends with its gap
    return Datastore([seq[:-1] for seq in sequences], vocab, Path(path).name)
