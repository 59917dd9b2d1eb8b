"""The sampling math on its own, no models: warping, greedy acceptance, and the proof that
modified rejection sampling emits tokens distributed exactly as the target's p.

Three levels of evidence for the rejection rule:
  * analytic: the emitted distribution, computed from the rule with the library's own
    `residual`, equals p to 1e-6 for arbitrary p, q (zeros on either side, q == p, one-hot q);
  * exact enumeration of a k=2 block (every draft choice, every accept/reject branch);
  * Monte Carlo of `rejection_sample` itself, with a chi-square test that also shows it has
    power: the classic bug (resample from p instead of the residual) is caught.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from scipy import stats

import specdec.sampling as sampling
from specdec.sampling import SamplingParams, greedy_accept, logits_to_probs, rejection_sample

# Deterministic hypothesis runs: a test suite about statistics must not be flaky.
PROPERTY = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
ALPHA = 1e-3  # strict: with fixed seeds a correct sampler passes this once and for all


# ----------------------------------------------------------------------------- helpers


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def distributions(min_size=2, max_size=8):
    """Probability vectors (float64) with exact zeros allowed: zeros matter for the rule."""
    weight = st.one_of(st.just(0.0), st.floats(1e-3, 1.0))
    return (st.lists(weight, min_size=min_size, max_size=max_size)
            .filter(lambda w: sum(w) > 0)
            .map(lambda w: np.asarray(w) / sum(w)))


def accept_prob(p_d: float, q_d: float) -> float:
    """min(1, p/q); a token the drafter gives no mass is never proposed (its weight q is 0)."""
    return 1.0 if q_d == 0 else min(1.0, p_d / q_d)


def res(p: np.ndarray, q_rows: np.ndarray | None, i: int, d: int) -> np.ndarray:
    """The library's residual, called the way rejection_sample calls it, as float64 numpy."""
    qt = None if q_rows is None else torch.as_tensor(np.atleast_2d(q_rows), dtype=torch.float64)
    # Looked up at call time, so that monkeypatching specdec.sampling.residual reaches it.
    return sampling.residual(torch.as_tensor(p, dtype=torch.float64), qt, i, d).numpy()


def emitted_one_step(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Distribution of the token emitted at one position when the draft d ~ q:
    P(x) = q(x) min(1, p(x)/q(x)) + P(reject) * residual(x),  P(reject) = 1 - sum_y min(p(y), q(y))."""
    accepted = np.array([q[x] * accept_prob(p[x], q[x]) for x in range(len(p))])
    reject = 1.0 - np.minimum(p, q).sum()
    return accepted + reject * res(p, q, 0, 0)


def emitted_one_step_deterministic(p: np.ndarray, d: int) -> np.ndarray:
    """Same for a deterministic drafter (draft_probs None): q is one-hot on d."""
    out = (1.0 - p[d]) * res(p, None, 0, d)
    out[d] += p[d]  # accepted with probability min(1, p(d) / 1)
    return out


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


# ----------------------------------------------------------------------------- greedy_accept


def rows_with_argmax(choices: list[int], v: int = 5) -> torch.Tensor:
    """Logits [len(choices), v] whose argmax at row i is choices[i]."""
    logits = torch.zeros(len(choices), v)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 1.0
    return logits


@pytest.mark.parametrize("draft, target_argmax, expected", [
    ([2, 0, 1], [2, 0, 1, 3], (3, 3)),   # all accepted: bonus token from the last row
    ([2, 0, 1], [2, 4, 1, 3], (1, 4)),   # first mismatch at 1: the target's token there
    ([2, 0, 1], [1, 0, 1, 3], (0, 1)),   # mismatch at 0, later rows (which match) are ignored
    ([2, 0, 1], [2, 0, 4, 3], (2, 4)),   # mismatch at the last draft
    ([], [4], (0, 4)),                   # k = 0: just the target's own token
])
def test_greedy_accept(draft, target_argmax, expected):
    assert greedy_accept(draft, rows_with_argmax(target_argmax)) == expected


# ----------------------------------------------------------------------------- the rule, analytically


@PROPERTY
@given(data=st.data())
def test_one_step_rule_reproduces_p_exactly(data):
    p = data.draw(distributions())
    q = data.draw(st.one_of(distributions(len(p), len(p)), st.just(p.copy())))  # q == p included
    np.testing.assert_allclose(emitted_one_step(p, q), p, atol=1e-6)


@PROPERTY
@given(data=st.data())
def test_one_step_rule_deterministic_drafter(data):
    # draft_probs None: q is one-hot on the proposed d; d may have p(d) = 0 (e.g. cut by top-k).
    p = data.draw(distributions())
    d = data.draw(st.integers(0, len(p) - 1))
    np.testing.assert_allclose(emitted_one_step_deterministic(p, d), p, atol=1e-6)


@pytest.mark.parametrize("p, q", [
    ([0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]),  # disjoint supports: always reject
    ([0.2, 0.3, 0.5, 0.0], [0.0, 0.3, 0.2, 0.5]),  # zeros on both sides
    ([1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]),  # one-hot target
    ([0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]),  # q == p: residual is all zero, never used
    ([0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 1.0, 0.0]),  # one-hot q given as probabilities
])
def test_one_step_rule_edge_cases(p, q):
    p, q = np.asarray(p), np.asarray(q)
    np.testing.assert_allclose(emitted_one_step(p, q), p, atol=1e-12)
    r = res(p, q, 0, 0)
    assert r.min() >= 0 and abs(r.sum() - 1) < 1e-12


def test_analytic_check_detects_resampling_from_p(monkeypatch):
    # The analytic check has teeth: with the broken residual (p itself) the emitted law is
    # min(p, q) + P(reject) p, which is not p whenever q != p.
    monkeypatch.setattr(sampling, "residual", lambda p, draft_probs, i, d: p)
    p, q = np.array([0.5, 0.3, 0.2, 0.0]), np.array([0.1, 0.1, 0.4, 0.4])
    np.testing.assert_allclose(emitted_one_step(p, q), [0.4, 0.28, 0.32, 0.0], atol=1e-12)
    np.testing.assert_allclose(emitted_one_step_deterministic(p, 2), [0.4, 0.24, 0.36, 0.0], atol=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_residual_of_one_hot_probs_equals_deterministic_residual(seed):
    # A deterministic drafter (None) and the same drafter written as one-hot q rows agree.
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(6))
    for d in range(6):
        np.testing.assert_allclose(res(p, np.eye(6)[d], 0, d), res(p, None, 0, d), atol=1e-12)


def random_dist(rng: np.random.Generator, shape, zero_frac=0.3) -> np.ndarray:
    """Random distributions over the last axis with some exact zeros (never all zero)."""
    w = rng.dirichlet(np.full(shape[-1], 0.7), size=shape[:-1])
    w = np.where(rng.random(w.shape) < zero_frac, 0.0, w)
    w[..., 0] += (w.sum(-1) == 0)  # a row that lost everything keeps one token
    return w / w.sum(-1, keepdims=True)


def block_joint(p0, p1, p2, q0, q1, draft=None) -> np.ndarray:
    """Exact distribution of (x1, x2, x3) from one k=2 block by enumeration.

    p1[x1] and p2[x1, x2] are the target's rows conditioned on the prefix; q1[d1] the
    draft's second row conditioned on its first proposal. draft=(d1, f) makes the drafter
    deterministic (d2 = f[d1], q one-hot, draft_probs None). Tokens after the block ends
    come from the next step, which (by induction) emits exactly p: so the block is correct
    iff this joint is p0(x1) p1(x2|x1) p2(x3|x1,x2).
    """
    V = len(p0)
    joint = np.zeros((V, V, V))
    if draft is None:
        branches = [(d1, d2, q0[d1] * q1[d1, d2], np.stack([q0, q1[d1]]))
                    for d1, d2 in itertools.product(range(V), range(V))]
    else:
        d1, follow = draft
        branches = [(d1, follow[d1], 1.0, None)]
    for d1, d2, weight, q_rows in branches:
        if weight == 0:
            continue
        qd1 = 1.0 if q_rows is None else q_rows[0, d1]
        qd2 = 1.0 if q_rows is None else q_rows[1, d2]
        a1 = accept_prob(p0[d1], qd1)
        a2 = accept_prob(p1[d1, d2], qd2)
        # d1 rejected: x1 from the residual of row 0, then the next steps sample p.
        r0 = res(p0, q_rows, 0, d1)
        joint += weight * (1 - a1) * r0[:, None, None] * p1[:, :, None] * p2
        # d1 accepted, d2 rejected: x2 from the residual of row 1 (conditioned on d1).
        r1 = res(p1[d1], q_rows, 1, d2)
        joint[d1] += weight * a1 * (1 - a2) * r1[:, None] * p2[d1]
        # both accepted: the bonus x3 from row 2.
        joint[d1, d2] += weight * a1 * a2 * p2[d1, d2]
    return joint


@pytest.mark.parametrize("seed", range(40))
def test_k2_block_exact_enumeration(seed):
    rng = np.random.default_rng(seed)
    V = int(rng.integers(2, 6))
    p0, p1, p2 = random_dist(rng, (V,)), random_dist(rng, (V, V)), random_dist(rng, (V, V, V))
    q0, q1 = random_dist(rng, (V,)), random_dist(rng, (V, V))
    if seed % 4 == 0:  # q == p at both positions
        q0, q1 = p0.copy(), p1.copy()
    target = p0[:, None, None] * p1[:, :, None] * p2
    joint = block_joint(p0, p1, p2, q0, q1)
    np.testing.assert_allclose(joint.sum((1, 2)), p0, atol=1e-6)  # the first emitted token
    np.testing.assert_allclose(joint, target, atol=1e-6)
    # A deterministic drafter, with proposals that may have target probability 0.
    draft = (int(rng.integers(V)), rng.integers(V, size=V))
    joint = block_joint(p0, p1, p2, None, None, draft=draft)
    np.testing.assert_allclose(joint.sum((1, 2)), p0, atol=1e-6)
    np.testing.assert_allclose(joint, target, atol=1e-6)


# ----------------------------------------------------------------------------- Monte Carlo of rejection_sample

# Independent rows per position, p and q far apart (TV >= 0.4 per row) with zeros on both
# sides, so a wrong residual shifts the output by a lot.
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
DRAWS = 20_000


def simulate(k: int, deterministic: bool, seed: int = 1234):
    """DRAWS calls of rejection_sample on a k-block; each emitted block is completed with
    ideal samples of the later rows (what the next steps would do), giving k+1 tokens."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    V = P_ROWS.shape[1]
    p = torch.tensor(P_ROWS[: k + 1], dtype=torch.float32)
    # Deterministic drafter: it always proposes token 2 (p = 0.2, 0.1, 0.0: incl. a forbidden one).
    q = None if deterministic else torch.tensor(Q_ROWS[:k], dtype=torch.float32)
    seqs = np.zeros((DRAWS, k + 1), dtype=int)
    n_acc = np.zeros(DRAWS, dtype=int)
    for j in range(DRAWS):
        draft = [2] * k if deterministic else torch.multinomial(q, 1, generator=gen)[:, 0].tolist()
        n, token = rejection_sample(draft, q, p, gen)
        tail = [rng.choice(V, p=P_ROWS[i]) for i in range(n + 1, k + 1)]
        seqs[j] = draft[:n] + [token] + tail
        n_acc[j] = n
    return seqs, n_acc


def joint_counts(seqs: np.ndarray, V: int) -> np.ndarray:
    index = np.ravel_multi_index(seqs.T, (V,) * seqs.shape[1])
    return np.bincount(index, minlength=V ** seqs.shape[1])


def product_of_rows(k: int) -> np.ndarray:
    out = P_ROWS[0]
    for i in range(1, k + 1):
        out = np.multiply.outer(out, P_ROWS[i])
    return out


def acceptance_law(k: int, deterministic: bool) -> np.ndarray:
    """P(n_acc = n), n = 0..k, with independent rows: each draft passes with prob sum min(p, q)."""
    q = np.zeros((k, 4)) if deterministic else Q_ROWS[:k]
    if deterministic:
        q[:, 2] = 1.0
    beta = np.minimum(P_ROWS[:k], q).sum(-1)
    reach = np.concatenate([[1.0], np.cumprod(beta)])
    return reach - np.concatenate([reach[1:], [0.0]])


def first_token_pvalue(seqs: np.ndarray) -> float:
    return chisquare_pvalue(np.bincount(seqs[:, 0], minlength=4), P_ROWS[0])


@pytest.mark.parametrize("deterministic", [False, True], ids=["model-draft", "deterministic-draft"])
@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sample_monte_carlo(k, deterministic):
    seqs, n_acc = simulate(k, deterministic)
    V = P_ROWS.shape[1]
    # Every emitted token (and the ones the next steps would add) is distributed as p.
    pvalues = {"first": first_token_pvalue(seqs),
               "joint": chisquare_pvalue(joint_counts(seqs, V), product_of_rows(k)),
               "accepted": chisquare_pvalue(np.bincount(n_acc, minlength=k + 1), acceptance_law(k, deterministic))}
    assert min(pvalues.values()) > ALPHA, pvalues


@pytest.mark.parametrize("deterministic", [False, True], ids=["model-draft", "deterministic-draft"])
@pytest.mark.parametrize("k", [1, 3])
def test_monte_carlo_detects_resampling_from_p(k, deterministic, monkeypatch):
    # The classic bug: after a rejection, resample from p instead of norm(max(0, p - q)).
    # It over-weights tokens the drafter likes; the same test must reject it outright.
    monkeypatch.setattr(sampling, "residual", lambda p, draft_probs, i, d: p)
    seqs, n_acc = simulate(k, deterministic)
    first = first_token_pvalue(seqs)
    joint = chisquare_pvalue(joint_counts(seqs, 4), product_of_rows(k))
    # Measured: both p-values underflow to ~0 (chi-square statistics in the hundreds or more).
    assert first < 1e-12 and joint < 1e-12, (first, joint)


# ----------------------------------------------------------------------------- drawing one token

SAMPLE_P = torch.tensor([0.0, 0.5, 0.0, 0.2, 1e-3, 0.299, 0.0])  # zeros at both ends and inside


def draw_counts(draw, probs: torch.Tensor, n: int = 20000) -> np.ndarray:
    g = torch.Generator().manual_seed(0)
    return np.bincount([draw(probs, g) for _ in range(n)], minlength=len(probs))


@pytest.mark.parametrize("scale", [1.0, 3.7], ids=["normalized", "unnormalized"])
def test_sample_draws_from_probs_and_never_a_zero(scale):
    counts = draw_counts(sampling.sample, SAMPLE_P * scale)
    assert counts[SAMPLE_P == 0].sum() == 0
    keep = SAMPLE_P > 0
    assert chisquare_pvalue(counts[keep.numpy()], SAMPLE_P[keep].double().numpy()) > ALPHA


def test_sample_at_the_top_of_the_cdf_takes_the_last_token_with_mass(monkeypatch):
    # u * total can round up to the total itself; searchsorted then points past the end,
    # and the draw must be the last token with mass, not a trailing zero.
    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    assert sampling.sample(torch.tensor([0.3, 0.7, 0.0, 0.0]), None) == 1


def test_sample_check_detects_an_unscaled_uniform():
    # A plausible bug: u drawn on [0, 1) without scaling by the total. For unnormalized probs
    # it never reaches the upper tokens; the same check must reject it outright.
    def broken(probs, g):
        cdf = probs.double().cumsum(-1)
        return int(torch.searchsorted(cdf, torch.rand((), generator=g, dtype=torch.float64), right=True))

    keep = (SAMPLE_P > 0).numpy()
    counts = draw_counts(broken, SAMPLE_P * 3.7)
    assert chisquare_pvalue(counts[keep], SAMPLE_P[keep].double().numpy()) < 1e-12
