"""Batched speculative decoding: `speculative_generate` with a list of prompts returns one
Generation per row, each exactly the row's own single-prompt run, whatever the drafter and k.

Rows have mixed prompt lengths, accept their own number of drafts a step (ragged blocks),
and finish at different steps (an EOS some rows write early; max_tokens inside a block).
Greedy rows equal plain greedy decoding for every drafter and k ("auto" included); sampled
rows at a fixed k equal their single runs seed for seed, stats included. Each row's
distribution is checked by chi-square in test_distribution.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from specdec import CompositeDrafter, ModelDrafter, NgramDrafter, generate, load_model, speculative_generate
from specdec.models.hf import HFAdapter

from tiny import needs_model, save_tiny, tiny_hf_model

SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             max_position_embeddings=512)
MAX_TOKENS = 23  # not a multiple of k + 1: rows reach max_tokens inside a block

g = torch.Generator().manual_seed(1)
# Repeats inside each prompt give prompt lookup something to match.
PROMPTS = [(torch.randint(0, 64, (int(n),), generator=g).tolist() * 2)[: 2 * int(n) - 1]
           for n in (3, 40, 2, 17, 9, 33, 5, 60)]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """pairs(dtype): a tiny target with an EOS that some rows write early, and a draft that
    agrees with it often but not always: the target's own weights, its last MLP perturbed."""
    d = tmp_path_factory.mktemp("bspec")
    save_tiny(d / "t", "llama", seed=2, **SHAPE)
    made = {}

    def get(dtype):
        if dtype not in made:
            made[dtype] = make_pair(d, dtype)
        return made[dtype]
    return get


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def models(request, pairs):
    return pairs(request.param)


def make_pair(d, dtype):
    target = load_model(d / "t", dtype=dtype)
    outs = [generate(target, None, p, MAX_TOKENS).token_ids for p in PROMPTS]
    target.eos_token_ids = (Counter(t for o in outs for t in o[3:]).most_common(1)[0][0],)
    draft = load_model(d / "t", dtype=dtype)  # its own tensors: the target is untouched
    with torch.no_grad():
        mlp = draft.module.model.layers[-1].mlp.down_proj.weight
        mlp.add_(torch.randn(mlp.shape, generator=torch.Generator().manual_seed(0)).to(mlp.dtype) * mlp.std())
    draft.eos_token_ids = target.eos_token_ids
    return target, draft


def drafter(kind, draft):
    return {"ngram": lambda: NgramDrafter(),
            "model": lambda: ModelDrafter(draft),
            "composite": lambda: CompositeDrafter(draft)}[kind]()


# float32 (torch, one sequence at a time) in full; bf16 (the kernel's batched ragged passes) in part.
GREEDY = ([("float32", b, kind, k) for b in (1, 2, 5, 8) for kind in ("ngram", "model", "composite")
           for k in (1, 3, "auto")]
          + [("bfloat16", b, kind, k) for b, k in ((5, 1), (8, 3), (8, "auto")) for kind in ("ngram", "model", "composite")])


@pytest.mark.parametrize("dtype, batch, kind, k", GREEDY, ids=["-".join(map(str, c)) for c in GREEDY])
def test_greedy_rows_are_the_targets_greedy_output(pairs, dtype, batch, kind, k):
    target, draft = pairs(dtype)
    prompts = PROMPTS[:batch]
    together = speculative_generate(target, drafter(kind, draft), None, prompts, MAX_TOKENS, num_draft_tokens=k)
    assert isinstance(together, list) and len(together) == batch
    for got, p in zip(together, prompts):
        want = generate(target, None, p, MAX_TOKENS)
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        assert got.prompt_ids == p and got.stats.generated == len(got.token_ids)
    s = [r.stats for r in together]
    assert sum(x.drafted for x in s) > 0 and sum(x.accepted for x in s) > 0
    if kind != "ngram" and k != "auto":  # (auto mostly takes plain steps: this draft costs what the target does)
        assert any(x.rejections for x in s)  # ragged: some blocks were cut short
    if batch == 8:
        assert {r.finish_reason for r in together} == {"eos", "length"}
    if not isinstance(k, str):  # a fixed k: each row went through exactly its own steps
        for got, p in zip(together, prompts):
            alone = speculative_generate(target, drafter(kind, draft), None, p, MAX_TOKENS, num_draft_tokens=k)
            for key in ("target_calls", "drafted", "accepted", "rejections", "plain_steps", "proposed_at",
                        "accepted_at"):
                assert getattr(got.stats, key) == getattr(alone.stats, key), key


@pytest.mark.parametrize("kind", ["ngram", "model", "composite"])
def test_sampled_rows_are_their_own_runs_seed_for_seed(models, kind):
    target, draft = models
    kw = dict(temperature=0.9, top_k=20, num_draft_tokens=3)
    seeds = [11, 3, 7, 7, 0, 5, 2, 9]
    together = speculative_generate(target, drafter(kind, draft), None, PROMPTS, MAX_TOKENS, seed=seeds, **kw)
    for got, s, p in zip(together, seeds, PROMPTS):
        alone = speculative_generate(target, drafter(kind, draft), None, p, MAX_TOKENS, seed=s, **kw)
        assert got.token_ids == alone.token_ids and got.finish_reason == alone.finish_reason
        assert (got.stats.drafted, got.stats.accepted) == (alone.stats.drafted, alone.stats.accepted)
    assert sum(r.stats.rejections for r in together) > 0
    # an int seed gives row i the seed s + i, as in generate
    together = speculative_generate(target, drafter(kind, draft), None, PROMPTS[:3], MAX_TOKENS, seed=50, **kw)
    for i, got in enumerate(together):
        alone = speculative_generate(target, drafter(kind, draft), None, PROMPTS[i], MAX_TOKENS, seed=50 + i, **kw)
        assert got.token_ids == alone.token_ids


def fresh_kv(model, ids):
    """K/V of `ids` run from an empty cache, as a single sequence."""
    twin = model.fork()
    twin.reset(len(ids) + 1)
    twin.forward(ids)
    n = len(ids)
    return twin.cache.k[:, 0, :, :n], twin.cache.v[:, 0, :, :n]


def test_caches_hold_each_rows_accepted_prefix_after_random_accepts(models):
    # Sampling with a draft that is often wrong: rows accept and reject at random, each its
    # own way. Afterwards each row of the target's cache holds exactly its accepted sequence
    # minus the pending token, and the draft's a prefix of it, with the K/V of a fresh run.
    target, draft = models
    d = ModelDrafter(draft)
    together = speculative_generate(target, d, None, PROMPTS[:5], 40, temperature=1.0, seed=4, num_draft_tokens=4)
    # (A fresh run computes the same K/V in blocks of other shapes: equal up to rounding. A
    # rejected draft's K/V left in place would be off by the size of the values themselves.)
    tol = dict(atol=1e-4, rtol=1e-3) if target.dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    for b, r in enumerate(together):
        seq = r.prompt_ids + r.token_ids
        assert target.cache.lengths[b] == len(seq) - 1
        n = target.cache.lengths[b]
        k, v = fresh_kv(target, seq[:-1])
        torch.testing.assert_close(target.cache.k[:, b, :, :n], k, **tol)
        torch.testing.assert_close(target.cache.v[:, b, :, :n], v, **tol)
        seen = d._seen[b]
        assert seen == seq[: len(seen)] and d.model.cache.lengths[b] == len(seen) > len(r.prompt_ids)
        k, v = fresh_kv(d.model, seen)
        torch.testing.assert_close(d.model.cache.k[:, b, :, :len(seen)], k, **tol)
    assert sum(r.stats.rejections for r in together) > 0 and sum(r.stats.accepted for r in together) > 0


def test_stream_gets_the_row_and_its_tokens(models):
    target, draft = models
    seen = {}
    together = speculative_generate(target, CompositeDrafter(draft), None, PROMPTS[:4], 12,
                                    stream=lambda row, ids: seen.setdefault(row, []).extend(ids))
    assert [seen[b] for b in range(4)] == [r.token_ids for r in together]


def test_batches_the_engines_cannot_run_are_refused_before_compute(models):
    target, draft = models
    hf = HFAdapter(tiny_hf_model("llama"))
    with pytest.raises(ValueError, match="the target .* runs one prompt at a time"):
        speculative_generate(hf, NgramDrafter(), None, [[1, 2], [3]], 5)
    with pytest.raises(ValueError, match="the draft .* runs one prompt at a time"):
        speculative_generate(target, ModelDrafter(hf), None, [[1, 2], [3]], 5)
    with pytest.raises(ValueError, match="3 seeds for 2 prompts"):
        speculative_generate(target, NgramDrafter(), None, [[1, 2], [3]], 5, seed=[1, 2, 3])
    assert not isinstance(speculative_generate(target, NgramDrafter(), None, PROMPTS[0], 5), list)
    assert len(speculative_generate(target, NgramDrafter(), None, [PROMPTS[0]], 5)) == 1


@needs_model
@pytest.mark.parametrize("k", [4, "auto"])
def test_the_embedded_model_and_shipped_draft_batched_equal_alone(k):
    # The default setup (composite of lookup and the shipped draft), bf16 through the kernel,
    # on prompts outside the suite.
    m = load_model("smollm2-135m-instruct", dtype="bfloat16")
    d = load_model("smollm2-135m-instruct-draft", dtype="bfloat16")
    prompts = ["What is 2+2?", "Write a haiku about autumn.", "Repeat after me: the quick brown fox jumps over "
               "the lazy dog. The quick brown fox jumps over the lazy dog.", "List three uses of copper."]
    together = speculative_generate(m, CompositeDrafter(d), m.tokenizer, prompts, 40, chat=True, num_draft_tokens=k)
    for got, p in zip(together, prompts):
        want = generate(m, m.tokenizer, p, 40, chat=True)
        assert got.token_ids == want.token_ids and got.text == want.text and got.finish_reason == want.finish_reason
    assert sum(r.stats.accepted for r in together) > 0
