"""The one interface the decoding loops see: a causal LM that owns its KV cache.

    model.reset(capacity)        empty the cache, with room for `capacity` positions
    model.forward(ids)           run ids at positions cache_len.. ; append their K/V; logits [T, V]
    model.rollback(length)       forget every position >= length
    model.cache_len              how many positions the cache holds

and, on engines that batch (the native one; the others raise NotImplementedError), the same
for several sequences at once, each with its own cache rows and length:

    model.reset_batch(capacity, batch)   model.forward_batch(blocks)   model.rollback_batch(lengths)
    model.cache_lens

and, on engines with side outputs (the native one), extra rows scored beside the output head's:

    model.forward(ids, side=rows)        logits [T, V + E]: each row's logits, then rows [E, hidden] . h,
                                         its normed last hidden state's products with them (also forward_batch)

and, on engines that verify trees (the native one), several candidate continuations in one pass:

    model.forward_tree(ids, parents)     ids[i] follows ids[parents[i]]; the cache grows by len(ids)
    model.keep_path(start, rows)         lay the kept path's rows out in order from `start`

Two implementations: `NativeLM` (our Llama-family model with a static cache, where
rollback just moves a length) and `HFAdapter` (any transformers causal LM; we keep its
cache object but trim it ourselves, by position, instead of trusting its `crop`, whose
meaning changed between transformers versions).
"""
from __future__ import annotations

import copy
import inspect

import torch

from . import kernel
from .llama import Llama
from .pages import to_huge_pages


def _on_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t, on 2 MB pages if it is on the CPU (pages.py): rows every pass reads."""
    return to_huge_pages({"t": t})["t"] if t.device.type == "cpu" else t.contiguous()


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
    trees = False  # implements forward_tree / keep_path
    side_outputs = False  # forward(..., side=rows) also scores extra rows on the last hidden state
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

    # Trees of candidates in one pass. Engines that verify them implement these; the others refuse.
    def forward_tree(self, ids, parents) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} verifies chains only (no tree passes)")

    def keep_path(self, start: int, rows) -> None:
        raise NotImplementedError(f"{type(self).__name__} verifies chains only (no tree passes)")

    def as_tensor(self, ids) -> torch.Tensor:
        if isinstance(ids, torch.Tensor):
            return ids.to(self.device)
        return torch.tensor(list(ids), dtype=torch.long, device=self.device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, dtype={self.dtype}, device={self.device})"


def check_tree(parents, n: int) -> list[int]:
    """parents as a list: one per token, -1 for the first (the root) and an earlier row for
    every other, so that rows come in an order where each follows its parent."""
    parents = [int(p) for p in parents]
    if len(parents) != n or not n:
        raise ValueError(f"a tree of {n} tokens needs {n} parents, got {len(parents)}")
    if parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents[1:], 1)):
        raise ValueError("parents[0] must be -1 and parents[i] an earlier row (0 <= parents[i] < i)")
    return parents


class NativeLM(LanguageModel):
    batches = True
    trees = True
    side_outputs = True
    _side = (None, None)  # (side rows, the output head with them appended): made once per side
    head = None  # (token ids, their lm_head rows) after restrict_head
    head_tokens = None  # the checkpoint's suggested draft head (head_tokens.json); used by ModelDrafter

    def __init__(self, module: Llama, *, eos_token_ids, tokenizer=None, name="model", max_context=None):
        cfg = module.cfg
        limit = cfg.max_position_embeddings
        if cfg.sliding_window:
            # Beyond the window the reference model attends differently; refuse rather than diverge.
            limit = min(limit, cfg.sliding_window)
        p = module.lm_head.weight
        super().__init__(vocab_size=cfg.vocab_size, max_context=max_context or limit, eos_token_ids=eos_token_ids,
                         dtype=p.dtype, device=p.device, tokenizer=tokenizer, name=name)
        self.module = module
        self.reset_state()

    def reset_state(self) -> None:
        self.cache = self.module.new_cache(0)

    @property
    def pass_tile(self) -> int | None:
        return kernel.tile_rows() if kernel.supports(self.module) else None

    @property
    def row_invariant(self) -> bool:
        """The bf16 kernel computes each row as a one-token pass would (docs/kernels.md); torch does not."""
        return kernel.supports(self.module) and kernel.library() is not None

    def restrict_head(self, token_ids) -> None:
        """Score only `token_ids` from now on (the rest get -inf): a cheaper output head for
        a draft. Applies to this object only, not to forks made before or the module."""
        ids = self.as_tensor(token_ids)
        if ids.ndim != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"head token ids must be a non-empty list of ids in [0, {self.vocab_size})")
        self.head = (ids, _on_pages(self.module.lm_head.weight[ids]))

    @property
    def cache_len(self) -> int:
        return self.cache.lengths[0]

    def reset(self, capacity: int) -> None:
        self.reset_batch(capacity, 1)

    def _head_with(self, side):
        """The head a pass scores: the model's own, or with `side`'s rows appended after it (the
        kernel scores whatever rows it is given, so side outputs cost their rows' share of a pass)."""
        if side is None:
            return self.head
        if self.head is not None:
            raise ValueError("side rows need the full output head; this model's is restricted")
        if side is not self._side[0]:
            w = self.module.lm_head.weight
            if side.ndim != 2 or side.shape[1] != w.shape[1] or side.dtype != w.dtype:
                raise ValueError(f"side rows must be [E, {w.shape[1]}] in {w.dtype}, got {tuple(side.shape)} "
                                 f"in {side.dtype}")
            self._side = (side, _on_pages(torch.cat([w, side])))
        return None, self._side[1]

    def forward(self, ids, last_only: bool = False, side=None) -> torch.Tensor:
        return self.module(self.as_tensor(ids), self.cache, last_only=last_only, head=self._head_with(side))

    def rollback(self, length: int) -> None:
        self.rollback_batch([length])

    def forward_tree(self, ids, parents) -> torch.Tensor:
        ids = self.as_tensor(ids)
        return self.module.forward_tree(ids, check_tree(parents, ids.shape[0]), self.cache, head=self.head)

    def keep_path(self, start: int, rows) -> None:
        rows = [int(r) for r in rows]
        if rows != sorted(set(rows)) or not rows or rows[0] < 0 or start + rows[-1] >= self.cache.lengths[0]:
            raise ValueError(f"rows to keep must ascend within the cache ({self.cache.lengths[0]} held from 0)")
        self.cache.keep(0, start, rows)

    @property
    def cache_lens(self) -> list[int]:
        return list(self.cache.lengths)

    def reset_batch(self, capacity: int, batch: int) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if self.cache.capacity < capacity or self.cache.batch != batch:
            self.cache = self.module.new_cache(capacity, batch)
        self.cache.lengths = [0] * batch

    def forward_batch(self, blocks, last_only: bool = False, side=None) -> list[torch.Tensor]:
        return self.module.forward_batch([self.as_tensor(b) for b in blocks], self.cache, last_only=last_only,
                                         head=self._head_with(side))

    def rollback_batch(self, lengths) -> None:
        if len(lengths) != self.cache.batch:
            raise ValueError(f"{len(lengths)} lengths for a cache of {self.cache.batch} sequences")
        for n, held in zip(lengths, self.cache.lengths):
            if not 0 <= n <= held:
                raise ValueError(f"cannot roll back to {n}: cache holds {held}")
        self.cache.lengths = list(lengths)


class HFAdapter(LanguageModel):
    """Any transformers causal LM (PreTrainedModel), batch size 1."""

    def __init__(self, model, *, tokenizer=None, name=None):
        import transformers

        if not isinstance(model, transformers.PreTrainedModel):
            raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
        cfg = model.config
        p = next(model.parameters())
        gen = getattr(model, "generation_config", None)
        eos = eos_ids_of(gen, tokenizer) or eos_ids_of(cfg, tokenizer)
        max_ctx = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048
        super().__init__(vocab_size=model.get_output_embeddings().weight.shape[0], max_context=max_ctx,
                         eos_token_ids=eos, dtype=p.dtype, device=p.device, tokenizer=tokenizer,
                         name=name or getattr(cfg, "name_or_path", "") or cfg.model_type)
        self.model = model.eval()
        # transformers 5 renamed `past_key_values` to `cache`; accept either.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.reset_state()

    def reset_state(self) -> None:
        self._cache, self._len = None, 0

    @property
    def cache_len(self) -> int:
        return self._len

    def reset(self, capacity: int) -> None:
        self.reset_state()

    @torch.inference_mode()
    def forward(self, ids, last_only: bool = False) -> torch.Tensor:
        ids = self.as_tensor(ids)
        T = ids.shape[0]
        if self._cache is None:
            from transformers import DynamicCache

            self._cache = DynamicCache(config=self.model.config)
        # The cache object is updated in place by the model.
        pos = torch.arange(self._len, self._len + T, device=self.device)[None]
        out = self.model(input_ids=ids[None], position_ids=pos, use_cache=True,
                         logits_to_keep=1 if last_only else 0, **{self._cache_kw: self._cache})
        self._len += T
        if self._cache.get_seq_length() != self._len:
            raise ValueError(f"{self.name}: its cache does not grow by position; cannot use it here")
        return out.logits[0].float()

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._len:
            raise ValueError(f"cannot roll back to {length}: cache holds {self._len}")
        if length == self._len:
            return
        # Slice each layer's tensors to the kept positions; refuse caches we can't trim by position.
        for layer in self._cache.layers:
            if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
                raise ValueError(f"{self.name}: its cache type ({type(layer).__name__}) cannot be rolled back")
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]
        self._len = length


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

    def forward(self, blocks: list[list[int]], last_only: bool = False, side=None) -> list[torch.Tensor]:
        """Logits per block; an empty block (a finished row, one not drafting) costs nothing.
        side: extra rows (engines with side outputs), whose products follow each row's logits."""
        extra = {} if side is None else {"side": side}
        if self.batch == 1:
            return [self.model.forward(blocks[0], last_only=last_only, **extra)]
        return self.model.forward_batch(blocks, last_only=last_only, **extra)

    @property
    def lengths(self) -> list[int]:
        return [self.model.cache_len] if self.batch == 1 else self.model.cache_lens

    def rollback(self, lengths: list[int]) -> None:
        if self.batch == 1:
            self.model.rollback(lengths[0])
        else:
            self.model.rollback_batch(lengths)


def as_language_model(model, tokenizer=None) -> LanguageModel:
    """Accept our models as they are, and wrap a raw transformers model in the adapter."""
    if isinstance(model, LanguageModel):
        return model
    try:
        import transformers
    except ImportError:  # pragma: no cover
        transformers = None
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        return HFAdapter(model, tokenizer=tokenizer)
    raise TypeError(f"expected a specdec model or a transformers PreTrainedModel, got {type(model).__name__}")
