"""The transformers engine: any transformers causal LM (PreTrainedModel), one sequence at a
time. We keep its cache object but trim it ourselves, by position, instead of trusting its
`crop`, whose meaning changed between transformers versions."""
from __future__ import annotations

import inspect

import torch

from .base import LanguageModel, eos_ids_of


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
