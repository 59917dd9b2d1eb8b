"""KV caches hold exactly the accepted sequence: after forwards, rollbacks, every decoding step, EOS and limits."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec import CompositeDrafter, HFAdapter, ModelDrafter, NativeLM, generate, load_model, speculative_generate
from tiny import save_tiny, tiny_gpt2, tiny_hf_model

ATOL = 1e-5
PROMPT = [50, 36, 23, 6, 24, 24, 12, 58, 1]  # its greedy output is varied, with a new token at index 6


# ----------------------------------------------------------------------------- helpers


def kv_of(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) of the cached positions, shape [1, kv_heads, cache_len, head_dim]."""
    if isinstance(model, NativeLM):
        L = model.cache_len
        c = model.cache
        return [(c.k[i, :, :, :L], c.v[i, :, :, :L]) for i in range(c.k.shape[0])]
    assert isinstance(model, HFAdapter)
    if model._cache is None:
        return []
    return [(layer.keys, layer.values) for layer in model._cache.layers]


def from_scratch(model, ids):
    """(K/V, logits) of one forward over `ids` by a twin of `model` with a fresh cache."""
    twin = model.fork()
    twin.reset(max(len(ids), 1))
    logits = twin.forward(ids) if ids else None
    return kv_of(twin), logits


def assert_cache_holds(model, ids):
    """The model's cache holds the K/V of exactly `ids`, as if it had run them from scratch."""
    ids = list(ids)
    assert model.cache_len == len(ids)
    got = kv_of(model)
    if not ids:
        assert all(k.shape[-2] == 0 and v.shape[-2] == 0 for k, v in got)
        return
    want, _ = from_scratch(model, ids)
    assert len(got) == len(want)
    for (gk, gv), (wk, wv) in zip(got, want):
        assert gk.shape == wk.shape and gv.shape == wv.shape
        torch.testing.assert_close(gk, wk, atol=ATOL, rtol=0)
        torch.testing.assert_close(gv, wv, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("cache")
    return {kind_seed: save_tiny(d / f"{kind_seed[0]}-{kind_seed[1]}", *kind_seed)
            for kind_seed in [("llama", 0), ("llama", 1), ("qwen2", 0)]}


@pytest.fixture(scope="module")
def target(ckpts):
    return load_model(ckpts[("llama", 0)], dtype="float32")


@pytest.fixture(scope="module")
def poor(ckpts):
    return load_model(ckpts[("llama", 1)], dtype="float32")


@pytest.fixture(scope="module")
def noisy(ckpts):
    model = load_model(ckpts[("llama", 0)], dtype="float32")
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.15 * p.std())
    return model


MODEL_KINDS = ["native-llama", "native-qwen2", "adapter-llama", "adapter-gpt2"]


@pytest.fixture(scope="module", params=MODEL_KINDS)
def any_model(request, ckpts):
    kind = request.param
    if kind == "native-llama":
        return load_model(ckpts[("llama", 0)], dtype="float32")
    if kind == "native-qwen2":
        return load_model(ckpts[("qwen2", 0)], dtype="float32")
    if kind == "adapter-llama":
        return HFAdapter(tiny_hf_model("llama", seed=0))
    return HFAdapter(tiny_gpt2())


# ----------------------------------------------------------------------------- (a) forward / rollback


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("forward"), st.lists(st.integers(0, 63), min_size=1, max_size=6)),
        st.tuples(st.just("rollback"), st.floats(0.0, 1.0)),
    ),
    min_size=1, max_size=12,
)


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_random_forwards_and_rollbacks(any_model, ops):
    model = any_model
    model.reset(80)
    seq: list[int] = []
    for op, arg in ops:
        if op == "forward":
            logits = model.forward(arg)
            seq += arg
            # the block's logits are those of a full pass over the sequence
            _, ref = from_scratch(model, seq)
            torch.testing.assert_close(logits, ref[-len(arg):], atol=1e-4, rtol=0)
        else:
            length = int(arg * len(seq))
            model.rollback(length)
            del seq[length:]
        assert_cache_holds(model, seq)


def test_seeded_forwards_and_rollbacks(any_model):
    """The same as the property test, a longer deterministic walk that ends near capacity."""
    g = torch.Generator().manual_seed(11)
    model = any_model
    model.reset(64)
    seq: list[int] = []
    while len(seq) < 58:
        n = int(torch.randint(1, 7, (), generator=g))
        block = torch.randint(0, 64, (n,), generator=g).tolist()
        model.forward(block)
        seq += block
        if torch.rand((), generator=g) < 0.5:
            keep = int(torch.randint(max(0, len(seq) - n - 2), len(seq) + 1, (), generator=g))
            model.rollback(keep)
            del seq[keep:]
        assert_cache_holds(model, seq)


def test_rollback_bounds(any_model):
    model = any_model
    model.reset(16)
    model.forward([1, 2, 3])
    for bad in (-1, 4):
        with pytest.raises(ValueError):
            model.rollback(bad)
    assert_cache_holds(model, [1, 2, 3])
    model.rollback(3)  # no-op
    assert_cache_holds(model, [1, 2, 3])
    model.rollback(0)
    assert_cache_holds(model, [])
    model.forward([4, 5])
    assert_cache_holds(model, [4, 5])


def test_reset_empties_the_cache(any_model):
    model = any_model
    model.reset(16)
    model.forward([9, 8, 7, 6])
    model.reset(8)  # smaller: the native cache may keep its buffer, but nothing in it counts
    assert model.cache_len == 0
    model.forward([1, 2])
    assert_cache_holds(model, [1, 2])


def test_native_cache_overflow_raises(target):
    target.reset(4)
    target.forward([1, 2, 3])
    with pytest.raises(ValueError, match="overflow"):
        target.forward([4, 5])


def test_native_and_transformers_caches_agree(target):
    """Our static cache and transformers' DynamicCache hold the same (post-RoPE) K/V."""
    adapter = HFAdapter(tiny_hf_model("llama", seed=0))
    for m in (target, adapter):
        m.reset(len(PROMPT))
        m.forward(PROMPT[:4])
        m.forward(PROMPT[4:])
    for (nk, nv), (hk, hv) in zip(kv_of(target), kv_of(adapter), strict=True):
        torch.testing.assert_close(nk, hk, atol=ATOL, rtol=0)
        torch.testing.assert_close(nv, hv, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- (b) during speculative decoding


def checked_speculative(target_model, drafter, prompt, max_tokens, k, **kw):
    """speculative_generate, checking both caches after every step from the stream callback."""
    out: list[int] = []
    chunks: list[list[int]] = []
    draft_lens: list[int] = []

    def stream(new):
        out.extend(new)
        chunks.append(list(new))
        accepted = prompt + out
        # target: everything accepted but the pending last token
        assert target_model.cache_len == len(prompt) + len(out) - 1
        assert_cache_holds(target_model, accepted[:-1])
        model_drafter = drafter.model if isinstance(drafter, CompositeDrafter) else drafter
        if isinstance(model_drafter, ModelDrafter):
            dm = model_drafter.model
            assert dm is not target_model
            n = dm.cache_len
            assert n <= len(accepted) - 1
            # a prefix of the accepted sequence (so never a rejected token)
            assert_cache_holds(dm, accepted[:n])
            assert model_drafter._seen[0] == accepted[:n]
            draft_lens.append(n)

    res = speculative_generate(target_model, drafter, None, prompt, max_tokens, num_draft_tokens=k,
                               stream=stream, **kw)
    assert out == res.token_ids
    return res, chunks, draft_lens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("draft_name", ["poor", "noisy", "poor-hf"])
@pytest.mark.parametrize("target_name", ["native", "adapter"])
def test_caches_consistent_every_step(target_name, draft_name, temperature, target, poor, noisy):
    target_model = target if target_name == "native" else HFAdapter(tiny_hf_model("llama", seed=0))
    draft_model = {"poor": poor, "noisy": noisy, "poor-hf": HFAdapter(tiny_hf_model("qwen2", seed=2))}[draft_name]
    drafter = ModelDrafter(draft_model)
    res, chunks, draft_lens = checked_speculative(target_model, drafter, PROMPT, 30, 4,
                                                  temperature=temperature, seed=123)
    assert len(res.token_ids) == 30 and res.finish_reason == "length"
    assert len(chunks) == res.stats.target_calls
    assert res.stats.draft_calls > 0
    if draft_name != "noisy":
        assert res.stats.accepted < res.stats.drafted  # rejections happened
    # the drafter's cache did follow the sequence
    assert max(draft_lens) >= len(PROMPT) + len(res.token_ids) - 1 - 4
    if temperature == 0:
        assert res.token_ids == generate(target_model, None, PROMPT, 30).token_ids


def test_caches_consistent_self_draft(target):
    """The target drafting for itself: the fork's cache is separate and follows a full-accept pattern."""
    res, _, draft_lens = checked_speculative(target, ModelDrafter(target), PROMPT, 25, 4)
    assert res.stats.acceptance_rate == 1.0
    assert draft_lens[-1] <= len(PROMPT) + 25 - 1


# ----------------------------------------------------------------------------- (c) EOS and max_tokens


def eos_positions(tokens, around=6, count=4) -> list[int]:
    """Positions i whose token does not occur earlier (so EOS = tokens[i] stops exactly at i), nearest `around`."""
    first = [i for i in range(len(tokens)) if tokens[i] not in tokens[:i]]
    return sorted(sorted(first, key=lambda i: (abs(i - around), i))[:count])


@pytest.fixture(scope="module")
def free_run(target):
    out = generate(target, None, PROMPT, 16).token_ids
    positions = eos_positions(out)
    assert 6 in positions
    return out, positions


def with_eos(model, eos):
    twin = model.fork()
    twin.eos_token_ids = (eos,)
    return twin


def test_eos_plain_generate(target, free_run):
    out, positions = free_run
    for i in positions + [0]:
        m = with_eos(target, out[i])
        res = generate(m, None, PROMPT, 16)
        assert res.token_ids == out[:i + 1]
        assert res.finish_reason == "eos" and res.token_ids[-1] == out[i]
        assert res.stats.generated == i + 1 == res.stats.target_calls
        assert_cache_holds(m, PROMPT + out[:i])


@pytest.mark.parametrize("draft_name, k", [("self", 8), ("self", 1), ("self", 2), ("poor", 4), ("noisy", 3)])
def test_eos_speculative(draft_name, k, target, poor, noisy, free_run):
    out, positions = free_run
    for i in positions + [0]:
        m = with_eos(target, out[i])
        draft = {"self": m, "poor": poor, "noisy": noisy}[draft_name]
        drafter = ModelDrafter(draft)
        res, chunks, _ = checked_speculative(m, drafter, PROMPT, 16, k)
        assert res.token_ids == out[:i + 1] == generate(m, None, PROMPT, 16).token_ids
        assert res.finish_reason == "eos" and res.token_ids[-1] == out[i]
        assert out[i] not in res.token_ids[:-1]
        # after the end both caches are consistent (checked in the stream too)
        assert_cache_holds(m, PROMPT + out[:i])
        assert_cache_holds(drafter.model, (PROMPT + out[:i])[:drafter.model.cache_len])
        last = chunks[-1]
        if draft_name == "self" and i > 0:
            if k == 8 and i <= 8:
                # the EOS came inside the first block of accepted drafts (out[1..9]), cut after it
                assert len(chunks) == 2 and last == out[1:i + 1]
            if k == 1 and i % 2 == 0:
                # steps emit [draft, bonus]: an EOS at an even index is the bonus token
                assert len(last) == 2 and last[1] == out[i]


def test_eos_at_bonus_and_inside_block_are_exercised(free_run):
    """The position set covers an EOS inside an accepted k=8 block and an EOS as a k=1 bonus token."""
    _, positions = free_run
    assert any(i % 2 == 0 and i > 0 for i in positions)
    assert any(1 <= i <= 8 for i in positions)


@pytest.mark.parametrize("draft_name", ["self", "poor"])
def test_max_tokens_mid_block(draft_name, target, poor):
    ref = generate(target, None, PROMPT, 10).token_ids
    for max_tokens in range(1, 11):
        drafter = ModelDrafter(target if draft_name == "self" else poor)
        res, chunks, _ = checked_speculative(target, drafter, PROMPT, max_tokens, 4)
        assert res.finish_reason == "length"
        assert len(res.token_ids) == max_tokens and res.token_ids == ref[:max_tokens]
        assert sum(map(len, chunks)) == max_tokens
        assert_cache_holds(target, PROMPT + ref[:max_tokens - 1])
        # never drafts a token that could not be kept
        assert res.stats.drafted <= 4 * (res.stats.target_calls - 1)
        if draft_name == "self":
            assert res.stats.drafted == res.stats.accepted == max_tokens - res.stats.target_calls


def test_max_tokens_zero_runs_nothing(target, poor, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the model ran")

    for cls in (NativeLM, HFAdapter):
        monkeypatch.setattr(cls, "forward", boom)
        monkeypatch.setattr(cls, "reset", boom)
    streamed = []
    for res in (generate(target, None, PROMPT, 0, stream=streamed.append),
                speculative_generate(target, poor, None, PROMPT, 0, stream=streamed.append),
                speculative_generate(tiny_hf_model("llama"), poor, None, PROMPT, 0, temperature=1.0, seed=0)):
        assert res.token_ids == [] and res.finish_reason == "length"
        assert res.prompt_ids == PROMPT
        assert res.stats.target_calls == res.stats.draft_calls == res.stats.generated == 0
    assert streamed == []


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_consistent_with_composite_drafter(temperature, target, noisy):
    """Lookup steps skip the model; its cache must stay a prefix and catch up when it drafts."""
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 5, 6, 7, 30, 31]
    drafter = CompositeDrafter(noisy)
    res, _, draft_lens = checked_speculative(target, drafter, prompt, 30, 4, temperature=temperature, seed=5)
    assert len(res.token_ids) == 30
    assert res.stats.draft_calls > 0 and res.stats.drafted > 0
    if temperature == 0:
        assert res.token_ids == generate(target, None, prompt, 30).token_ids
