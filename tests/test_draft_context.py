"""A draft's own context limits only the draft: past it, steps are plain decoding steps and
the output is the target's, greedy and sampled. The target's context is still checked."""
from __future__ import annotations

import pytest
import torch

from specdec import CompositeDrafter, ModelDrafter, generate, load_model, speculative_generate
from tiny import save_tiny

DRAFT_CONTEXT = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft-context")
    target = load_model(save_tiny(d / "target", "llama", seed=0), dtype="float32")  # 256 positions
    # The target's own weights with a 64-position context: right wherever it may draft.
    short = load_model(save_tiny(d / "short", "llama", seed=0, max_position_embeddings=DRAFT_CONTEXT),
                       dtype="float32")
    assert target.max_context == 256 and short.max_context == DRAFT_CONTEXT
    return target, short


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(1, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("k", [4, "auto"])
@pytest.mark.parametrize("kind", ["model", "composite"])
def test_prompt_longer_than_the_draft_context(models, kind, k):
    target, short = models
    ids = prompt(200)
    drafter = ModelDrafter(short) if kind == "model" else CompositeDrafter(short)
    ref = generate(target, None, ids, 40)
    out = speculative_generate(target, drafter, None, ids, 40, num_draft_tokens=k)
    assert out.token_ids == ref.token_ids
    s = out.stats
    assert s.draft_calls == 0  # the draft never read the prompt, let alone drafted
    if kind == "model":
        assert s.drafted == 0 and s.plain_steps == s.target_calls - 1
    else:  # prompt lookup goes on past the model's context
        assert s.drafted > 0 and s.plain_steps < s.target_calls - 1


@pytest.mark.parametrize("k", [1, 4, 8, "auto"])
def test_generation_that_crosses_the_draft_context(models, k):
    # The prompt fits the draft; the answer runs past its 64 positions. The draft is the
    # target's own weights, so it is right up to its limit and every token there is accepted.
    target, short = models
    ids = prompt(40, seed=1)
    drafter = ModelDrafter(short)
    filled = []  # the draft's cache length after each of its passes
    forward = drafter.model.forward
    drafter.model.forward = lambda *a, **kw: (forward(*a, **kw), filled.append(drafter.model.cache_len))[0]
    ref = generate(target, None, ids, 60)
    out = speculative_generate(target, drafter, None, ids, 60, num_draft_tokens=k)
    assert out.token_ids == ref.token_ids
    s = out.stats
    assert s.drafted > 0 and s.accepted == s.drafted
    assert s.plain_steps > 0
    assert drafter.model.cache.capacity == DRAFT_CONTEXT and max(filled) <= DRAFT_CONTEXT
    if k in (4, 8):
        # Every draft is right, so steps start at 41, 46, ... (k=4) or 41, 50, 59 (k=8); the
        # last proposal there fits exactly: the draft used every one of its positions.
        assert max(filled) == DRAFT_CONTEXT


def test_sampled_output_with_a_draft_that_never_fits_is_plain_sampling(models):
    # Every step is a plain step, drawing the target's p with the same generator as `generate`.
    target, short = models
    ids = prompt(100, seed=2)
    for seed in range(3):
        ref = generate(target, None, ids, 30, temperature=1.0, seed=seed)
        out = speculative_generate(target, ModelDrafter(short), None, ids, 30, temperature=1.0, seed=seed)
        assert out.token_ids == ref.token_ids
        assert out.stats.plain_steps == out.stats.target_calls - 1


def test_raw_transformers_draft_with_a_shorter_context(models):
    import transformers

    target, _ = models
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32,
                                  bos_token_id=None, eos_token_id=None)
    short = transformers.GPT2LMHeadModel(cfg).eval()  # 32 positions, through the adapter
    for n in (10, 40):  # crosses its context; starts past it
        ids = prompt(n, seed=3)
        out = speculative_generate(target, short, None, ids, 40, num_draft_tokens=2)
        assert out.token_ids == generate(target, None, ids, 40).token_ids
        assert (out.stats.drafted > 0) == (n < 32) and out.stats.plain_steps > 0


def test_the_target_context_is_still_checked(models):
    target, short = models
    with pytest.raises(ValueError, match="context of 256"):
        speculative_generate(target, ModelDrafter(short), None, prompt(200), 57)
