"""The benchmark's ceilings: replaying a drafter against the target's greedy output must give
exactly what real speculative decoding accepts, and the fewest passes must be the true minimum."""
from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import (CompositeDrafter, Datastore, DatastoreDrafter, ModelDrafter, NgramDrafter, generate, load_model,
                     speculative_generate)
from specdec.bench.ceiling import (KINDS, ceilings, datastore_runs, draft_runs, fewest_passes, fewest_units, lookup_runs,
                                   offers, replay, replayed_units)
from specdec.schedule import AdaptiveK
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


def units_by_brute_force(runs: dict, cost: dict, draft_cost: dict) -> float:
    n = len(next(iter(runs.values())))

    @functools.cache
    def least(t):
        if t >= n:
            return 0.0
        return min([cost[1] + least(t + 1)] + [cost[j + 1] + j * draft_cost[s] + least(t + j + 1)
                                               for s, r in runs.items() for j in range(1, r[t] + 1)])

    return least(1)


def units_accepting_all(runs: list[int], cost: dict) -> float:
    """A schedule that drafts as far as the source is right (what the fewest passes do here)."""
    t, units = 1, 0.0
    while t < len(runs):
        t, units = t + runs[t] + 1, units + cost[runs[t] + 1]
    return units


def test_fewest_units_by_hand():
    flat = dict.fromkeys(range(1, 10), 1.0)
    runs = [0, 2, 5, 0, 0, 0, 0, 0, 0]
    # Flat pass costs and free drafts: the fewest passes are the fastest.
    assert fewest_units({"a": runs}, flat, {"a": 0.0}) == fewest_passes(runs) == 3
    # A 3-token pass at 2.5 one-token passes: two tokens for 2.5 loses to plain steps, so at
    # position 1 the perfect schedule takes a plain step, then the 6-token pass (cost 3) at 2.
    steep = {1: 1.0, 2: 1.5, 3: 2.5, 4: 2.6, 5: 2.7, 6: 3.0, 7: 3.1, 8: 3.2, 9: 3.3}
    assert fewest_units({"a": runs}, steep, {"a": 0.0}) == pytest.approx(1 + 3 + 1)
    assert units_accepting_all(runs, steep) == pytest.approx(2.5 + 5)  # 2 tokens, then 5 plain steps
    # Nothing worth drafting: plain decoding, a one-token pass a token.
    assert fewest_units({"a": [0, 1, 1, 1, 0]}, {1: 1.0, 2: 2.5}, {"a": 0.0}) == 4
    # A draft's own cost counts: at 0.6 a token its 5-token run (cost 2.7 + 3.0) no longer beats
    # six plain steps, where a free lookup with the same run does.
    assert fewest_units({"d": [0, 5, 0, 0, 0, 0, 0]}, steep, {"d": 0.6}) == 6
    assert fewest_units({"l": [0, 5, 0, 0, 0, 0, 0]}, steep, {"l": 0.0}) == pytest.approx(3.0)
    # Two sources: the best of them at each step.
    both = fewest_units({"l": [0, 0, 5, 0, 0, 0, 0, 0], "d": [0, 1, 0, 0, 0, 0, 0, 0]}, flat, {"l": 0.0, "d": 0.0})
    assert both == 2


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=30), st.lists(st.integers(0, 5), min_size=1, max_size=30),
       st.lists(st.floats(0.0, 1.0), min_size=6, max_size=6), st.floats(0.0, 0.5))
def test_fewest_units_is_the_minimum(a, b, steps, c):
    n = min(len(a), len(b))
    runs = {"a": [0] + a[1:n], "b": [0] + b[1:n]}
    cost = {1: 1.0}
    for j, step in enumerate(steps, start=2):  # non-decreasing pass costs
        cost[j] = cost[j - 1] + step
    draft_cost = {"a": 0.0, "b": c}
    assert fewest_units(runs, cost, draft_cost) == pytest.approx(units_by_brute_force(runs, cost, draft_cost))
    flat = dict.fromkeys(cost, 1.0)
    assert fewest_units({"a": runs["a"]}, flat, {"a": 0.0}) == fewest_passes(runs["a"])


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


def test_datastore_replay_is_what_speculative_decoding_accepts(tiny):
    target, noisy = tiny
    # A store of the target's own writing on other prompts (and a noisy model's), so that its
    # proposals are right sometimes, not always.
    writing = [generate(m, None, p, 30).token_ids for m in (target, noisy) for p in ([7, 7, 3], [2, 40, 12], [9, 9])]
    store = Datastore(writing, target.vocab_size, "tiny")
    hits = []
    for prompt in PROMPTS:
        output = generate(target, None, prompt, 40).token_ids
        for k in (1, 4):
            runs = datastore_runs(store, prompt, output, k)
            spec = speculative_generate(target, CompositeDrafter(lookup=NgramDrafter(min_ngram=99, max_ngram=99),
                                                                 datastore=DatastoreDrafter(store)),
                                        None, prompt, 40, num_draft_tokens=k)
            assert spec.token_ids == output
            assert spec.stats.target_calls - 1 == passes_accepting_all(runs), (prompt, k)
            hits += runs[1:]
    assert 0 in hits and max(hits) >= 2


class CostedAdaptiveK(AdaptiveK):
    """auto as the loop runs it, but measuring each pass at a given cost table instead of the
    clock (and drafting as free), so that its choices are what the replay's would be."""

    def __init__(self, pass_cost, k_max):
        super().__init__(k_max)
        self.pass_cost, self.steps = pass_cost, []

    def update_batch(self, outcomes, draft_seconds, verify_seconds):
        (source, drafted, accepted), = outcomes
        self.steps.append((source, drafted, accepted))
        super().update_batch(outcomes, 0.0, self.pass_cost[drafted + 1])


@pytest.mark.parametrize("costs", ["flat", "steep"])
def test_auto_replayed_makes_the_loops_choices(tiny, costs):
    target, noisy = tiny
    writing = [generate(m, None, p, 30).token_ids for m in (target, noisy) for p in ([7, 7, 3], [2, 40, 12], [9, 9])]
    store = Datastore(writing, target.vocab_size, "tiny")
    # Blocks nearly free (the native kernel) or dear (llama.cpp's bf16 blocks): auto drafts long, or little.
    pass_cost = {n: 1.0 + (0.02 if costs == "flat" else 0.4) * (n - 1) for n in range(1, 18)}
    drafted_any = 0
    for prompt in PROMPTS:
        output = generate(target, None, prompt, 40).token_ids
        assert len(output) == 40  # no EOS: the loop's last drafts are cut where the replay's are
        for make in (NgramDrafter, lambda: CompositeDrafter(datastore=DatastoreDrafter(store))):
            loop = CostedAdaptiveK(pass_cost, 16)
            assert speculative_generate(target, make(), None, prompt, 40, num_draft_tokens=loop).token_ids == output
            steps = offers(make(), prompt, output, 16)
            played = [(source if drafted else None, drafted, accepted)
                      for _, _, source, drafted, accepted in replay(AdaptiveK(16), steps, pass_cost)]
            assert played == [(source if drafted else None, drafted, accepted) for source, drafted, accepted in loop.steps]
            units = replayed_units(steps, pass_cost, 16)
            assert units == pytest.approx(sum(pass_cost[d + 1] for _, d, _ in played))
            # No schedule beats the perfect one on the same offers.
            families = {}
            for t, here in enumerate(steps):
                for name, _, acc, _ in here:
                    families.setdefault(name.rstrip("0123456789"), [0] * len(output))[t] = max(
                        families.get(name.rstrip("0123456789"), [0] * len(output))[t], acc)
            assert units >= fewest_units(families or {"none": [0] * len(output)}, pass_cost,
                                         dict.fromkeys(families, 0.0)) - 1e-9
            drafted_any += sum(d for _, d, _ in played)
    assert drafted_any > 0


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


def test_ceilings_with_a_datastore_and_pass_costs(tiny):
    target, noisy = tiny
    prompts = [SimpleNamespace(id=f"p{i}", category="a" if i < 2 else "b", ids=p) for i, p in enumerate(PROMPTS)]
    outputs = {p.id: generate(target, None, p.ids, 30).token_ids for p in prompts}
    store = Datastore([generate(noisy, None, p, 30).token_ids for p in ([7, 7, 3], [2, 40, 12])], target.vocab_size)
    flat = dict.fromkeys(range(1, 10), 1.0)
    c = ceilings(prompts, outputs, 8, ModelDrafter(noisy), store, flat)
    kinds = {"lookup", "datastore", "lookup_or_datastore", "draft", "lookup_or_draft", "all_three"}
    assert set(c) == {"k_max", "speedup"} | kinds and set(c["speedup"]) == {"end_to_end"} | kinds
    assert c["speedup"]["end_to_end"] is False
    for kind in kinds:  # flat costs, free drafting, decode only: each prompt's tokens per pass at best
        ratios = []
        for p in prompts:
            sources = {"lookup": lookup_runs, "datastore": lambda i, o, k: datastore_runs(store, i, o, k),
                       "draft": lambda i, o, k: draft_runs(ModelDrafter(noisy), i, o, k)}
            runs = [sources[s](p.ids, outputs[p.id], 8) for s in KINDS[kind]]
            best = [max(r[t] for r in runs) for t in range(len(outputs[p.id]))]
            ratios.append((len(outputs[p.id]) - 1) / fewest_passes(best))
        assert c["speedup"][kind]["overall"] == pytest.approx(float(np.exp(np.mean(np.log(ratios))))), kind
    assert c["all_three"]["overall"] >= max(c[k]["overall"] for k in kinds)
    # A draft token charged its cost: the draft's perfect schedule slows, the free sources' does not.
    charged = {"c": 0.5, "measured": "in the loop"}
    dear = ceilings(prompts, outputs, 8, ModelDrafter(noisy), store, flat, charged)
    assert dear["draft_cost"] == charged
    assert dear["speedup"]["draft"]["overall"] < c["speedup"]["draft"]["overall"]
    assert dear["speedup"]["lookup_or_datastore"] == c["speedup"]["lookup_or_datastore"]
    # auto itself, replayed through the same offers: never above the perfect schedule.
    auto = ceilings(prompts, outputs, 8, None, store, flat, None, None, auto_k_max=8)
    assert set(auto["replayed"]) == {"k_max", "lookup", "lookup_or_datastore"} and auto["replayed"]["k_max"] == 8
    for kind in ("lookup", "lookup_or_datastore"):
        for where in ("a", "b"):
            assert 1.0 <= auto["replayed"][kind]["categories"][where] <= auto["speedup"][kind]["categories"][where] + 1e-9
    assert "replayed" not in c
    # End to end: the prefill, the same work for both, dilutes the decode speedup.
    plain = {p.id: (1.0, 0.5) for p in prompts}
    e2e = ceilings(prompts, outputs, 8, None, store, flat, None, plain)["speedup"]
    assert e2e["end_to_end"] is True
    decode = c["speedup"]["lookup_or_datastore"]["categories"]["b"]  # one prompt in "b"
    assert e2e["lookup_or_datastore"]["categories"]["b"] == pytest.approx(1 / (0.5 + 0.5 / decode))
