"""Batched plain decoding: `generate` with a list of prompts returns one Generation per row,
each exactly the row's own single-prompt run (greedy and sampled), with its own EOS,
`max_tokens` and stats; rows of mixed lengths finish at different steps."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from specdec import generate, load_model
from specdec.models.hf import HFAdapter

from tiny import needs_model, save_tiny, tiny_hf_model

SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             max_position_embeddings=512)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request, tmp_path_factory):
    """A tiny target (the kernel runs its bf16 passes) with an EOS that some rows write early."""
    m = load_model(save_tiny(tmp_path_factory.mktemp("bgen") / "m", "llama", seed=2, **SHAPE), dtype=request.param)
    outs = [generate(m, None, p, 24).token_ids for p in PROMPTS]
    m.eos_token_ids = (Counter(t for o in outs for t in o[3:]).most_common(1)[0][0],)
    return m


g = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(0, 64, (int(n),), generator=g).tolist() for n in (3, 40, 1, 17, 9, 33, 5, 60)]


def alone(m, prompts, **kw):
    return [generate(m, None, p, **kw) for p in prompts]


@pytest.mark.parametrize("batch", [1, 2, 5, 8])
def test_greedy_rows_are_their_own_runs(model, batch):
    prompts = PROMPTS[:batch]
    together = generate(model, None, prompts, 24)
    assert isinstance(together, list) and len(together) == batch
    for got, want in zip(together, alone(model, prompts, max_tokens=24)):
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        assert got.prompt_ids == want.prompt_ids and got.stats.generated == len(got.token_ids)
        assert got.stats.target_calls == want.stats.target_calls
    if batch == 8:  # the EOS chosen above ends some rows early, not all
        assert {r.finish_reason for r in together} == {"eos", "length"}


def test_sampled_rows_are_their_own_runs_seed_for_seed(model):
    kw = dict(temperature=0.9, top_k=20)
    together = generate(model, None, PROMPTS, 20, seed=[11, 3, 7, 7, 0, 5, 2, 9], **kw)
    for got, s, p in zip(together, [11, 3, 7, 7, 0, 5, 2, 9], PROMPTS):
        assert got.token_ids == generate(model, None, p, 20, seed=s, **kw).token_ids
    # an int seed gives row i the seed s + i
    together = generate(model, None, PROMPTS[:3], 20, seed=100, **kw)
    for i, got in enumerate(together):
        assert got.token_ids == generate(model, None, PROMPTS[i], 20, seed=100 + i, **kw).token_ids


def test_stream_gets_the_row_and_its_tokens(model):
    seen = {}
    together = generate(model, None, PROMPTS[:3], 10, stream=lambda row, ids: seen.setdefault(row, []).extend(ids))
    assert [seen[b] for b in range(3)] == [r.token_ids for r in together]


def test_a_single_prompt_is_not_a_batch(model):
    assert not isinstance(generate(model, None, PROMPTS[0], 5), list)
    assert len(generate(model, None, [PROMPTS[0]], 5)) == 1  # a list of one id list is a batch of one


def test_bad_batches_are_refused_before_compute(model):
    with pytest.raises(ValueError, match="3 seeds for 2 prompts"):
        generate(model, None, PROMPTS[:2], 5, seed=[1, 2, 3])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, None, [PROMPTS[0], [64]], 5)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, None, [PROMPTS[0], []], 5)
    with pytest.raises(ValueError, match="runs one prompt at a time"):
        generate(HFAdapter(tiny_hf_model("llama")), None, [[1, 2], [3]], 5)


@needs_model
def test_the_embedded_model_batched_equals_alone():
    m = load_model("smollm2-135m-instruct", dtype="bfloat16")
    prompts = ["What is 2+2?", "Write a haiku about autumn.", "Name three uses of copper. " * 3]
    together = generate(m, m.tokenizer, prompts, 32, chat=True)
    for got, p in zip(together, prompts):
        want = generate(m, m.tokenizer, p, 32, chat=True)
        assert got.token_ids == want.token_ids and got.text == want.text and got.finish_reason == want.finish_reason
