"""Batched passes on the native engine: several sequences in one cache, each row exactly its
own single-sequence run.

The engine half of batched requests: `reset_batch`, `forward_batch` (ragged blocks, empty
ones allowed), `rollback_batch`. Every sequence's logits and K/V must have the bits of the
same sequence run alone, whatever the other rows of the pass are: in bf16 through the kernel
(one pass for all sequences) and in float32 through torch (one sequence at a time).
"""
from __future__ import annotations

import pytest
import torch

from specdec import load_model
from specdec.models import kernel
from specdec.models.hf import HFAdapter

from tiny import needs_model, save_tiny, tiny_hf_model

SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             max_position_embeddings=512)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("batch") / "gqa", "llama", seed=5, **SHAPE)


def script(seed: int, batch: int, vocab: int):
    """Prompts of mixed lengths (kernel and torch prefills) and ragged blocks, some empty."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 60, (batch,), generator=g)]
    steps = [[torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in torch.randint(0, 10, (batch,), generator=g)]
             for _ in range(4)]
    rollbacks = [[int(r) for r in torch.randint(0, 3, (batch,), generator=g)] for _ in steps]
    return prompts, steps, rollbacks


def run_alone(model, prompt, blocks, rollbacks):
    """One sequence through the script on its own: its logits per step and its final K/V."""
    model.reset(200)
    out = [model.forward(prompt, last_only=True)]
    for block, back in zip(blocks, rollbacks):
        if block:
            out.append(model.forward(block))
        model.rollback(max(model.cache_len - back, 1))
    n = model.cache_len
    return out, model.cache.k[:, 0, :, :n].clone(), model.cache.v[:, 0, :, :n].clone()


def run_together(model, prompts, steps, rollbacks):
    model.reset_batch(200, len(prompts))
    outs = [[x] for x in model.forward_batch(prompts, last_only=True)]
    for blocks, backs in zip(steps, rollbacks):
        for b, x in enumerate(model.forward_batch(blocks)):
            if blocks[b]:
                outs[b].append(x)
            else:
                assert x.shape[0] == 0
        model.rollback_batch([max(n - back, 1) for n, back in zip(model.cache_lens, backs)])
    return outs, [(model.cache.k[:, b, :, :n].clone(), model.cache.v[:, b, :, :n].clone())
                  for b, n in enumerate(model.cache_lens)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("batch", [1, 2, 5, 8])
def test_every_sequence_of_a_batch_is_its_own_run(path, dtype, batch):
    model = load_model(path, dtype=dtype)
    if dtype == "bfloat16" and kernel.library() is not None:
        assert kernel.supports(model.module)
    prompts, steps, rollbacks = script(batch, batch, 64)
    together, kv = run_together(model, prompts, steps, rollbacks)
    alone_model = model.fork()
    for b in range(batch):
        alone, k, v = run_alone(alone_model, prompts[b], [s[b] for s in steps], [r[b] for r in rollbacks])
        assert len(alone) == len(together[b])
        for x, y in zip(alone, together[b]):
            assert torch.equal(x, y)
        assert torch.equal(k, kv[b][0]) and torch.equal(v, kv[b][1])


@needs_model
def test_the_embedded_model_batched_is_bit_identical_to_alone():
    model = load_model("smollm2-135m-instruct", dtype="bfloat16")
    tok = model.tokenizer
    prompts = [tok.encode(t) for t in ("The capital of France is", "Write a poem about the sea. " * 5,
                                        "def add(a, b):")]
    steps = [[tok.encode(" one two")[:2], tok.encode(" and then")[:3], []],
             [tok.encode(" x"), tok.encode(" it was a dark and stormy night"), tok.encode(" return a + b")]]
    rollbacks = [[0, 1, 0], [1, 0, 2]]
    together, kv = run_together(model, prompts, steps, rollbacks)
    for b in range(3):
        alone, k, v = run_alone(model.fork(), prompts[b], [s[b] for s in steps], [r[b] for r in rollbacks])
        assert all(torch.equal(x, y) for x, y in zip(alone, together[b]))
        assert torch.equal(k, kv[b][0]) and torch.equal(v, kv[b][1])


def test_kernel_passes_hold_at_most_max_rows():
    groups = kernel.passes([0, 1, 2, 3], [60, 60, 17, 128])
    assert groups == [[0, 1], [2], [3]]
    assert all(sum({0: 60, 1: 60, 2: 17, 3: 128}[b] for b in g) <= kernel.MAX_ROWS for g in groups)


def test_bad_batches_are_refused(path):
    model = load_model(path, dtype="float32")
    model.reset_batch(16, 2)
    with pytest.raises(ValueError, match="3 blocks for a cache of 2 sequences"):
        model.forward_batch([[1], [2], [3]])
    with pytest.raises(ValueError, match="KV cache overflow"):
        model.forward_batch([[1] * 17, []])
    with pytest.raises(IndexError, match="token ids must be in"):
        model.forward_batch([[64], []])
    model.forward_batch([[1, 2], [3]])
    with pytest.raises(ValueError, match="cannot roll back to 2: cache holds 1"):
        model.rollback_batch([2, 2])
    with pytest.raises(ValueError, match="1 lengths for a cache of 2 sequences"):
        model.rollback_batch([1])
    with pytest.raises(ValueError, match="use forward_batch"):
        model.module.forward(torch.tensor([1]), model.cache)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        model.reset_batch(16, 0)


def test_engines_without_batches_say_so():
    adapter = HFAdapter(tiny_hf_model("llama"))
    with pytest.raises(NotImplementedError, match="one sequence at a time"):
        adapter.reset_batch(16, 2)
