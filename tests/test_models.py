"""The native Llama-family model and the transformers adapter give transformers' logits."""
from __future__ import annotations

import pytest
import torch

import specdec
from specdec import HFAdapter, NativeLM, load_model
from tiny import CONFIGS, save_tiny, tiny_gpt2, tiny_hf_model

KINDS = sorted(CONFIGS)
ATOL = 1e-3


SEQ = torch.randint(0, 64, (37,), generator=torch.Generator().manual_seed(1234)).tolist()


def hf_logits(hf_model, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([ids])).logits[0].float()


def chunked_logits(model, ids, prefill=9, blocks=(5, 1)) -> torch.Tensor:
    """Feed `ids` as a prefill, then blocks of the given sizes, then the rest; stack the logits."""
    model.reset(len(ids))
    sizes = [prefill, *blocks]
    sizes.append(len(ids) - sum(sizes))
    out, pos = [], 0
    for n in sizes:
        out.append(model.forward(ids[pos:pos + n]))
        pos += n
        assert model.cache_len == pos
    return torch.cat(out)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module", params=KINDS)
def pair(request, ckpt_dir):
    """(native model loaded from a saved checkpoint, the transformers model with the same weights)."""
    kind = request.param
    path = save_tiny(ckpt_dir / kind, kind, seed=0)
    return load_model(path, dtype="float32"), tiny_hf_model(kind, seed=0)


def test_loads_natively(pair):
    native, _ = pair
    assert isinstance(native, NativeLM)
    assert native.dtype == torch.float32
    assert native.vocab_size == 64


def test_native_logits_match_transformers(pair):
    native, hf = pair
    native.reset(len(SEQ))
    ours = native.forward(SEQ)
    assert ours.dtype == torch.float32 and ours.shape == (len(SEQ), 64)
    assert (ours - hf_logits(hf, SEQ)).abs().max().item() <= ATOL


def test_native_chunked_logits_match_one_full_pass(pair):
    native, hf = pair
    ours = chunked_logits(native, SEQ)
    assert ours.shape == (len(SEQ), 64)
    assert (ours - hf_logits(hf, SEQ)).abs().max().item() <= ATOL


def test_last_only_is_the_last_row(pair):
    native, _ = pair
    native.reset(len(SEQ))
    full = native.forward(SEQ)
    native.reset(len(SEQ))
    last = native.forward(SEQ, last_only=True)
    assert last.shape == (1, 64)
    assert torch.allclose(last[0], full[-1], atol=1e-5)
    # and after a prefix is cached
    native.reset(len(SEQ))
    native.forward(SEQ[:20])
    assert torch.allclose(native.forward(SEQ[20:], last_only=True)[0], full[-1], atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_one_token_steps_match_float32(kind, ckpt_dir):
    # On a CPU a bf16 model attends in float32 for one-token passes (a faster kernel there)
    # and in bf16 for blocks: both paths must give the float32 model's logits to bf16 precision.
    path = save_tiny(ckpt_dir / f"bf16-{kind}", kind, seed=0)
    ref = load_model(path, dtype="float32")
    ref.reset(len(SEQ))
    want = ref.forward(SEQ)
    bf16 = load_model(path, dtype="bfloat16")
    got = chunked_logits(bf16, SEQ, prefill=9, blocks=(5,) + (1,) * 20)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()


def test_adapter_agrees_with_native(pair):
    native, hf = pair
    adapter = HFAdapter(hf)
    a = chunked_logits(adapter, SEQ)
    n = chunked_logits(native, SEQ)
    assert (a - n).abs().max().item() <= ATOL
    adapter.reset(len(SEQ))
    last = adapter.forward(SEQ, last_only=True)
    assert last.shape == (1, 64)
    assert torch.allclose(last[0], n[-1], atol=ATOL)


def test_fork_shares_weights_not_cache(pair):
    native, _ = pair
    native.reset(len(SEQ))
    native.forward(SEQ[:10])
    twin = native.fork()
    assert twin.cache_len == 0 and native.cache_len == 10
    assert twin.module is native.module
    twin.reset(len(SEQ))
    twin.forward(SEQ[:3])
    assert native.cache_len == 10 and twin.cache_len == 3


def test_restricted_head_scores_only_its_tokens(pair):
    native, _ = pair
    keep = [0, 5, 9, 63]
    twin = native.fork()
    twin.restrict_head(keep)
    native.reset(len(SEQ))
    twin.reset(len(SEQ))
    full, part = native.forward(SEQ), twin.forward(SEQ)
    assert part.shape == full.shape
    assert torch.allclose(part[:, keep], full[:, keep], atol=1e-5)
    others = torch.ones(64, dtype=torch.bool)
    others[keep] = False
    assert torch.isinf(part[:, others]).all() and (part[:, others] < 0).all()
    assert native.head is None  # only the object it was asked of
    for bad in ([], [64], [-1]):
        with pytest.raises(ValueError, match="head token ids"):
            twin.restrict_head(bad)


# ----------------------------------------------------------------------------- non-Llama architecture


@pytest.fixture(scope="module")
def gpt2():
    return tiny_gpt2()


def test_gpt2_through_adapter(gpt2):
    model = specdec.models.hf.as_language_model(gpt2)
    assert isinstance(model, HFAdapter)
    assert model.vocab_size == 64 and model.max_context == 128
    ref = hf_logits(gpt2, SEQ)
    full = chunked_logits(model, SEQ)
    assert (full - ref).abs().max().item() <= ATOL
    model.reset(len(SEQ))
    assert torch.allclose(model.forward(SEQ, last_only=True)[0], ref[-1], atol=ATOL)


def test_gpt2_checkpoint_loads_through_adapter(gpt2, ckpt_dir):
    path = ckpt_dir / "gpt2"
    gpt2.save_pretrained(path, safe_serialization=True)
    model = load_model(path, dtype="float32")
    assert isinstance(model, HFAdapter)
    model.reset(len(SEQ))
    assert (model.forward(SEQ) - hf_logits(gpt2, SEQ)).abs().max().item() <= ATOL


def test_adapter_rejects_non_models():
    with pytest.raises(TypeError):
        HFAdapter(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError):
        specdec.models.hf.as_language_model(object())


# ----------------------------------------------------------------------------- load_model errors and dtype


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nope", dtype="float32")


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path, dtype="float32")


def test_pickled_checkpoint_is_refused(tmp_path):
    # A valid config and a .bin that is not even a pickle: load_model must refuse it by name,
    # never try to unpickle it (that would raise an UnpicklingError or similar instead).
    tiny_hf_model("llama").config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle, and never to be unpickled")
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path, dtype="float32")


def test_non_gguf_file_is_refused(tmp_path):
    f = tmp_path / "pytorch_model.bin"
    f.write_bytes(b"junk")
    with pytest.raises(ValueError):
        load_model(f, dtype="float32")


@pytest.mark.parametrize("dtype", ["float64", "fp32", "bf16", "int4"])
def test_bad_dtype(dtype, ckpt_dir):
    with pytest.raises(ValueError, match="dtype"):
        load_model(ckpt_dir / "never-read", dtype=dtype)


@pytest.mark.parametrize("dtype, expected", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                             ("float32", torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_dtype_is_respected(dtype, expected, ckpt_dir):
    path = ckpt_dir / "dtype-llama"
    if not path.exists():
        save_tiny(path, "llama", seed=0)
    model = load_model(path, dtype=dtype)
    assert model.dtype == expected
    assert model.module.lm_head.weight.dtype == expected
    assert model.module.model.layers[0].self_attn.q_proj.weight.dtype == expected
    model.reset(8)
    logits = model.forward(SEQ[:8])
    assert model.cache.k.dtype == expected
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
