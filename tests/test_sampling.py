"""The sampling math on its own, no models: warping, the noise keyed by position, and the
acceptance rule (sampling.verify), with the evidence that it emits the target's p exactly.

  * `choose` is an exact draw from the warped p (Gumbel-max), checked by Monte Carlo with a
    chi-square test that has power against a wrong noise;
  * `verify` emits, at every position of a block, exactly the token `choose` gives there,
    whatever was drafted: so a block's tokens are plain sampling's;
  * Monte Carlo of whole blocks with a sampled draft drawn with the same noise: the joint
    law of the k+1 tokens is the product of the target's rows, acceptance is at least the
    Gumbel coupling's bound (1 - TV) / (1 + TV), and the check catches noise reused within
    a block.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from scipy import stats

import specdec.sampling as sampling
from specdec.sampling import Noise, SamplingParams, choose, logits_to_probs, verify

# Deterministic hypothesis runs: a test suite about statistics must not be flaky.
PROPERTY = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
ALPHA = 1e-3  # strict: with fixed seeds a correct sampler passes this once and for all
BROKEN_MAX_P = 1e-6  # a broken sampler must be rejected this strongly


# ----------------------------------------------------------------------------- helpers


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def chisquare_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit. Zero-probability bins must be empty and are dropped; bins
    with an expected count below 5 are pooled into one (the chi-square approximation needs it)."""
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    assert counts[probs == 0].sum() == 0, "sampled an outcome of probability 0"
    counts, probs = counts[probs > 0], probs[probs > 0]
    expected = probs / probs.sum() * counts.sum()
    order = np.argsort(expected)
    n_small = int(np.searchsorted(expected[order], min_expected))
    # Grow the pool until it is itself large enough (it may take a few of the big bins).
    while n_small < len(order) and 0 < expected[order[:n_small]].sum() < min_expected:
        n_small += 1
    pooled, rest = order[:n_small], order[n_small:]
    obs = np.append(counts[rest], counts[pooled].sum()) if n_small else counts[rest]
    exp = np.append(expected[rest], expected[pooled].sum()) if n_small else expected[rest]
    assert len(obs) >= 2, "test design: too few bins after pooling"
    return float(stats.chisquare(obs, exp).pvalue)


# ----------------------------------------------------------------------------- logits_to_probs


@PROPERTY
@given(logits=st.lists(st.floats(-5, 5), min_size=2, max_size=12),
       temperature=st.floats(0.05, 5.0))
def test_temperature_scales_logits(logits, temperature):
    x = torch.tensor(logits)
    probs = logits_to_probs(x, SamplingParams(temperature))
    assert probs.dtype == torch.float32 and probs.shape == x.shape
    np.testing.assert_allclose(probs.numpy(), softmax(np.asarray(logits) / temperature), atol=1e-6)


def test_temperature_sharpens_and_flattens():
    x = torch.tensor([2.0, 1.0, 0.0, -1.0])
    peak = [float(logits_to_probs(x, SamplingParams(t)).max()) for t in (0.3, 1.0, 3.0)]
    assert peak[0] > peak[1] > peak[2] > 0.25


def distinct_logits(n: int):
    """n distinct logits in [-5, 5], at least 0.01 apart: "the k best" is then well defined."""
    return st.lists(st.integers(-500, 500), min_size=n, max_size=n, unique=True).map(lambda x: np.asarray(x) / 100)


@PROPERTY
@given(data=st.data(), temperature=st.floats(0.2, 3.0))
def test_top_k_keeps_exactly_k(data, temperature):
    n = data.draw(st.integers(2, 12))
    logits = data.draw(distinct_logits(n))  # ties aside: see the next test
    k = data.draw(st.integers(1, n + 2))  # k >= V means no truncation
    probs = logits_to_probs(torch.tensor(logits, dtype=torch.float32),
                            SamplingParams(temperature, top_k=k)).numpy()
    kept = np.flatnonzero(probs > 0)
    best = np.argsort(-logits)[: min(k, n)]
    assert set(kept) == set(best)
    expected = np.zeros(n)
    expected[best] = softmax(logits[best] / temperature)
    np.testing.assert_allclose(probs, expected, atol=1e-6)


def test_top_k_keeps_ties_at_the_cut():
    # The "ties aside" case: every token tied with the k-th best stays.
    probs = logits_to_probs(torch.tensor([1.0, 3.0, 3.0, 0.0]), SamplingParams(1.0, top_k=1))
    np.testing.assert_allclose(probs.numpy(), [0, 0.5, 0.5, 0], atol=1e-7)


def expected_top_p(probs: np.ndarray, top_p: float) -> set[int]:
    """The smallest head of the tokens sorted by probability whose mass reaches top_p."""
    order = np.argsort(-probs, kind="stable")
    n = int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1  # first prefix with mass >= top_p
    return set(order[: min(n, len(probs))].tolist())


@PROPERTY
@given(data=st.data(), temperature=st.floats(0.2, 3.0), top_p=st.floats(0.01, 0.999))
def test_top_p_keeps_smallest_prefix_reaching_p(data, temperature, top_p):
    n = data.draw(st.integers(2, 12))
    logits = data.draw(distinct_logits(n))
    base = softmax(logits / temperature)
    # float32 cannot decide a prefix whose mass is top_p to 1e-7; keep clear of the boundary.
    assume(np.abs(np.cumsum(np.sort(base)[::-1]) - top_p).min() > 1e-4)
    probs = logits_to_probs(torch.tensor(logits, dtype=torch.float32),
                            SamplingParams(temperature, top_p=top_p)).numpy()
    kept = expected_top_p(base, top_p)
    assert set(np.flatnonzero(probs > 0).tolist()) == kept
    assert base[list(kept)].sum() >= top_p
    expected = np.zeros(n)
    expected[list(kept)] = base[list(kept)] / base[list(kept)].sum()
    np.testing.assert_allclose(probs, expected, atol=1e-6)


@pytest.mark.parametrize("top_p", [1e-9, 0.1, 0.5])
def test_top_p_always_keeps_the_first_token(top_p):
    # The best token alone has mass 0.64 > top_p: only it stays, even for a top_p near 0.
    probs = logits_to_probs(torch.tensor([0.0, 2.0, 0.5, -1.0]), SamplingParams(1.0, top_p=top_p))
    np.testing.assert_array_equal(probs.numpy(), [0, 1, 0, 0])


def test_top_p_one_keeps_everything():
    x = torch.tensor([0.0, 2.0, 0.5, -30.0])
    np.testing.assert_allclose(logits_to_probs(x, SamplingParams(1.0, top_p=1.0)).numpy(),
                               softmax(x.numpy().astype(float)), atol=1e-7)


def test_top_k_then_top_p_on_the_renormalized_head():
    # Temperature, then top-k, then top-p of what top-k left (renormalized), as documented.
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    probs = logits_to_probs(torch.tensor(logits, dtype=torch.float32),
                            SamplingParams(1.0, top_k=3, top_p=0.75)).numpy()
    # After top-3: [4/9, 3/9, 2/9, 0]; the head reaching 0.75 is the first two (7/9).
    np.testing.assert_allclose(probs, [4 / 7, 3 / 7, 0, 0], atol=1e-6)


@PROPERTY
@given(rows=st.integers(1, 4), v=st.integers(2, 10), seed=st.integers(0, 2**31),
       temperature=st.sampled_from([0.5, 1.0, 1.7]), top_k=st.sampled_from([None, 1, 3]),
       top_p=st.sampled_from([None, 0.3, 0.9]))
def test_probs_sum_to_one_and_rows_are_independent(rows, v, seed, temperature, top_k, top_p):
    logits = torch.randn(rows, v, generator=torch.Generator().manual_seed(seed)) * 3
    params = SamplingParams(temperature, top_k, top_p)
    probs = logits_to_probs(logits, params)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    assert (probs >= 0).all()
    np.testing.assert_allclose(probs.sum(-1).numpy(), 1.0, atol=1e-6)
    # Batched warping (verification rows) equals warping each row (one decode step) alone.
    for r in range(rows):
        torch.testing.assert_close(probs[r], logits_to_probs(logits[r], params), atol=1e-7, rtol=0)


def test_greedy_params_give_one_hot_argmax():
    params = SamplingParams()
    assert params.greedy and SamplingParams(0.0, top_k=3, top_p=0.5).greedy
    assert not SamplingParams(1e-3).greedy
    logits = torch.tensor([[0.1, 3.0, -2.0, 2.9], [5.0, 0.0, 0.0, 4.0]])
    np.testing.assert_array_equal(logits_to_probs(logits, params).numpy(), [[0, 1, 0, 0], [1, 0, 0, 0]])
    # top-k / top-p do not matter when greedy.
    np.testing.assert_array_equal(logits_to_probs(logits, SamplingParams(0.0, top_k=2, top_p=0.1)).numpy(),
                                  [[0, 1, 0, 0], [1, 0, 0, 0]])


# ----------------------------------------------------------------------------- greedy

GREEDY = SamplingParams(0.0)


def one_hot_logits(argmaxes, V=10):
    logits = torch.zeros(len(argmaxes), V)
    for i, a in enumerate(argmaxes):
        logits[i, a] = 1.0
    return logits


@pytest.mark.parametrize("draft, target_argmax, expected", [
    ([], [4], (0, 4)),  # nothing drafted: the target's own token
    ([1, 2, 3], [1, 2, 3, 9], (3, 9)),  # all accepted, bonus token
    ([1, 2, 3], [1, 7, 3, 9], (1, 7)),  # mismatch at 2: the target's correction
    ([1, 2, 3], [5, 2, 3, 9], (0, 5)),
])
def test_greedy_verify(draft, target_argmax, expected):
    assert verify(draft, one_hot_logits(target_argmax), GREEDY, Noise(0), 0) == expected


def test_greedy_takes_no_noise():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert choose(logits[0], GREEDY, Noise(1), 5) == choose(logits[0], GREEDY, Noise(2), 9) == int(logits[0].argmax())


# ----------------------------------------------------------------------------- the noise


def test_noise_is_a_function_of_seed_and_position_alone():
    a, b = Noise(7), Noise(7)
    first = a.gumbel(3, 100)
    a.gumbel(4, 100), a.gumbel(0, 5)  # other draws in between change nothing
    assert torch.equal(first, a.gumbel(3, 100)) and torch.equal(first, b.gumbel(3, 100))
    assert not torch.equal(first, a.gumbel(4, 100)) and not torch.equal(first, Noise(8).gumbel(3, 100))
    assert Noise(None).seed != Noise(None).seed  # unseeded: a fresh seed each time


def test_the_noise_is_gumbel():
    # Its law, pooled over positions: P(g <= x) = exp(-exp(-x)). Kolmogorov-Smirnov.
    g = torch.cat([Noise(5).gumbel(i, 500) for i in range(40)]).numpy()
    assert stats.kstest(g, stats.gumbel_r.cdf).pvalue > ALPHA


# ----------------------------------------------------------------------------- drawing one token

ROWS = np.log(np.array([[0.50, 0.30, 0.15, 0.05, 0.0], [0.1, 0.1, 0.2, 0.3, 0.3]]) + 1e-30)
SETTINGS = [SamplingParams(1.0), SamplingParams(0.6), SamplingParams(1.7, top_k=3), SamplingParams(1.0, top_p=0.7)]
DRAWS = 20_000


def draw_tokens(params, noise_of=None):
    """DRAWS draws of `choose` for each row of ROWS, one position each: counts per row."""
    noise = Noise(99)
    counts = np.zeros(ROWS.shape, dtype=np.int64)
    for j in range(DRAWS):
        for r, row in enumerate(ROWS):
            counts[r, choose(torch.tensor(row, dtype=torch.float32), params, noise, 2 * j + r)] += 1
    return counts


@pytest.mark.parametrize("params", SETTINGS, ids=["t1", "t0.6", "t1.7-topk3", "topp0.7"])
def test_choose_draws_from_the_warped_p(params):
    counts = draw_tokens(params)
    for r, row in enumerate(ROWS):
        p = logits_to_probs(torch.tensor(row, dtype=torch.float32), params).double().numpy()
        assert chisquare_pvalue(counts[r], p) > ALPHA


def test_the_draw_check_detects_uniform_noise(monkeypatch):
    # The classic slip of the trick: adding uniform noise instead of Gumbel noise.
    monkeypatch.setattr(Noise, "gumbel", lambda self, position, n: torch.rand(n, dtype=torch.float64,
                                                                               generator=torch.Generator().manual_seed(position)))
    counts = draw_tokens(SamplingParams(1.0))
    p = logits_to_probs(torch.tensor(ROWS[0], dtype=torch.float32), SamplingParams(1.0)).double().numpy()
    assert chisquare_pvalue(counts[0], p) < BROKEN_MAX_P


# ----------------------------------------------------------------------------- the rule


@settings(max_examples=200, deadline=None, derandomize=True)
@given(k=st.integers(0, 5), seed=st.integers(0, 2**40), position=st.integers(0, 10_000),
       matches=st.lists(st.booleans(), min_size=5, max_size=5), temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]))
def test_verify_emits_the_tokens_plain_decoding_chooses(k, seed, position, matches, temperature):
    """Whatever was drafted, the emitted tokens are choose()'s at their positions: the drafts it
    keeps are exactly those that equal them, and its own token is choose()'s at the first other."""
    params, noise = SamplingParams(temperature), Noise(seed)
    logits = torch.randn(k + 1, 6, generator=torch.Generator().manual_seed(seed % 1000)) * 2
    chosen = [choose(logits[i], params, noise, position + i) for i in range(k + 1)]
    draft = [c if m else (c + 1) % 6 for c, m in zip(chosen, matches)][:k]
    n, token = verify(draft, logits, params, noise, position)
    assert draft[:n] == chosen[:n] and token == chosen[n]
    assert n == k or draft[n] != chosen[n]


# Independent rows per position, p and q far apart (TV >= 0.4 per row), zeros on both sides.
P_ROWS = np.array([
    [0.50, 0.30, 0.20, 0.00],
    [0.10, 0.60, 0.10, 0.20],
    [0.25, 0.25, 0.00, 0.50],
    [0.05, 0.15, 0.40, 0.40],
])
Q_ROWS = np.array([
    [0.10, 0.10, 0.40, 0.40],
    [0.50, 0.00, 0.30, 0.20],
    [0.00, 0.20, 0.70, 0.10],
])
BLOCKS = 12_000
T1 = SamplingParams(1.0)


def reused_noise(draft, logits, params, noise, position):
    """A broken rule: every row of the block drawn with the noise of the block's first position."""
    for n, d in enumerate(draft):
        token = choose(logits[n], params, noise, position)
        if token != d:
            return n, token
    return len(draft), choose(logits[len(draft)], params, noise, position)


def simulate(k: int, deterministic: bool, rule=verify):
    """BLOCKS blocks of k drafts: a sampled draft draws d_i = argmax(log q_i + g_i) with the noise
    the target uses there (a deterministic one always proposes token 2), the rule verifies, and
    the later rows are completed as the next steps would. Returns the k+1 tokens and n accepted."""
    p = torch.tensor(np.log(P_ROWS[: k + 1] + 1e-45), dtype=torch.float32)
    seqs = np.zeros((BLOCKS, k + 1), dtype=int)
    n_acc = np.zeros(BLOCKS, dtype=int)
    for j in range(BLOCKS):
        noise, base = Noise(j), 1000
        if deterministic:
            draft = [2] * k
        else:
            q = torch.tensor(np.log(Q_ROWS[:k] + 1e-45), dtype=torch.float64)
            draft = [int((q[i] + noise.gumbel(base + i, 4)).argmax()) for i in range(k)]
        n, token = rule(draft, p, T1, noise, base)
        tail = [choose(p[i], T1, noise, base + i) for i in range(n + 1, k + 1)]
        seqs[j] = draft[:n] + [token] + tail
        n_acc[j] = n
    return seqs, n_acc


def joint_counts(seqs: np.ndarray, V: int = 4) -> np.ndarray:
    return np.bincount(np.ravel_multi_index(seqs.T, (V,) * seqs.shape[1]), minlength=V ** seqs.shape[1])


def product_of_rows(k: int) -> np.ndarray:
    out = P_ROWS[0]
    for i in range(1, k + 1):
        out = np.multiply.outer(out, P_ROWS[i])
    return out


@pytest.mark.parametrize("deterministic", [False, True], ids=["model-draft", "deterministic-draft"])
@pytest.mark.parametrize("k", [1, 3])
def test_blocks_have_the_targets_joint_law(k, deterministic):
    seqs, n_acc = simulate(k, deterministic)
    assert chisquare_pvalue(joint_counts(seqs), product_of_rows(k)) > ALPHA
    if deterministic:  # token 2 is accepted with probability p(2) at each position: 0.2, then 0.1
        assert abs((n_acc >= 1).mean() - P_ROWS[0, 2]) < 0.02
    else:  # the Gumbel coupling's bound on the first draft's acceptance
        tv = 0.5 * np.abs(P_ROWS[0] - Q_ROWS[0]).sum()
        assert (n_acc >= 1).mean() >= (1 - tv) / (1 + tv) - 0.02


@pytest.mark.parametrize("deterministic", [False, True], ids=["model-draft", "deterministic-draft"])
def test_the_block_check_detects_noise_reused_within_a_block(deterministic):
    seqs, _ = simulate(3, deterministic, rule=reused_noise)
    assert chisquare_pvalue(joint_counts(seqs), product_of_rows(3)) < BROKEN_MAX_P
