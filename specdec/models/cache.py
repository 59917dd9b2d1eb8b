"""The native engine's KV cache: preallocated, written by position; rolling back a rejected
speculation lowers a length."""
from __future__ import annotations

import torch

from . import pages


class KVCache:
    """Preallocated keys/values for every layer and each of `batch` sequences, each valid up
    to its own length.

    Position p of sequence b lives at index [:, b, :, p], so the cache never moves data:
    appending writes a slice, rolling back lowers a length.
    """

    def __init__(self, cfg, capacity: int, dtype: torch.dtype, device, batch: int = 1):
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        if torch.device(device).type == "cpu":
            self.k, self.v = pages.zeros(shape, dtype), pages.zeros(shape, dtype)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * batch

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def row(self, b: int) -> "KVCache":
        """Sequence b as a cache of batch 1: views of the same tensors."""
        view = KVCache.__new__(KVCache)
        view.k, view.v, view.lengths = self.k[:, b:b + 1], self.v[:, b:b + 1], [self.lengths[b]]
        return view
