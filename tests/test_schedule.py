"""num_draft_tokens="auto": the schedule's choices, and that it never changes the output."""
import pytest

from specdec.schedule import AdaptiveK, expected_tokens_per_step

T = 0.030  # seconds per target pass


def trained(alpha_hits: int, alpha_misses: int, t_draft: float, verify=lambda k: T * (1 + 0.02 * k)) -> AdaptiveK:
    """A schedule fed steps at k = 1..8 whose outcomes give the wanted acceptance."""
    s = AdaptiveK(k_max=8)
    for k in range(9):  # k = 0 is a plain step: nothing drafted
        s.update(k, 0, t_draft * k, verify(k))
    s.accepted, s.rejected = float(alpha_hits), float(alpha_misses)
    return s


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 1) == pytest.approx(1.5)


def test_starts_modestly_before_measuring():
    assert AdaptiveK(k_max=8).choose() == 2
    assert AdaptiveK(k_max=1).choose() == 1


def test_high_acceptance_cheap_draft_drafts_many():
    s = trained(95, 5, t_draft=0.1 * T)
    assert s.choose() >= 5


def test_free_lookup_with_fair_acceptance_drafts():
    s = trained(60, 40, t_draft=0.0)
    assert s.choose() >= 3


def test_useless_draft_falls_back_to_plain_decoding_and_probes():
    s = trained(1, 99, t_draft=0.2 * T)
    picks = [s.choose() for _ in range(16)]
    assert picks.count(0) == 14 and picks.count(1) == 2  # a 1-token probe every 8 plain steps


def test_expensive_draft_is_not_worth_it_even_when_always_right():
    s = trained(99, 1, t_draft=1.0 * T)  # the target drafting for itself: c = 1
    assert s.choose() == 0


def test_verify_cost_that_grows_with_k_caps_k():
    flat = trained(80, 20, t_draft=0.0, verify=lambda k: T)
    steep = trained(80, 20, t_draft=0.0, verify=lambda k: T * (1 + 0.5 * k))  # compute-bound target
    assert steep.choose() < flat.choose()


def test_acceptance_estimate_follows_recent_steps():
    s = AdaptiveK(decay=0.5)
    for _ in range(10):
        s.update(4, 0, 0.001, T)  # every draft rejected
    assert s.alpha < 0.05
    for _ in range(10):
        s.update(4, 4, 0.001, T)  # then every draft accepted
    assert s.alpha > 0.9
