"""Convert a Llama-family GGUF file into a plain transformers checkpoint directory.

The result (config.json, model.safetensors in float32, tokenizer files, generation_config.json)
loads with a bare `AutoModelForCausalLM.from_pretrained`, so the rest of specdec never has to
know a model came from llama.cpp. We read the file with gguf-py rather than through transformers'
GGUF model loading, which needs accelerate and will not save what it loads.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, Qwen2Config

logger = logging.getLogger(__name__)

# Mistral and most Llama derivatives are written by llama.cpp under "llama", so these two cover them.
CONFIG_CLASSES = {"llama": LlamaConfig, "qwen2": Qwen2Config}
# config.json's "architectures": tools that pick the model class from it (llama.cpp's
# convert_hf_to_gguf.py, vLLM, transformers' pipelines) refuse a config without it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# llama.cpp stores Llama 3's long-context RoPE as a tensor of per-frequency divisors, not a weight.
ROPE_FREQS = "rope_freqs.weight"


def read_field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def shortest_float(value: float) -> float:
    # GGUF keeps floats as float32, so 1e-5 comes back as 9.99999974e-06; the float32 rounding of the
    # shortest decimal is bit-identical, and it keeps config.json readable.
    return float(str(np.float32(value)))


def llama3_rope(freq_divisors: np.ndarray, theta: float, head_dim: int, factor: float) -> dict | None:
    """Recover HF's `llama3` rope parameters from llama.cpp's `rope_freqs` tensor, or None.

    llama.cpp's converter bakes low/high_freq_factor and the original context into the divisors;
    every released Llama 3.x uses 1, 4 and 8192, so we assume those and check the divisors match.
    """
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = np.clip((8192 / wavelen - 1.0) / (4.0 - 1.0), 0.0, 1.0)
    expected = 1.0 / ((1 - smooth) / factor + smooth)
    if expected.shape != freq_divisors.shape or not np.allclose(expected, freq_divisors, rtol=1e-4):
        return None
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


def rope_parameters(reader: GGUFReader, arch: str, head_dim: int) -> dict:
    theta = shortest_float(read_field(reader, f"{arch}.rope.freq_base", 10000.0))
    scaling = read_field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        params = {"rope_type": scaling, "rope_theta": theta,
                  "factor": shortest_float(read_field(reader, f"{arch}.rope.scaling.factor"))}
        if scaling == "yarn":  # linear scaling takes no original length
            params["original_max_position_embeddings"] = read_field(
                reader, f"{arch}.rope.scaling.original_context_length", read_field(reader, f"{arch}.context_length"))
        return params
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        divisors = dequantize(freqs.data, freqs.tensor_type).astype(np.float64).ravel()
        params = llama3_rope(divisors, theta, head_dim, shortest_float(divisors.max()))
        if params is not None:
            return {**params, "rope_theta": theta}
        logger.warning("%s does not match Llama 3's rope scaling; using plain RoPE", ROPE_FREQS)
    return {"rope_type": "default", "rope_theta": theta}


def token_id(reader: GGUFReader, name: str) -> int | None:
    return read_field(reader, f"tokenizer.ggml.{name}_token_id")


def build_config(reader: GGUFReader):
    arch = read_field(reader, "general.architecture")
    if arch not in CONFIG_CLASSES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; expected one of {sorted(CONFIG_CLASSES)}")

    def key(name, default=None):
        return read_field(reader, f"{arch}.{name}", default)

    heads, hidden = key("attention.head_count"), key("embedding_length")
    # Older converters omit key_length; these architectures rotate the whole head, so the rope
    # dimension is the head size too.
    head_dim = key("attention.key_length", key("rope.dimension_count", hidden // heads))
    names = {t.name for t in reader.tensors}
    kwargs = dict(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        max_position_embeddings=key("context_length"),
        rms_norm_eps=shortest_float(key("attention.layer_norm_rms_epsilon")),
        rope_parameters=rope_parameters(reader, arch, head_dim),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=token_id(reader, "bos"),
        eos_token_id=token_id(reader, "eos"),
        pad_token_id=token_id(reader, "padding"),
        dtype="float32",  # what model.safetensors holds
        architectures=[ARCHITECTURES[arch]],
    )
    if arch == "llama":
        kwargs.update(head_dim=head_dim, attention_bias="blk.0.attn_q.bias" in names)
    return CONFIG_CLASSES[arch](**kwargs)


def hf_name(gguf_name: str) -> str:
    base, kind = gguf_name.rsplit(".", 1)  # kind is "weight" or "bias"
    if block := re.fullmatch(r"blk\.(\d+)\.(\w+)", base):
        if block[2] in BLOCK_NAMES:
            return f"model.layers.{block[1]}.{BLOCK_NAMES[block[2]]}.{kind}"
    elif base in TOP_LEVEL_NAMES:
        return f"{TOP_LEVEL_NAMES[base]}.{kind}"
    raise ValueError(f"no transformers name for GGUF tensor {gguf_name!r}")


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order for the llama architecture.

    llama.cpp interleaves each head's two rotary halves row by row (its RoPE rotates adjacent
    pairs), via `reshape(n_head, 2, half, ...).swapaxes(1, 2)`; HF rotates halves, so swap back.
    """
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantized(tensor) -> np.ndarray:
    # ggml lists dimensions fastest-first, numpy slowest-first. F32 data is a read-only view into
    # the memory map, so np.array copies it into something torch may own.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)


def state_dict(reader: GGUFReader, config, progress: bool = True) -> dict[str, torch.Tensor]:
    # Only llama.cpp's Llama converter permutes q/k; its Qwen2 converter stores HF order as is.
    permute_heads = {}
    if config.model_type == "llama":
        permute_heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    tensors = {}
    for tensor in tqdm(reader.tensors, desc="Converting GGUF tensors", unit="tensor", disable=not progress):
        if tensor.name == ROPE_FREQS:
            continue  # folded into config.rope_parameters
        name = hf_name(tensor.name)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        weight = dequantized(tensor)
        if n_head := permute_heads.get(tensor.name.split(".")[-2]):
            weight = unpermute_rows(weight, n_head)  # the bias too: llama.cpp permutes both
        tensors[name] = torch.from_numpy(np.ascontiguousarray(weight))
    return tensors


def generation_config(reader: GGUFReader) -> GenerationConfig:
    # Chat models often end a turn with an end-of-turn token distinct from eos; stop on either.
    eos = list(dict.fromkeys(i for k in ("eos", "eot", "eom") if (i := token_id(reader, k)) is not None))
    return GenerationConfig(bos_token_id=token_id(reader, "bos"), eos_token_id=eos[0] if len(eos) == 1 else eos or None,
                            pad_token_id=token_id(reader, "padding"))


def write_checkpoint(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    reader = GGUFReader(gguf_path)
    config = build_config(reader)
    save_file(state_dict(reader, config, progress), out_dir / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    generation_config(reader).save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, progress: bool = True) -> Path:
    """Convert `gguf_path` into a transformers checkpoint at `out_dir`, replacing what is there.

    Everything is written to a hidden sibling first and renamed into place at the end, so an
    interrupted run never leaves a half-written `out_dir` for a cache check to trust.
    """
    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        write_checkpoint(gguf_path, staging, progress)
        if out_dir.exists():
            # A directory cannot be renamed over a non-empty one: move the old one aside first.
            stale = staging.with_name(staging.name.replace(".partial-", ".stale-"))
            os.rename(out_dir, stale)
            os.rename(staging, out_dir)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
