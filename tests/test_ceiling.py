"""The benchmark's ceilings: replaying a drafter against the target's greedy output must give
exactly what real speculative decoding accepts, and the fewest passes must be the true minimum."""
from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import ModelDrafter, NgramDrafter, generate, load_model, speculative_generate
from specdec.bench.ceiling import ceilings, draft_runs, fewest_passes, lookup_runs
from tiny import save_tiny


def passes_by_brute_force(runs: list[int]) -> int:
    @functools.cache
    def fewest(t):
        return 0 if t >= len(runs) else 1 + min(fewest(t + a + 1) for a in range(runs[t] + 1))

    return fewest(1)


def passes_accepting_all(runs: list[int]) -> int:
    """What a fixed k does: accept every draft that is right (runs are capped at k)."""
    t, passes = 1, 0
    while t < len(runs):
        t, passes = t + runs[t] + 1, passes + 1
    return passes


def test_fewest_passes_by_hand():
    assert fewest_passes([0]) == 0  # one token, from the prefill
    assert fewest_passes([0] * 9) == 8  # nothing accepted: one pass per token
    assert fewest_passes([0, 7, 0, 0, 0, 0, 0, 0, 0]) == 1
    # Accepting everything at position 1 lands on a dead end (4, 5, ...); stopping at 2 reaches 8.
    runs = [0, 2, 5, 0, 0, 0, 0, 0, 0]
    assert passes_accepting_all(runs) == 6 and fewest_passes(runs) == 3


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=40))
def test_fewest_passes_is_the_minimum(runs):
    runs[0] = 0
    assert fewest_passes(runs) == passes_by_brute_force(runs)


def test_lookup_runs_by_hand():
    prompt, output = [1, 2, 3, 4, 5], [9, 1, 2, 3, 7]
    # t=1: "9" was never seen. t=2: "1" continues 2 3 4 ..., right twice. t=3: "1 2" continues
    # 3 4 ..., right once. t=4: "1 2 3" continues 4, wrong.
    assert lookup_runs(prompt, output, k_max=16) == [0, 0, 2, 1, 0]
    assert lookup_runs(prompt, output, k_max=1) == [0, 0, 1, 1, 0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("ceiling")
    target = load_model(save_tiny(d / "target", "llama", seed=0), dtype="float32")
    noisy = load_model(d / "target", dtype="float32")  # the target plus noise: right often, not always
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in noisy.module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.15 * p.std())
    return target, noisy


PROMPTS = [[5, 9, 2, 33, 7, 5, 9, 2, 40, 12, 7, 5], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [60, 3, 17, 45, 8, 22]]


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_replay_is_what_speculative_decoding_accepts(tiny, prompt, k):
    target, noisy = tiny
    output = generate(target, None, prompt, 40).token_ids
    for drafter, runs in [(NgramDrafter(), lookup_runs(prompt, output, k)),
                          (ModelDrafter(noisy), draft_runs(ModelDrafter(noisy), prompt, output, k))]:
        spec = speculative_generate(target, drafter, None, prompt, 40, num_draft_tokens=k)
        assert spec.token_ids == output
        assert spec.stats.target_calls - 1 == passes_accepting_all(runs), drafter
        assert fewest_passes(runs) <= passes_accepting_all(runs)


def test_the_noisy_draft_is_right_only_sometimes(tiny):
    # so that the replay above is checked on partial acceptances, not only full or none
    target, noisy = tiny
    runs = [r for p in PROMPTS for r in draft_runs(ModelDrafter(noisy), p, generate(target, None, p, 40).token_ids, 3)[1:]]
    assert 0 in runs and 1 in runs and 3 in runs


def test_self_draft_is_right_to_the_end(tiny):
    target, _ = tiny
    prompt = PROMPTS[0]
    output = generate(target, None, prompt, 20).token_ids
    assert draft_runs(ModelDrafter(target), prompt, output, 16) == [0] + [min(len(output) - t, 16) for t in range(1, 20)]


def test_ceilings_pool_by_category(tiny):
    target, noisy = tiny
    prompts = [SimpleNamespace(id=f"p{i}", category="a" if i < 2 else "b", ids=p) for i, p in enumerate(PROMPTS)]
    outputs = {p.id: generate(target, None, p.ids, 30).token_ids for p in prompts}
    c = ceilings(prompts, outputs, 8, ModelDrafter(noisy))
    assert c["k_max"] == 8 and set(c) == {"k_max", "lookup", "draft", "lookup_or_draft"}
    runs = {p.id: lookup_runs(p.ids, outputs[p.id], 8) for p in prompts}
    tokens_a = sum(len(outputs[i]) - 1 for i in ("p0", "p1"))
    assert c["lookup"]["categories"]["a"] == pytest.approx(tokens_a / sum(fewest_passes(runs[i]) for i in ("p0", "p1")))
    assert c["lookup"]["overall"] == pytest.approx(sum(len(o) - 1 for o in outputs.values()) / sum(fewest_passes(r) for r in runs.values()))
    for where in ("a", "b"):
        best = c["lookup_or_draft"]["categories"][where]
        assert best >= max(c["lookup"]["categories"][where], c["draft"]["categories"][where])
    assert set(ceilings(prompts, outputs, 8)) == {"k_max", "lookup"}
