"""Write a Llama-family checkpoint (config.json + safetensors) as a GGUF file llama.cpp runs.

The inverse of `gguf_convert`: the same tensor names and the same q/k row permutation, so
a checkpoint converted from GGUF and written back holds the weights it was read with (up
to the dtype written). Tokenizer metadata comes from a reference GGUF when there is one (the
embedded target's file, whose tokenizer its draft shares), else from the checkpoint's
tokenizer.json (byte-level BPE), else there is none ("none": llama.cpp then takes token ids
only, which is all the decoding loops give it).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from .gguf_convert import BLOCK_NAMES, TOP_LEVEL_NAMES

ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
GGUF_NAMES = {**{f"{v}.": f"{k}." for k, v in TOP_LEVEL_NAMES.items()},
              **{f".{v}.": f".{k}." for k, v in BLOCK_NAMES.items()}}
FILE_TYPES = {"bf16": (torch.bfloat16, GGMLQuantizationType.BF16, 32), "f16": (torch.float16, None, 1),
              "f32": (torch.float32, None, 0),  # (torch dtype, raw GGML type, general.file_type)
              # Block-quantized: matrices go through gguf's own quantizer (numpy), as llama-quantize would
              # write them, so a draft's passes read 2-4x fewer bytes than bf16.
              "q8_0": (None, GGMLQuantizationType.Q8_0, 7), "q4_0": (None, GGMLQuantizationType.Q4_0, 2)}


def gguf_name(hf_name: str) -> str:
    """model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight (the inverse of hf_name)."""
    name = hf_name
    if name.startswith("model.layers."):
        name = "blk." + name.removeprefix("model.layers.")
        for hf, gg in GGUF_NAMES.items():
            if hf.startswith(".") and hf in name:
                return name.replace(hf, gg)
    for hf, gg in GGUF_NAMES.items():
        if not hf.startswith(".") and name.startswith(hf):
            return gg + name.removeprefix(hf)
    raise ValueError(f"no GGUF name for tensor {hf_name!r}")


def permute_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row order for the llama architecture (undone by gguf_convert.unpermute_rows)."""
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _copy_fields(writer: GGUFWriter, reference: Path, prefixes: tuple[str, ...]) -> None:
    reader = GGUFReader(reference)
    for key, field in reader.fields.items():
        if not key.startswith(prefixes):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)


def _bpe_tokenizer(writer: GGUFWriter, checkpoint: Path, config: dict) -> bool:
    path = checkpoint / "tokenizer.json"
    if not path.exists():
        return False
    tok = json.loads(path.read_text())
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        return False
    vocab = dict(model["vocab"])
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab.update(special)
    n = config["vocab_size"]
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [5] * n  # unused
    for text, i in vocab.items():
        if i < n:
            tokens[i], types[i] = text, 3 if text in special else 1  # control / normal
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    return True


def write_gguf(checkpoint: str | os.PathLike, out: str | os.PathLike, *, file_type: str = "bf16",
               metadata_from: str | os.PathLike | None = None) -> Path:
    """Write `checkpoint` to `out` (atomically) and return `out`. `metadata_from`: a GGUF whose
    tokenizer.* fields are copied (a draft and its target share a tokenizer)."""
    from safetensors.torch import load_file

    checkpoint, out = Path(checkpoint), Path(out)
    config = json.loads((checkpoint / "config.json").read_text())
    arch = ARCHS.get(config.get("model_type"))
    if arch is None:
        raise ValueError(f"{checkpoint}: cannot write a {config.get('model_type')!r} model as GGUF; "
                         f"expected one of {sorted(ARCHS)}")
    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type must be one of {sorted(FILE_TYPES)}, got {file_type!r}")
    dtype, raw, ftype = FILE_TYPES[file_type]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{checkpoint}: rope scaling {rope.get('rope_type')!r} is not written to GGUF here")

    tmp = out.with_name(out.name + ".partial")
    writer = GGUFWriter(tmp, arch)
    writer.add_name(checkpoint.name)
    if metadata_from:
        _copy_fields(writer, Path(metadata_from), ("tokenizer.",))
    elif _bpe_tokenizer(writer, checkpoint, config):
        for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
            if isinstance(config.get(key), int):
                add(config[key])
    else:
        writer.add_tokenizer_model("none")  # ids only
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(ftype)

    state = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        state.update(load_file(str(f)))
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    permute = {"q_proj": heads, "k_proj": kv_heads} if arch == "llama" else {}
    for name, tensor in state.items():
        tensor = tensor.float()
        if (n_head := permute.get(name.split(".")[-2])) is not None:
            tensor = permute_rows(tensor, n_head)
        if tensor.ndim == 1 or dtype == torch.float32:  # norms and biases stay float32, as llama.cpp writes them
            writer.add_tensor(gguf_name(name), tensor.numpy())
        elif dtype is None:
            writer.add_tensor(gguf_name(name), quants.quantize(tensor.numpy(), raw), raw_dtype=raw)
        elif raw is not None:  # numpy has no bfloat16: hand over the bits
            writer.add_tensor(gguf_name(name), tensor.to(dtype).view(torch.int16).numpy(), raw_dtype=raw)
        else:
            writer.add_tensor(gguf_name(name), tensor.to(dtype).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    return out
