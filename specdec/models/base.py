"""The one interface the decoding loops see: a causal LM that owns its KV cache.

    model.reset(capacity)        empty the cache, with room for `capacity` positions
    model.forward(ids)           run ids at positions cache_len.. ; append their K/V; logits [T, V]
    model.rollback(length)       forget every position >= length
    model.cache_len              how many positions the cache holds

and, on engines that batch (the native one; the others raise NotImplementedError), the same
for several sequences at once, each with its own cache rows and length:

    model.reset_batch(capacity, batch)   model.forward_batch(blocks)   model.rollback_batch(lengths)
    model.cache_lens

Engines: native.py (our Llama with a static cache, where rollback moves a length),
hf.py (any transformers causal LM), llamacpp.py (any GGUF llama.cpp runs).
"""
from __future__ import annotations

import copy

import torch


def eos_ids_of(config, tokenizer=None) -> tuple[int, ...]:
    """Every id that ends generation: the generation config's, the model config's, the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    return tuple(sorted(ids))


class LanguageModel:
    """Common attributes; subclasses implement reset / forward / rollback / cache_len."""

    tokenizer = None
    name: str = "model"
    batches = False  # implements reset_batch / forward_batch / rollback_batch
    pass_tile = None  # rows a pass computes at once, where one more row costs another round (kernel.tile_rows)
    # Whether every row of a block (and of a batch) has the bits a one-token pass of that row
    # alone would give. Where not, a near tie can go either way with the block's size.
    row_invariant = False
    # What `num_draft_tokens="auto"` charges a pass where rows are not invariant, in one-token
    # passes: a 2-token pass, then each token more (schedule.FixedCosts). Torch on the AMX VM
    # (Xeon, family 6 model 167), SmolLM2-135M after 300 tokens, 2 threads: 2 / 5 / 9 / 17 tokens
    # 1.02 / 1.54 / 1.86 / 2.11 one-token passes in float32, 1.02 / 1.07 / 1.11 / 1.20 in bf16.
    block_cost = (1.05, 0.08)

    def __init__(self, *, vocab_size: int, max_context: int, eos_token_ids, dtype, device, tokenizer, name):
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.eos_token_ids = tuple(eos_token_ids)
        self.dtype = dtype
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.name = name

    def fork(self) -> "LanguageModel":
        """The same weights with a cache of its own (a model can then draft for itself)."""
        twin = copy.copy(self)
        twin.reset_state()
        return twin

    # Several sequences at once, each with its own cache rows and length. Engines that batch
    # implement these; the others refuse.
    def reset_batch(self, capacity: int, batch: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} runs one sequence at a time (no batched passes)")

    def forward_batch(self, blocks, last_only: bool = False) -> list[torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} runs one sequence at a time (no batched passes)")

    def rollback_batch(self, lengths) -> None:
        raise NotImplementedError(f"{type(self).__name__} runs one sequence at a time (no batched passes)")

    def as_tensor(self, ids) -> torch.Tensor:
        if isinstance(ids, torch.Tensor):
            return ids.to(self.device)
        return torch.tensor(list(ids), dtype=torch.long, device=self.device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, dtype={self.dtype}, device={self.device})"


class Rows:
    """A model's cache as B sequences: one through the single-sequence interface (every
    engine), several through the batched one (engines that batch). The decoding loops and
    a model draft see every engine through this, so a batch of one is the plain API."""

    def __init__(self, model: LanguageModel, batch: int, who: str = "the target"):
        if batch > 1 and not model.batches:
            raise ValueError(f"{who} ({model.name} on {type(model).__name__}) runs one prompt at a time; "
                             "batches need an engine that batches (the native engine)")
        self.model, self.batch = model, batch

    def reset(self, capacity: int) -> None:
        if self.batch == 1:
            self.model.reset(capacity)
        else:
            self.model.reset_batch(capacity, self.batch)

    def forward(self, blocks: list[list[int]], last_only: bool = False) -> list[torch.Tensor]:
        """Logits per block; an empty block (a finished row, one not drafting) costs nothing."""
        if self.batch == 1:
            return [self.model.forward(blocks[0], last_only=last_only)]
        return self.model.forward_batch(blocks, last_only=last_only)

    @property
    def lengths(self) -> list[int]:
        return [self.model.cache_len] if self.batch == 1 else self.model.cache_lens

    def rollback(self, lengths: list[int]) -> None:
        if self.batch == 1:
            self.model.rollback(lengths[0])
        else:
            self.model.rollback_batch(lengths)
