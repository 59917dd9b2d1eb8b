"""The native engine: our Llama-family model (llama.py) with a static KV cache, where rollback
moves a length; bf16 passes on the CPU run through the C++ kernel (kernel.py)."""
from __future__ import annotations

import torch

from . import kernel
from .base import LanguageModel
from .llama import Int8Linear, Llama
from .pages import to_huge_pages


def _on_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t, on 2 MB pages if it is on the CPU (pages.py): rows every pass reads."""
    return to_huge_pages({"t": t})["t"] if t.device.type == "cpu" else t.contiguous()


class NativeLM(LanguageModel):
    batches = True
    head = None  # (token ids, their lm_head rows) after restrict_head
    head_tokens = None  # the checkpoint's suggested draft head (head_tokens.json); used by ModelDrafter

    def __init__(self, module: Llama, *, eos_token_ids, tokenizer=None, name="model", max_context=None):
        cfg = module.cfg
        limit = cfg.max_position_embeddings
        if cfg.sliding_window:
            # Beyond the window the reference model attends differently; refuse rather than diverge.
            limit = min(limit, cfg.sliding_window)
        p = module.model.embed_tokens.weight  # the activations' dtype (int8 weights compute in it)
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
        head = self.module.lm_head
        self.head = (ids, _on_pages(head.widened(ids) if isinstance(head, Int8Linear) else head.weight[ids]))

    @property
    def cache_len(self) -> int:
        return self.cache.lengths[0]

    def reset(self, capacity: int) -> None:
        self.reset_batch(capacity, 1)

    def forward(self, ids, last_only: bool = False) -> torch.Tensor:
        return self.module(self.as_tensor(ids), self.cache, last_only=last_only, head=self.head)

    def rollback(self, length: int) -> None:
        self.rollback_batch([length])

    @property
    def cache_lens(self) -> list[int]:
        return list(self.cache.lengths)

    def reset_batch(self, capacity: int, batch: int) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if self.cache.capacity < capacity or self.cache.batch != batch:
            self.cache = self.module.new_cache(capacity, batch)
        self.cache.lengths = [0] * batch

    def forward_batch(self, blocks, last_only: bool = False) -> list[torch.Tensor]:
        return self.module.forward_batch([self.as_tensor(b) for b in blocks], self.cache, last_only=last_only,
                                         head=self.head)

    def rollback_batch(self, lengths) -> None:
        if len(lengths) != self.cache.batch:
            raise ValueError(f"{len(lengths)} lengths for a cache of {self.cache.batch} sequences")
        for n, held in zip(lengths, self.cache.lengths):
            if not 0 <= n <= held:
                raise ValueError(f"cannot roll back to {n}: cache holds {held}")
        self.cache.lengths = list(lengths)
