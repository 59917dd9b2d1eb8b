"""Native Llama-family transformer: weights -> logits, with a static KV cache.

Covers Llama 2/3, Mistral, Qwen2/2.5, SmolLM/SmolLM2 and TinyLlama: RMSNorm, rotary
position embeddings (default, linear and llama3 scaling), grouped-query attention,
SwiGLU MLP, tied or untied output head, optional q/k/v(/o) biases.

The KV cache is preallocated and written by position, so the cache *is* a tensor plus
a length per sequence: rolling back a rejected speculation lowers it, nothing else.
Parameter names mirror transformers' so a checkpoint's state dict loads as is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import kernel
from .cache import KVCache

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    qkv_bias: bool = False  # Qwen2: bias on q, k, v only
    o_bias: bool = False  # Llama's attention_bias puts a bias on o_proj too
    mlp_bias: bool = False
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, hf) -> "LlamaConfig":
        """Translate a transformers config; raise ValueError for what we don't implement."""
        if hf.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"native path supports {SUPPORTED_MODEL_TYPES}, not {hf.model_type!r}")
        # transformers 5.x keeps theta and scaling in `rope_parameters`; 4.x in two attributes.
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope scaling {rope_type!r} is not implemented natively")
        if getattr(hf, "partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings are not implemented natively")
        heads = hf.num_attention_heads
        attention_bias = bool(getattr(hf, "attention_bias", False))
        window = getattr(hf, "sliding_window", None)
        if hf.model_type == "qwen2" and not getattr(hf, "use_sliding_window", False):
            window = None
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            rope_theta=float(theta),
            rope_scaling=rope if rope_type != "default" else None,
            qkv_bias=hf.model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_window=window,
        )


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Rotary frequencies, with the context-extension scalings Llama-family checkpoints use."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling
    if not s:
        return inv_freq.float()
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return (inv_freq / s["factor"]).float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return torch.where(medium, blended, scaled).float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 as the reference does; bf16 variance loses too much.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Int8Linear(nn.Module):
    """A linear layer stored as int8 weights with a bf16 scale per block of 32 along a row
    (symmetric, as llama.cpp's Q8_0): 1.06 bytes a weight instead of bf16's 2, and a decoding
    pass costs the bytes it reads. It computes exactly as the bf16 layer whose weights are
    bf16(q * scale): the kernel widens each block in registers (kernel.cpp), the torch path
    below widens the whole matrix. Each scale is rounded up to bf16 before the weights are
    divided by it, so |q| <= 127 and the only loss is the rounding to q."""

    BLOCK = 32

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        N, K = w.shape
        if K % self.BLOCK:
            raise ValueError(f"int8 weights need rows in blocks of {self.BLOCK}, not {K} wide")
        blocks = w.view(N, K // self.BLOCK, self.BLOCK)
        need = blocks.abs().amax(-1) / 127
        scale = need.to(torch.bfloat16)
        up = (scale.view(torch.int16) + 1).view(torch.bfloat16)  # the next bf16 (scales are >= 0)
        scale = torch.where(scale.float() < need, up, scale)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block stays zero
        q = torch.round(blocks / scale.float()[..., None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("weight", q.view(N, K).contiguous())
        self.register_buffer("scale", scale.contiguous())
        self.bias = linear.bias

    def widened(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The bf16 weights this layer computes with (rows `ids`, or all)."""
        q, s = (self.weight, self.scale) if ids is None else (self.weight[ids], self.scale[ids])
        return (q.float().view(q.shape[0], -1, self.BLOCK) * s.float()[..., None]).view(q.shape).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.widened().to(x.dtype), self.bias)


def quantize_int8(module: "Llama") -> "Llama":
    """Every projection and the output head as Int8Linear, in place (the embeddings stay bf16:
    a pass reads only its tokens' rows; a tied head gets its own int8 copy)."""
    for layer in module.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Int8Linear(child))
    module.lm_head = Int8Linear(module.lm_head)
    return module


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.h, self.kvh, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kvh * self.hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kvh * self.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.hd, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x, cos, sin, cache: KVCache, layer: int, mask, start: int):
        T = x.shape[1]
        q = self.q_proj(x).view(1, T, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(1, T, self.kvh, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(1, T, self.kvh, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        end = start + T
        cache.k[layer, :, :, start:end] = k
        cache.v[layer, :, :, start:end] = v
        keys, values = cache.k[layer, :, :, :end], cache.v[layer, :, :, :end]
        if T == 1 and x.device.type == "cpu" and x.dtype != torch.float32:
            # torch's CPU attention kernel in bf16/fp16 is 5-7x slower for a single query than
            # in float32 (206 vs 30 us a layer at 300 cached tokens; at 3681d61,
            # scripts/probes/one_query_attention.py), and plain decoding is all single queries. Blocks of queries (prefill, verification)
            # run as fast in either dtype, so they stay as they are.
            y = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(),
                                               enable_gqa=self.kvh != self.h).to(x.dtype)
        else:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.kvh != self.h)
        return self.o_proj(y.transpose(1, 2).reshape(1, T, self.h * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache, layer, mask, start):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, mask, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """Of activations and the cache (the projections' weights may be int8: Int8Linear)."""
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        w = self.model.embed_tokens.weight
        return KVCache(self.cfg, capacity, w.dtype, w.device, batch)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False,
                head: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Run `tokens` (shape [T]) of the cache's one sequence, at positions n .. n+T-1 after its n cached.

        Appends their keys/values to the cache and returns float32 logits, shape [T, V]
        (or [1, V] with last_only, which skips the output head for a long prefill).
        head: (token ids, their rows of lm_head) to score only those (the rest get -inf): a
        draft's output head is most of its cost, mostly on tokens the target hardly writes.
        """
        if cache.batch != 1:
            raise ValueError(f"forward runs one sequence; this cache holds {cache.batch}: use forward_batch")
        return self.forward_batch([tokens], cache, last_only, head)[0]

    @torch.inference_mode()
    def forward_batch(self, blocks: list[torch.Tensor], cache: KVCache, last_only: bool = False,
                      head: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Append blocks[b] (shape [T_b], possibly empty) to sequence b of the cache; logits per block.
        Blocks of up to kernel.BLOCK tokens share kernel passes, each row exactly as it would be
        alone (kernel.cpp); longer ones (prefills) run alone in passes of kernel.MAX_ROWS, one
        after another; all go through torch, one sequence at a time, where the kernel is off."""
        if len(blocks) != cache.batch:
            raise ValueError(f"{len(blocks)} blocks for a cache of {cache.batch} sequences")
        for b, tokens in enumerate(blocks):
            self._check_block(tokens, cache, b)
        out: list[torch.Tensor | None] = [None] * len(blocks)
        lib = kernel.library() if kernel.supports(self) else None
        rows = None if head is None else head[1]  # the logits below are of these rows, scattered at the end
        small = [b for b, t in enumerate(blocks) if 0 < t.shape[0] <= kernel.BLOCK] if lib is not None else []
        for group in kernel.passes(small, [blocks[b].shape[0] for b in small]):
            for b, x in zip(group, kernel.run(lib, self, [blocks[b] for b in group], group, cache, last_only, rows)):
                out[b] = x
                cache.lengths[b] += blocks[b].shape[0]
        for b, tokens in enumerate(blocks):
            if out[b] is None and lib is not None and tokens.shape[0]:  # a prompt; moves the length itself
                out[b] = kernel.run_long(lib, self, tokens, b, cache, last_only, rows)
            elif out[b] is None:
                out[b] = self._forward_torch(tokens, cache.row(b), cache.lengths[b], last_only, rows)
                cache.lengths[b] += tokens.shape[0]
        return out if head is None else [self._scatter_head(x, head[0]) for x in out]

    def _check_block(self, tokens: torch.Tensor, cache: KVCache, b: int) -> None:
        if (n := cache.lengths[b] + tokens.shape[0]) > cache.capacity:
            raise ValueError(f"KV cache overflow: {n} positions > capacity {cache.capacity}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.cfg.vocab_size):
            raise IndexError(f"token ids must be in [0, {self.cfg.vocab_size})")

    def _scatter_head(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        full = torch.full((logits.shape[0], self.cfg.vocab_size), -math.inf, device=logits.device)
        full[:, ids] = logits
        return full

    def _forward_torch(self, tokens, cache: KVCache, start: int, last_only, rows) -> torch.Tensor:
        T = tokens.shape[0]
        if T == 0:
            return torch.empty((0, self.cfg.vocab_size if rows is None else rows.shape[0]), device=tokens.device)
        x = self.model.embed_tokens(tokens)[None]
        # Positions are absolute token indices: the cache length is the next position.
        pos = torch.arange(start, start + T, device=tokens.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        # One new token may see everything cached; a block sees the cache and its own slots.
        mask = None
        if T > 1:
            seen = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
            mask = torch.cat([torch.ones(T, start, dtype=torch.bool, device=tokens.device), seen], dim=1)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache, i, mask, start)
        if last_only:
            x = x[:, -1:]
        x = self.model.norm(x)[0]
        return (self.lm_head(x) if rows is None else F.linear(x, rows)).float()
