"""num_draft_tokens="auto": the schedule's choices (its output-invariance is in test_greedy / test_distribution)."""
import pytest

from specdec.schedule import AdaptiveK, LoadGate, expected_tokens_per_step

T = 0.030  # seconds per target pass


def trained(p, t_draft: float, verify=lambda k: T * (1 + 0.02 * k), k_max=8, source="model") -> AdaptiveK:
    """A schedule that has measured verify costs for k = 0..k_max and whose per-position
    acceptance is p[i] (a list, or one number for every position), well observed."""
    s = AdaptiveK(k_max=k_max)
    for k in range(k_max + 1):  # k = 0 is a plain step: nothing drafted
        s.update(k, 0, t_draft * k, verify(k), source)
    st = s.sources[source]
    p = p if isinstance(p, list) else [p] * k_max
    st.tries = [1000.0] * len(p)
    st.hits = [1000.0 * x for x in p]
    st.prior = [0.0] * len(p)
    return s


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 1) == pytest.approx(1.5)


def test_iid_acceptance_gives_the_leviathan_rate():
    s = trained(0.6, t_draft=0.0, verify=lambda k: T)
    for k in (1, 3, 8):
        assert s.expected_rates()[k] == pytest.approx(expected_tokens_per_step(0.6, k) / T, rel=1e-3)


def test_starts_modestly_before_measuring():
    assert AdaptiveK(k_max=8).choose()[1] == 2
    assert AdaptiveK(k_max=1).choose()[1] == 1


def test_high_acceptance_cheap_draft_drafts_many():
    assert trained(0.95, t_draft=0.1 * T).choose()[1] >= 5


def test_free_lookup_with_fair_acceptance_drafts():
    assert trained(0.6, t_draft=0.0).choose()[1] >= 3


def test_acceptance_in_runs_drafts_long_blocks():
    # Prompt lookup: the first token of a match is a coin flip, the rest of a quoted span follows.
    runs = trained([0.4] + [0.95] * 15, t_draft=0.0, k_max=16, verify=lambda k: T * (1 + 0.01 * k))
    iid = trained(0.4, t_draft=0.0, k_max=16, verify=lambda k: T * (1 + 0.01 * k))
    assert runs.choose()[1] >= 10 > iid.choose()[1]


def test_unobserved_positions_follow_the_last_observed_one():
    s = trained([0.9, 0.9], t_draft=0.0)
    assert s.acceptance()[5] == pytest.approx(0.9, abs=0.01)


def test_expensive_draft_is_not_worth_it_even_when_always_right():
    assert trained(0.99, t_draft=1.0 * T).choose()[1] == 0  # the target drafting for itself: c = 1


def test_verify_cost_that_grows_with_k_caps_k():
    flat = trained(0.8, t_draft=0.0, verify=lambda k: T)
    steep = trained(0.8, t_draft=0.0, verify=lambda k: T * (1 + 0.5 * k))  # compute-bound target
    assert steep.choose()[1] < flat.choose()[1]


def run_plain_steps(s, n, probe_accepts=False):
    """n steps of the loop: choose, then report the outcome (probes accepted or not)."""
    picks = []
    for _ in range(n):
        k = s.choose()[1]
        picks.append(k)
        s.update(k, k if probe_accepts else 0, 0.2 * T * k, T)
    return picks


def test_useless_draft_falls_back_to_plain_decoding_and_probes_ever_less():
    s = trained(0.01, t_draft=0.2 * T)
    picks = run_plain_steps(s, 8 + 16 + 32 + 64 + 128 + 128)
    probes = [i for i, k in enumerate(picks) if k]
    assert all(picks[i] == 1 for i in probes)
    gaps = [b - a for a, b in zip([-1] + probes, probes)]
    assert gaps == [8, 16, 32, 64, 128, 128]  # doubling while probes fail, up to max_probe_every


def test_a_batch_probes_on_one_row_and_drafts_nothing_when_it_does_not_pay():
    s = trained(0.01, t_draft=0.2 * T)
    rows = [("model",), ("lookup1", "model"), (), ("model",)]
    s._source("lookup1").t_draft = 1e-6
    s.sources["lookup1"].tries, s.sources["lookup1"].hits, s.sources["lookup1"].prior = [1000.0], [10.0], [0.0]
    plans = []
    for _ in range(8):
        plans.append(s.choose_batch(rows))
        s.update_batch([(src, k, 0) for src, k in plans[-1]], 0.2 * T * max(k for _, k in plans[-1]), T)
    assert all(k == 0 for plan in plans[:7] for _, k in plan)  # neither source pays
    probe = plans[7]  # the eighth plain step: each source probes once, on the first row that has it
    assert probe == [("model", 1), ("lookup1", 1), (None, 0), ("model", 0)]


def test_probes_are_spaced_by_what_a_probe_costs():
    # A 2-token pass at 1.7x a plain one: a probe costs 0.7 of a pass, 7 times PROBE_COST, so
    # the first probe comes after 7 * 8 plain steps, not 8.
    steep = trained(0.01, t_draft=0.0, verify=lambda k: T * (1 + 0.7 * k))
    picks = run_plain_steps(steep, 60)
    assert [i for i, k in enumerate(picks) if k] == [55]


def test_a_successful_probe_resets_the_interval():
    s = trained(0.01, t_draft=0.2 * T)
    run_plain_steps(s, 8 + 16 + 32)  # three failed probes: the interval is now 64
    assert s.sources["model"].probe_every == 64
    s.sources["model"].plain_steps = 63
    assert s.choose()[1] == 1
    s.update(1, 1, 0.2 * T, T)
    assert s.sources["model"].probe_every == 8


def test_acceptance_estimate_follows_recent_steps():
    s = AdaptiveK(decay=0.5)
    for _ in range(10):
        s.update(4, 0, 0.001, T)  # every draft rejected
    assert s.alpha() < 0.05
    for _ in range(10):
        s.update(4, 4, 0.001, T)  # then every draft accepted
    assert s.alpha() > 0.9 and s.acceptance()[3] > 0.9


def test_a_short_proposal_is_not_a_rejection():
    s = AdaptiveK()
    for _ in range(20):
        s.update(2, 2, 0.0, T, "lookup")  # the match had only 2 tokens; both accepted
    assert s.acceptance("lookup")[1] > 0.9 and s.sources["lookup"].tries[1] > 0
    assert len(s.sources["lookup"].tries) == 2  # nothing learned about position 3


def test_sources_keep_separate_statistics():
    s = trained(0.95, t_draft=0.0, source="lookup")
    for _ in range(30):
        s.update(2, 0, 2 * 0.2 * T, T, "model")
    assert s.alpha("lookup") > 0.9 and s.alpha("model") < 0.1
    assert s.choose(("lookup",))[1] >= 5
    assert s.choose(("model",))[1] == 0


def test_an_unmeasured_source_is_not_tried_where_blocks_cost_too_much_for_its_prior():
    # A 2-token pass at 1.7x a plain one (llama.cpp's bf16 blocks on a Zen 4 CPU): a new source,
    # right half the time at best, cannot pay; it is measured by probes (spaced by what a probe
    # costs: 7 * probe_every plain steps here), not tried at k = 2.
    steep = trained(0.01, t_draft=0.0, verify=lambda k: T * (1 + 0.7 * k), source="lookup1")
    picks = [steep.choose(("store2",)) for _ in range(7 * steep.probe_every)]
    assert [k for _, k in picks] == [0] * (7 * steep.probe_every - 1) + [1] and picks[-1][0] == "store2"
    # Where blocks are nearly free, the same source is tried at once.
    cheap = trained(0.01, t_draft=0.0, verify=lambda k: T * (1 + 0.02 * k), source="lookup1")
    assert cheap.choose(("store2",))[0] == "store2"


def test_a_first_try_drafts_what_the_prior_makes_most_of_at_the_measured_costs():
    # Blocks nearly free (the native kernel): a first try is not cut at 2 tokens, where a copy
    # may run on; at p = 0.5 a draft, 4 drafts make 1.94 tokens for 1.08 of a plain pass.
    cheap = trained(0.01, t_draft=0.0, verify=lambda k: T * (1 + 0.02 * k), source="lookup1")
    assert cheap.choose(("store2",)) == ("store2", 4)
    # A 2-token pass at 1.3x and 0.15x more a token (llama.cpp's bf16 blocks): 2, as before.
    dear = trained(0.01, t_draft=0.0, verify=lambda k: T * (1.15 + 0.15 * k) if k else T, source="lookup1")
    assert dear.choose(("store2",)) == ("store2", 2)
    # Nothing measured yet, or passes of one size only (a flat line: every k would look free): 2.
    assert AdaptiveK().choose(("store2",)) == ("store2", 2)
    one_size = AdaptiveK()
    one_size.update(2, 2, 0.0, 1.05 * T, "lookup1")
    assert one_size.choose(("store2",)) == ("store2", 2)


def test_verify_cost_is_a_line_fitted_to_noisy_passes():
    s = AdaptiveK()
    for k, t in [(0, T), (1, 1.1 * T), (2, 0.9 * T)] * 5:  # one lucky-looking k = 2
        s.update(k, 0, 0.0, t)
    assert s.verify_time(2) >= s.verify_time(1) >= s.verify_time(0)
    s = AdaptiveK()
    for k in [1, 2, 4] * 5:
        s.update(k, 0, 0.0, T * (1 + 0.1 * k))
    assert s.verify_time(8) == pytest.approx(T * 1.8, rel=1e-6)  # extrapolated along the line


def test_the_one_token_pass_is_timed_apart_from_the_line_of_blocks():
    # llama.cpp's bf16 path on a Zen 4 CPU: 2 tokens cost 1.8x one, then 0.15x more a token.
    # A line through all sizes would put the one-token pass at 1.4x and short blocks too low,
    # so a source right half the time would look worth drafting; it is not.
    jump = lambda k: T if k == 0 else T * (1.8 + 0.15 * (k - 1))  # noqa: E731
    s = trained(0.5, t_draft=0.0, verify=jump)
    assert s.verify_time(0) == pytest.approx(T) and s.verify_time(1) == pytest.approx(1.8 * T, rel=0.05)
    assert s.choose()[1] == 0
    assert trained(0.8, t_draft=0.0, verify=jump).choose()[1] >= 4  # long runs still pay


def test_picks_the_source_that_promises_more():
    s = trained(0.6, t_draft=0.1 * T, source="model")
    for _ in range(30):
        s.update(2, 0, 0.0, T, "lookup1")  # lone-token matches: always wrong
    assert s.choose(("lookup1", "model")) == ("model", s.choose(("model",))[1])
    for _ in range(30):
        s.update(4, 4, 0.0, T, "lookup3")  # long matches: always right
    source, k = s.choose(("lookup3", "model"))
    assert source == "lookup3" and k >= 8


def test_an_unmeasured_source_is_tried_unless_a_preferred_one_pays():
    # A lookup that pays: the model listed after it is not tried (trying would cost its
    # reading of the prompt and its drafts). Where the lookup does not pay, or has no match, it is.
    s = trained(0.9, t_draft=0.0, source="lookup3")
    assert s.choose(("lookup3", "model"))[0] == "lookup3"
    first = s.first_try()  # (4 at these costs: the test above)
    assert s.choose(("model",)) == ("model", first)
    s = trained(0.01, t_draft=0.0, source="lookup1")
    assert s.choose(("lookup1", "model")) == ("model", first)
    # A lookup of a new match length, listed before a model that pays, is tried at once.
    s = trained(0.6, t_draft=0.1 * T, source="model")
    assert s.choose(("lookup2", "model")) == ("lookup2", first)
    # In a batch each row decides for itself: here one row drafts from its lookup, another
    # tries the model, a row with no source takes a plain step.
    s = trained(0.9, t_draft=0.0, source="lookup3")
    plan = s.choose_batch([("lookup3", "model"), ("model",), ()])
    assert plan[0][0] == "lookup3" and plan[0][1] > 2 and plan[1:] == [("model", first), (None, 0)]
    # Before any verify pass, every row starts modestly with its preferred source.
    assert AdaptiveK().choose_batch([("lookup3", "model"), ("model",)]) == [("lookup3", 2), ("model", 2)]


def observed(s: AdaptiveK, source: str, p: float, t_draft: float = 1e-6) -> None:
    st = s._source(source)
    st.t_draft, st.tries, st.hits, st.prior = t_draft, [1000.0] * s.k_max, [1000.0 * p] * s.k_max, [0.0] * s.k_max


def test_each_row_of_a_batch_gets_its_own_k():
    """A row copying a long match drafts many; a row whose source is a poor bet takes a plain
    step in the same pass (one k for all would make it draft too, or the good row stop)."""
    s = AdaptiveK(k_max=8)
    for size in range(2, 20):  # passes over 2..19 tokens, 3% of a one-token pass more a token
        s.update_batch([("good", size - 2, 0), (None, 0, 0)], 0.0, T * (1 + 0.03 * size))
    observed(s, "good", 0.9)
    observed(s, "bad", 0.1)
    plan = s.choose_batch([("good",), ("bad",), ("bad",), ("good",)])
    assert plan[1] == plan[2] == ("bad", 0)
    assert plan[0] == plan[3] and plan[0][0] == "good" and plan[0][1] >= 4


def test_a_batch_pays_for_each_tile_of_rows_its_pass_starts():
    """Where a pass computes its rows a tile at a time, the fitted cost steps at each tile: 16
    rows drafting a little start a second tile for a few tokens, which a line through the
    passes would price at a few percent; so 16 rows of middling drafts stay plain, and 8 draft."""
    def cost(n):  # the AMX VM's shape: a step per tile of 16 rows, little within one
        return T * (1 + 0.3 * (-(-n // 16) - 1) + 0.004 * n)

    plans = {}
    for tile in (16, None):
        s = AdaptiveK(k_max=8, tile=tile)
        for size in list(range(8, 50)) * 3:
            s.update_batch([("mid", size - 1, 0)], 0.0, cost(size))
        observed(s, "mid", 0.31)
        assert s.pass_time(17) - s.pass_time(16) > (5 * (s.pass_time(24) - s.pass_time(23)) if tile else 0)
        plans[tile] = (s.choose_batch([("mid",)] * 16), s.choose_batch([("mid",)] * 8))
    sixteen, eight = plans[16]
    assert all(k == 0 for _, k in sixteen) and all(k >= 1 for _, k in eight)
    assert any(k for _, k in plans[None][0])  # the line alone makes 16 rows draft


@pytest.mark.parametrize("faster", [True, False])
def test_the_load_gate_runs_the_faster_mode_and_checks_the_other_ever_less(faster):
    """Steps with drafting make 10% more tokens a second than steps without (or 10% fewer): the
    gate ends up in the faster mode at least 97% of 2000 steps, and checks the other more
    rarely as it keeps losing; another batch size is measured on its own."""
    gate, modes = LoadGate(), []
    for _ in range(2000):
        drafting = gate.drafting(16)
        modes.append(drafting)
        gate.update(16, drafting, 16, 0.025 / (1.1 if drafting == faster else 1.0))
    assert modes.count(faster) >= 0.97 * len(modes)
    checks = [i for i in range(1, len(modes)) if modes[i] != faster and modes[i - 1] == faster]
    assert len(checks) >= 3 and checks[-1] - checks[-2] > checks[1] - checks[0]  # ever less often
    assert gate.drafting(4)  # nothing measured at 4 rows: draft
