"""The llama.cpp engine: any GGUF llama.cpp runs, behind the same interface as the native model.

Through llama-cpp-python's low-level API (`pip install 'specdec[llamacpp]'`): one
`llama_decode` a pass, with logits asked for every position of the block (a verification
needs the target's choice after each prefix), positions exactly as the native engine's
(absolute token indices, so the cache length is the next position), and rollback by
`llama_memory_seq_rm`, which drops every cached position from the given one on.

The loaded weights (`llama_model`) are shared by every fork; each fork gets a context (its
own KV cache) of its own, made on the first `reset`, so a model can draft for itself.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

import numpy as np
import torch

from .base import LanguageModel

INSTALL_HINT = "pip install 'specdec[llamacpp]' (llama-cpp-python, built from source)"


def llama_cpp():
    """The llama_cpp module, or a clear error naming the extra to install."""
    try:
        import llama_cpp as lib
    except ModuleNotFoundError as exc:
        if exc.name != "llama_cpp":  # installed, but something it imports is missing
            raise ImportError(f"llama-cpp-python is installed but cannot be imported ({exc}): {INSTALL_HINT}") from exc
        raise ImportError(f"the llama.cpp engine needs llama-cpp-python: {INSTALL_HINT}") from None
    if not getattr(lib, "_specdec_quiet", False):  # llama.cpp logs every load to stderr; keep errors only
        lib._specdec_log = lib.llama_log_callback(lambda level, text, _: None)
        lib.llama_log_set(lib._specdec_log, ctypes.c_void_p())
        lib.llama_backend_init()
        lib._specdec_quiet = True
    return lib


def has_amx_backend(lib) -> bool:
    """Whether this llama.cpp was built with its AMX backend (an extra buffer type for quantized
    weights, built where the CPU has AMX). Its matmul segfaults on the first pass on an Intel
    Xeon VM (ggml_backend_amx_mul_mat, with the embedded Q4_1 file and Gemma's Q4_K_M;
    ggml-org/llama.cpp#20824), so there the weights stay in plain CPU buffers (no extra
    buffer types, which also skips the repacked ones)."""
    return b"AMX_INT8 = 1" in lib.llama_print_system_info()


def without_amx_backend(params, lib):
    """`params` (llama.cpp's model parameters) with extra buffer types off where llama.cpp has
    its AMX backend (has_amx_backend)."""
    if has_amx_backend(lib):
        params.use_extra_bufts = False
    return params


@contextlib.contextmanager
def loading_for_this_cpu():
    """While llama-cpp-python's `Llama` loads a model: it fills its model parameters itself from
    llama.cpp's defaults, so meanwhile those pass through without_amx_backend."""
    import llama_cpp.llama_cpp as raw

    default, lib = raw.llama_model_default_params, llama_cpp()
    raw.llama_model_default_params = lambda: without_amx_backend(default(), lib)
    try:
        yield
    finally:
        raw.llama_model_default_params = default


class _Weights:
    """A loaded llama_model, freed when the last model object using it goes."""

    def __init__(self, path: Path):
        lib = llama_cpp()
        params = without_amx_backend(lib.llama_model_default_params(), lib)
        params.n_gpu_layers = 0
        self.lib, self.ptr = lib, lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise ValueError(f"{path}: llama.cpp cannot load this file (not a GGUF model it supports)")

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = self.lib.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    def dtype(self) -> torch.dtype:
        """The precision of its weights, as the divergence checks read `model.dtype`: float32
        and float16 files as such, bf16 and quantized ones as bfloat16 (no finer than it)."""
        return {"0": torch.float32, "1": torch.float16}.get(self.meta("general.file_type"), torch.bfloat16)

    def __del__(self):
        if getattr(self, "ptr", None):
            self.lib.llama_model_free(self.ptr)
            self.ptr = None


class _Context:
    """One llama_context (a KV cache for one sequence) and a batch buffer for it."""

    flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED (-1 auto, 1 enabled); see __init__

    def __init__(self, weights: _Weights, n_ctx: int, threads: int):
        lib = weights.lib
        params = lib.llama_context_default_params()
        params.n_ctx = params.n_batch = n_ctx
        params.n_ubatch = min(n_ctx, 512)
        params.n_seq_max = 1
        if hasattr(params, "swa_full"):  # sliding-window layers keep every position, so rollback can reach any
            params.swa_full = True
        params.n_threads = params.n_threads_batch = threads
        # No flash attention, as llama-cpp-python's `Llama` (the bench's llama.cpp peer) runs by
        # default; llama.cpp's own default (auto) turns it on, and on a CPU its attention then
        # grows with the cache far faster: on the AMX VM a one-token pass after 300 cached took
        # 20.5 ms with it and 16.9 without, a 9-token block 3.42 and 2.63 one-token passes
        # (`git show 3681d61:docs/benchmark.md`, "On llama.cpp").
        params.flash_attn_type = self.flash_attn_type
        self.weights, self.lib, self.n_ctx = weights, lib, n_ctx  # holds the weights while it lives
        self.ptr = lib.llama_init_from_model(weights.ptr, params)
        if not self.ptr:
            raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} positions")
        self.memory = lib.llama_get_memory(self.ptr)
        self.batch = lib.llama_batch_init(n_ctx, 0, 1)

    def __del__(self):
        if getattr(self, "ptr", None):
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ptr)
            self.ptr = None


class LlamaCppLM(LanguageModel):
    """A GGUF model run by llama.cpp. `.path` is the file it runs."""

    # Its bf16 blocks: 2 / 5 / 9 / 17 tokens 1.45 / 2.02 / 2.57 / 3.71 one-token passes (Zen 5 VM).
    block_cost = (1.45, 0.15)

    def __init__(self, path, *, tokenizer=None, name=None, eos_token_ids=None, threads: int | None = None):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no such GGUF file: {path}")
        lib = llama_cpp()
        self.path, self.threads = path, threads
        self._weights = _Weights(path)
        vocab = lib.llama_model_get_vocab(self._weights.ptr)
        n_vocab = lib.llama_vocab_n_tokens(vocab)
        if eos_token_ids is None:  # every end-of-generation token the file declares
            has_vocab = lib.llama_vocab_type(vocab) != lib.LLAMA_VOCAB_TYPE_NONE
            eos_token_ids = [i for i in range(n_vocab) if has_vocab and lib.llama_vocab_is_eog(vocab, i)]
        super().__init__(vocab_size=n_vocab, max_context=lib.llama_model_n_ctx_train(self._weights.ptr),
                         eos_token_ids=eos_token_ids, dtype=self._weights.dtype(), device="cpu",
                         tokenizer=tokenizer, name=name or path.name)
        self.reset_state()

    def reset_state(self) -> None:
        self._ctx, self._len = None, 0

    @property
    def cache_len(self) -> int:
        return self._len

    def reset(self, capacity: int) -> None:
        if capacity > self.max_context:
            raise ValueError(f"{self.name}: {capacity} positions exceed its context of {self.max_context}")
        threads = self.threads or torch.get_num_threads()
        if self._ctx is None or self._ctx.n_ctx < capacity:
            # Rounded up, so that a run of slightly longer requests does not remake it each time.
            self._ctx = _Context(self._weights, min(self.max_context, -(-capacity // 256) * 256), threads)
        else:
            self._ctx.lib.llama_memory_clear(self._ctx.memory, True)
            self._ctx.lib.llama_set_n_threads(self._ctx.ptr, threads, threads)
        self._len = 0

    def forward(self, ids, last_only: bool = False) -> torch.Tensor:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        ctx, T = self._ctx, len(ids)
        if ctx is None or self._len + T > ctx.n_ctx:
            raise ValueError(f"KV cache overflow: {self._len + T} positions > capacity "
                             f"{0 if ctx is None else ctx.n_ctx} (call reset first)")
        b = ctx.batch
        b.n_tokens = T
        for i, t in enumerate(ids):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, self._len + i, 1, not last_only
            b.seq_id[i][0] = 0
        b.logits[T - 1] = True
        rc = ctx.lib.llama_decode(ctx.ptr, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc}) on {T} tokens at position {self._len}")
        self._len += T
        rows = 1 if last_only else T
        logits = np.ctypeslib.as_array(ctx.lib.llama_get_logits(ctx.ptr), shape=(rows, self.vocab_size))
        return torch.from_numpy(logits.copy())

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._len:
            raise ValueError(f"cannot roll back to {length}: cache holds {self._len}")
        if length < self._len:
            if not self._ctx.lib.llama_memory_seq_rm(self._ctx.memory, 0, length, -1):
                raise RuntimeError(f"llama.cpp could not drop positions {length}.. from its cache")
            self._len = length

    def __repr__(self) -> str:
        return f"LlamaCppLM({self.name!r}, path={os.fspath(self.path)!r})"
