"""Greedy speculative decoding is greedy decoding, token for token, whatever the draft."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from specdec import (CompositeDrafter, Datastore, HFAdapter, ModelDrafter, NgramDrafter, generate, load_model,
                     speculative_generate)
from specdec.schedule import AdaptiveK
from tiny import CONFIGS, save_tiny, tiny_gpt2, tiny_hf_model

MAX_TOKENS = 24


PROMPTS = {
    "short": [7],
    "random": [3, 41, 17, 59, 8, 22, 36, 1, 50],
    "repeated": [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 5, 6, 7],
}
DRAFTS = ["target", "poor", "noisy", "ngram", "raw-hf", "composite", "head", "store", "all-three"]
KS = [1, 2, 4, 8, "auto"]


def hf_greedy(hf_model, prompt, n) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, min_new_tokens=n, max_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_stats(res, *, drafter_has_model: bool):
    s = res.stats
    assert s.generated == len(res.token_ids)
    assert 1 <= s.target_calls <= s.generated
    assert 0 <= s.accepted <= s.drafted
    # every target call but the prefill adds accepted drafts + one token
    assert s.generated == 1 + s.accepted + (s.target_calls - 1)
    if drafter_has_model is True:
        assert s.draft_calls >= 1 if s.drafted else s.draft_calls == 0
    elif drafter_has_model is False:
        assert s.draft_calls == 0
    per = s.accepted_per_position
    assert all(0.0 <= x <= 1.0 for x in per)
    if len(set(s.proposed_at)) <= 1:
        # Every step proposed the same number of drafts: the rate can only fall with the position.
        # (With varying proposal lengths it can rise; see test_accepted_per_position_with_variable_proposals.)
        assert all(a >= b for a, b in zip(per, per[1:])), per
    assert len(per) <= len(s.proposed_at) and len(s.accepted_at) <= len(s.proposed_at)
    assert sum(s.accepted_at) == s.accepted and sum(s.proposed_at) == s.drafted
    if s.drafted:
        assert 0.0 <= s.acceptance_rate <= 1.0
    else:
        assert math.isnan(s.acceptance_rate)
    assert s.tokens_per_target_call >= 1.0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("greedy")
    target = load_model(save_tiny(d / "target", "llama", seed=0), dtype="float32")
    poor = load_model(save_tiny(d / "poor", "llama", seed=1), dtype="float32")
    # The target's weights plus noise: agrees often but not always, so partial accepts happen.
    noisy = load_model(d / "target", dtype="float32")
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in noisy.module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.15 * p.std())
    # A datastore of what the noisy model writes: its continuations agree with the target's in part.
    writes = [generate(noisy, None, [int(t) for t in torch.randint(0, 64, (3,), generator=g)], 40).token_ids
              for _ in range(40)]
    return {"target": target, "poor": poor, "noisy": noisy, "hf_target": tiny_hf_model("llama", seed=0),
            "raw_hf_draft": tiny_hf_model("qwen2", seed=2), "store": Datastore(writes, 64)}


@pytest.fixture(scope="module")
def reference(models):
    """Plain greedy output of the target for each prompt."""
    return {name: generate(models["target"], None, p, MAX_TOKENS).token_ids for name, p in PROMPTS.items()}


def make_draft(kind, models):
    if kind == "target":
        return models["target"]
    if kind in ("poor", "noisy"):
        return models[kind]
    if kind == "ngram":
        return NgramDrafter()
    if kind == "composite":  # lookup where the context repeats, the noisy model elsewhere
        return CompositeDrafter(models["noisy"])
    if kind == "head":  # scores only every other token: it can never propose the rest
        return ModelDrafter(models["noisy"], head_tokens=list(range(0, models["noisy"].vocab_size, 2)))
    if kind == "store":  # lookup, else the datastore's continuation: no model
        return CompositeDrafter(datastore=models["store"])
    if kind == "all-three":  # lookup, else the datastore, else the noisy model
        return CompositeDrafter(models["noisy"], datastore=models["store"])
    return models["raw_hf_draft"]


def test_plain_greedy_matches_transformers_generate(models, reference):
    for name, prompt in PROMPTS.items():
        assert reference[name] == hf_greedy(models["hf_target"], prompt, MAX_TOKENS), name


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_plain_greedy_matches_transformers_every_kind(kind, tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp(kind) / kind, kind, seed=3)
    native = load_model(path, dtype="float32")
    hf = tiny_hf_model(kind, seed=3)
    prompt = PROMPTS["random"]
    ours = generate(native, None, prompt, 16)
    assert ours.finish_reason == "length" and len(ours.token_ids) == 16
    assert ours.token_ids == hf_greedy(hf, prompt, 16)
    # the same model through the adapter, as a raw transformers model
    assert generate(hf, None, prompt, 16).token_ids == ours.token_ids


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("draft_kind", DRAFTS)
@pytest.mark.parametrize("prompt_name", sorted(PROMPTS))
def test_speculative_equals_greedy(prompt_name, draft_kind, k, models, reference):
    res = speculative_generate(models["target"], make_draft(draft_kind, models), None, PROMPTS[prompt_name],
                               MAX_TOKENS, num_draft_tokens=k)
    assert res.token_ids == reference[prompt_name]
    assert res.finish_reason == "length"
    assert res.prompt_ids == PROMPTS[prompt_name]
    assert res.text is None
    check_stats(res, drafter_has_model={"ngram": False, "composite": None, "head": None,
                                        "store": False, "all-three": None}.get(draft_kind, True))
    assert len(res.stats.proposed_at) <= (AdaptiveK().k_max if k == "auto" else k)
    if k == "auto":
        return  # the schedule picks k per step (0 included): only the output is pinned down
    if draft_kind == "target":
        assert res.stats.acceptance_rate == 1.0
        assert res.stats.tokens_per_target_call > 1.0
        assert res.stats.accepted_per_position == [1.0] * len(res.stats.accepted_per_position)
        # k accepted drafts + 1 token per verification pass
        assert res.stats.target_calls == 1 + math.ceil((MAX_TOKENS - 1) / (k + 1))
    if draft_kind == "noisy":
        assert 0 < res.stats.accepted < res.stats.drafted  # partial acceptance exercised


def test_a_schedule_object_carries_what_it_learned_across_calls(models, reference):
    # num_draft_tokens=AdaptiveK(): the schedule a call ends with is the next call's start.
    schedule = AdaptiveK()
    draft = make_draft("composite", models)
    first = speculative_generate(models["target"], draft, None, PROMPTS["repeated"], MAX_TOKENS,
                                 num_draft_tokens=schedule)
    learned = {name: list(s.tries) for name, s in schedule.sources.items()}
    assert first.token_ids == reference["repeated"] and learned and any(learned.values())
    assert schedule.verify_n  # and the verify passes it timed
    second = speculative_generate(models["target"], draft, None, PROMPTS["random"], MAX_TOKENS,
                                  num_draft_tokens=schedule)
    assert second.token_ids == reference["random"]
    assert sum(sum(s.tries) for s in schedule.sources.values()) != sum(sum(t) for t in learned.values())


def test_lookup_sources_and_proposals():
    from specdec.sampling import SamplingParams

    greedy = SamplingParams(0.0)
    ngram = NgramDrafter(max_ngram=3)
    ids = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 1, 2, 3]
    assert ngram.sources(ids) == ("lookup3",)  # 1 2 3 was seen, followed by 4 5 9
    assert ngram.propose(ids, 2, greedy, None) == [4, 5]
    assert ngram.sources([8, 2, 3, 4, 2, 3]) == ("lookup2",)  # the latest match of the longest suffix
    assert ngram.propose([8, 2, 3, 4, 2, 3], 8, greedy, None) == [4, 2, 3]
    assert ngram.sources([1, 2, 3]) == () and ngram.propose([1, 2, 3], 4, greedy, None) == []


def test_lookup_finds_what_a_window_by_window_search_finds():
    # find_match extends only the places where the last token occurred; the plain definition
    # (every n-wide window, longest n first, latest occurrence) must agree on every input.
    import numpy as np

    from specdec.drafters import find_match

    def by_windows(seq, max_ngram, min_ngram):
        for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
            for i in range(len(seq) - 1 - n, -1, -1):
                if list(seq[i:i + n]) == list(seq[len(seq) - n:]):
                    return i + n, n
        return None

    rng = np.random.default_rng(0)
    for _ in range(3000):
        seq = rng.integers(0, int(rng.integers(1, 6)), int(rng.integers(1, 30)))
        max_ngram = int(rng.integers(1, 6))
        min_ngram = int(rng.integers(1, max_ngram + 1))
        assert find_match(seq, max_ngram, min_ngram) == by_windows(seq, max_ngram, min_ngram), (seq, max_ngram)


def test_composite_proposes_from_the_chosen_source(models):
    from specdec.sampling import SamplingParams

    ids = PROMPTS["repeated"]
    comp = CompositeDrafter(models["noisy"])
    comp.begin(64)
    comp.prefill([ids])
    assert comp.sources(ids) == ("lookup3", "model")
    looked_up = comp.propose(ids, 3, SamplingParams(0.0), None)
    assert looked_up == [8, 5, 6] and comp.calls == 0  # the lookup, as a fixed k would take; the model unrun
    drafted = comp.propose(ids, 3, SamplingParams(0.0), None, source="model")
    assert comp.calls == 1 + 3  # the model read the prompt, then ran once per token
    model_only = ModelDrafter(models["noisy"])
    model_only.begin(64)
    model_only.prefill([ids])
    assert drafted == model_only.propose(ids, 3, SamplingParams(0.0), None)


def test_the_datastore_drafts_where_lookup_has_nothing_and_is_partly_right(models, reference):
    # Over the three prompts at k = 4: the store proposed, was accepted, and was rejected; and
    # with the model beside it, all three sources drafted within one generation.
    store_steps = accepted = rejected = 0
    for name, prompt in PROMPTS.items():
        res = speculative_generate(models["target"], CompositeDrafter(datastore=models["store"]), None, prompt,
                                   MAX_TOKENS, num_draft_tokens=4)
        assert res.token_ids == reference[name]
        store_steps += res.stats.drafted > 0
        accepted += res.stats.accepted
        rejected += res.stats.rejections
    assert store_steps and accepted and rejected
    # The composite prefers the lookup, then the store, then the model: along these outputs each
    # comes first somewhere, so a fixed k drafts from all three.
    comp = CompositeDrafter(models["noisy"], datastore=models["store"])
    comp.begin(64)
    first = Counter()
    for name, prompt in PROMPTS.items():
        ids = prompt + reference[name]
        first.update(comp.sources(ids[:t])[0].rstrip("0123456789") for t in range(len(prompt), len(ids)))
    assert set(first) == {"lookup", "store", "model"}, first


def test_accepted_per_position_reports_zero_rates():
    from specdec import Stats

    s = Stats()
    s.record_step(drafted=2, accepted=0)
    assert s.accepted_per_position == [0.0, 0.0]


def test_accepted_per_position_with_variable_proposals():
    from specdec import Stats

    # Per position: accepted among the steps that proposed that many drafts. With varying
    # proposal lengths (n-gram matches, the last steps before max_tokens) it may rise.
    s = Stats()
    s.record_step(drafted=1, accepted=0)
    s.record_step(drafted=2, accepted=2)
    assert s.accepted_per_position == [0.5, 1.0]


def test_draft_calls_counted(models):
    res = speculative_generate(models["target"], models["target"], None, PROMPTS["random"], 21, num_draft_tokens=4)
    # 20 tokens after the prefill, 5 per step: 4 steps. The draft reads the prompt in one pass;
    # then each step runs the unseen accepted tokens in one pass and k-1 single-token passes.
    assert res.stats.target_calls == 5
    assert res.stats.draft_calls == 1 + 4 * 4
    assert res.stats.drafted == 16 and res.stats.accepted == 16


def test_the_draft_reads_a_prompt_only_when_first_asked_to_propose(models):
    # prefill() runs nothing; the first proposal for a row reads its prompt (timed as setup,
    # apart from drafting) and proposes what the draft would after reading it up front.
    from specdec.sampling import SamplingParams

    prompt = PROMPTS["random"]
    d = ModelDrafter(models["noisy"])
    d.begin(64)
    d.prefill([prompt])
    assert d.calls == 0 and d.seconds == 0.0
    tokens = d.propose(prompt, 3, SamplingParams(), None)
    assert d.calls == 1 + 3 and 0 < d.setup_seconds < d.seconds
    m = models["noisy"].fork()
    m.reset(64)
    expected = []
    logits = m.forward(prompt, last_only=True)[-1]
    for _ in range(3):
        expected.append(int(logits.argmax()))
        logits = m.forward(expected[-1:])[-1]
    assert tokens == expected
    setup = d.setup_seconds
    d.commit(prompt + tokens[:1] + [0])
    d.propose(prompt + tokens[:1] + [0], 2, SamplingParams(), None)
    assert d.setup_seconds == setup  # read once
    # A composite whose lookup never needs the model leaves it unrun.
    c = CompositeDrafter(models["noisy"])
    res = speculative_generate(models["target"], c, None, PROMPTS["random"], 1)
    assert res.stats.draft_calls == 0


def test_drafter_instance_reusable(models, reference):
    drafter = ModelDrafter(models["poor"])
    for name, prompt in PROMPTS.items():
        assert speculative_generate(models["target"], drafter, None, prompt, MAX_TOKENS,
                                    num_draft_tokens=3).token_ids == reference[name]


def test_raw_transformers_target(models, reference):
    """The target itself a raw transformers model, behind the adapter."""
    for draft in (models["poor"], NgramDrafter(), models["hf_target"]):
        res = speculative_generate(models["hf_target"], draft, None, PROMPTS["repeated"], MAX_TOKENS,
                                   num_draft_tokens=4)
        assert res.token_ids == reference["repeated"]


# ----------------------------------------------------------------------------- GPT-2 target


@pytest.fixture(scope="module")
def gpt2():
    return tiny_gpt2(seed=0)


@pytest.fixture(scope="module")
def gpt2_reference(gpt2):
    return {name: generate(gpt2, None, p, MAX_TOKENS).token_ids for name, p in PROMPTS.items()}


def test_gpt2_greedy_matches_transformers(gpt2, gpt2_reference):
    for name, prompt in PROMPTS.items():
        assert gpt2_reference[name] == hf_greedy(gpt2, prompt, MAX_TOKENS), name


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("draft_kind", ["self", "poor-gpt2", "llama", "ngram"])
def test_gpt2_speculative_equals_greedy(draft_kind, k, gpt2, gpt2_reference, models):
    draft = {"self": lambda: HFAdapter(gpt2), "poor-gpt2": lambda: tiny_gpt2(seed=5),
             "llama": lambda: models["poor"], "ngram": NgramDrafter}[draft_kind]()
    for name, prompt in PROMPTS.items():
        res = speculative_generate(gpt2, draft, None, prompt, MAX_TOKENS, num_draft_tokens=k)
        assert res.token_ids == gpt2_reference[name], name
        check_stats(res, drafter_has_model=draft_kind != "ngram")
        if draft_kind == "self":
            assert res.stats.acceptance_rate == 1.0 and res.stats.tokens_per_target_call > 1.0


def test_auto_is_the_default_k():
    import inspect

    assert inspect.signature(speculative_generate).parameters["num_draft_tokens"].default == "auto"


def test_auto_keeps_one_row_within_the_engines_tile_of_rows(models, reference, monkeypatch):
    # An engine whose passes compute `pass_tile` rows at once (the AMX kernel: 16) gets a
    # schedule that drafts at most pass_tile - 1 a step for one row; others the usual most. The
    # schedule knows the tile (a batch's passes cost a step at each tile of rows).
    import specdec.decoding
    from specdec.schedule import as_schedule

    made = []

    def recorded(num_draft_tokens, k_max, tile):
        made.append((k_max, tile))
        return as_schedule(num_draft_tokens, k_max, tile)

    monkeypatch.setattr(specdec.decoding, "as_schedule", recorded)
    target = models["target"]
    tiled = target.fork()
    tiled.__class__ = type("Tiled", (type(target),), {"pass_tile": 4})
    for model in (target, tiled):
        res = speculative_generate(model, NgramDrafter(), None, PROMPTS["random"], MAX_TOKENS)
        assert res.token_ids == reference["random"]
    speculative_generate(tiled, NgramDrafter(), None, [PROMPTS["random"]] * 2, MAX_TOKENS)  # a batch: the sum matters
    assert made == [(AdaptiveK.K_MAX, target.pass_tile), (3, 4), (AdaptiveK.K_MAX, 4)]
