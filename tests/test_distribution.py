"""End to end: sampled speculative decoding draws continuations from the target's own
distribution, whatever the draft, checked against an exact enumeration.

Setup: tiny random Llamas with a vocabulary of V = 4, so that every continuation of
length L = 4 (V**L = 256 outcomes) can be enumerated exactly. Why L = 4 and not 2: the
first new token always comes from the prefill pass, and `speculative_generate` caps each
block at max_tokens - len(out) - 1 drafts, so with L tokens the first block has L - 2
drafts. L = 4 with num_draft_tokens = 2 is the shortest run whose blocks go through every
path of the acceptance rule: rejection of d1 or d2 (the target's own token), and full
acceptance (bonus).

The sampler runs the native model (loaded with specdec.load_model); the exact reference
comes from the transformers model on full sequences, warped by the same logits_to_probs.
Each continuation uses its own seed (0..N-1), so everything is deterministic.
"""
from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch
from scipy import stats

import specdec
import specdec.sampling as sampling
from specdec.sampling import SamplingParams, logits_to_probs
from tiny import save_tiny, tiny_hf_model

V = 4  # vocabulary
L = 4  # continuation length: V**L outcomes, enumerated exactly
K = 2  # num_draft_tokens
N = 1500  # continuations per test (3-5 ms each on one CPU thread: ~5 forward passes)
ALPHA = 1e-3  # a correct sampler must pass this; with fixed seeds, it passes once and for all
BROKEN_MAX_P = 1e-6  # a broken sampler must be rejected this strongly
# Draft seed 8: of seeds 1..9 the draft farthest from the target (mean total variation 0.28
# over the drafted positions): where q is far from p, a rule that leans towards the drafts shows.
TARGET_SEED, DRAFT_SEED = 0, 8
# Repeats, so that prompt lookup (NgramDrafter) always finds a continuation to propose.
PROMPT = [3, 1, 2, 0, 3, 1, 2, 0, 3]

SETTINGS = {
    "t1.0": dict(temperature=1.0),
    "t0.7-topk3": dict(temperature=0.7, top_k=3),
    "t1.3-topp0.8": dict(temperature=1.3, top_p=0.8),
}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    save_tiny(root / "target", "llama", TARGET_SEED, vocab_size=V)
    save_tiny(root / "draft", "llama", DRAFT_SEED, vocab_size=V)
    return dict(
        hf_target=tiny_hf_model("llama", TARGET_SEED, vocab_size=V),
        hf_draft=tiny_hf_model("llama", DRAFT_SEED, vocab_size=V),
        target=specdec.load_model(root / "target", dtype="float32"),
        draft=specdec.load_model(root / "draft", dtype="float32"),
    )


@pytest.fixture(scope="module")
def exact(models):
    """exact(setting) -> the target's distribution over the V**L continuations (cached)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = exact_distribution(models["hf_target"], PROMPT, L, SamplingParams(**SETTINGS[name]))
        return cache[name]
    return get


# ----------------------------------------------------------------------------- helpers


@torch.no_grad()
def prefix_logits(hf_model, prompt: list[int], length: int) -> torch.Tensor:
    """Float32 logits [V**(length-1), length, V] from one batched transformers forward over
    prompt + every prefix b of length-1 tokens: row j is the next-token logits after
    prompt + b[:j] (causal, so the later tokens of b do not matter)."""
    prefixes = torch.tensor(list(itertools.product(range(V), repeat=length - 1)), dtype=torch.long)
    ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], dim=1)
    return hf_model(input_ids=ids).logits[:, len(prompt) - 1:].float()


def row_probs(hf_model, prompt, length, params: SamplingParams) -> torch.Tensor:
    """The same rows warped exactly as the generators warp them."""
    return logits_to_probs(prefix_logits(hf_model, prompt, length), params)


def exact_distribution(hf_model, prompt, length, params) -> np.ndarray:
    """P(x_1..x_L) = prod_j p(x_j | prompt, x_<j), flat over outcomes in base-V order."""
    check_warping_margins(prefix_logits(hf_model, prompt, length), params)
    rows = row_probs(hf_model, prompt, length, params).double()
    rows = (rows / rows.sum(-1, keepdim=True)).numpy()  # float32 rows sum to 1 only to ~1e-7
    seqs = np.array(list(itertools.product(range(V), repeat=length)))
    prefix = seqs[:, :-1] @ (V ** np.arange(length - 2, -1, -1))  # index of x_1..x_{L-1}
    probs = np.ones(len(seqs))
    for j in range(length):
        probs *= rows[prefix, j, seqs[:, j]]
    assert abs(probs.sum() - 1) < 1e-9
    return probs


def check_warping_margins(logits: torch.Tensor, params: SamplingParams):
    """The sampler (native model, one step at a time) and the reference (transformers, full
    sequences) may differ by ~1e-6 in the logits; make sure no top-k / top-p cut is that
    close, or the two could keep different tokens. (For PROMPT the closest top-k gap is
    8e-3 in logits and the closest top-p boundary 3e-4 in mass; an earlier prompt had 1e-5.)"""
    ordered = (logits / params.temperature).sort(-1, descending=True).values
    if params.top_k is not None and params.top_k < V:
        gap = ordered[..., params.top_k - 1] - ordered[..., params.top_k]
        assert gap.min() > 1e-4, "a top-k cut is a near tie: pick another prompt"
    if params.top_p is not None:
        k = params.top_k if params.top_k is not None else V
        head = ordered[..., :k].softmax(-1).cumsum(-1)
        assert (head - params.top_p).abs().min() > 1e-4, "a top-p cut is borderline: pick another prompt"


def chisquare_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit. Zero-probability outcomes must never be drawn and are
    dropped; outcomes with an expected count below 5 are pooled into one bin."""
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    assert counts[probs == 0].sum() == 0, "sampled a continuation of probability 0"
    counts, probs = counts[probs > 0], probs[probs > 0]
    expected = probs / probs.sum() * counts.sum()
    order = np.argsort(expected)
    n_small = int(np.searchsorted(expected[order], min_expected))
    while n_small < len(order) and 0 < expected[order[:n_small]].sum() < min_expected:
        n_small += 1  # the pool itself must reach 5
    pooled, rest = order[:n_small], order[n_small:]
    obs = np.append(counts[rest], counts[pooled].sum()) if n_small else counts[rest]
    exp = np.append(expected[rest], expected[pooled].sum()) if n_small else expected[rest]
    assert len(obs) >= 2, "test design: too few bins after pooling"
    return float(stats.chisquare(obs, exp).pvalue)


class Tally:
    """Counts of continuations by outcome, plus what the acceptance rule went through."""

    def __init__(self):
        self.counts = np.zeros(V ** L, dtype=np.int64)
        self.drafted = self.accepted = 0
        self.proposed_at = np.zeros(K, dtype=np.int64)
        self.accepted_at = np.zeros(K, dtype=np.int64)

    def add(self, gen: specdec.Generation):
        assert len(gen.token_ids) == L and gen.finish_reason == "length"
        self.counts[np.ravel_multi_index(gen.token_ids, (V,) * L)] += 1
        s = gen.stats
        self.drafted += s.drafted
        self.accepted += s.accepted
        self.proposed_at[: len(s.proposed_at)] += np.asarray(s.proposed_at, dtype=np.int64)
        self.accepted_at[: len(s.accepted_at)] += np.asarray(s.accepted_at, dtype=np.int64)


def draw(fn, n: int = N) -> Tally:
    tally = Tally()
    for seed in range(n):
        tally.add(fn(seed))
    return tally


def make_drafter(models, drafter: str):
    if drafter == "model":
        return models["draft"]
    if drafter == "composite":
        # Only 3-gram matches count, so some steps are looked up (q one-hot) and others are
        # drafted by the model (q sampled): both kinds of q within one generation. Measured
        # over seeds 0..199: 74 looked-up proposals, 196 model proposals.
        return specdec.CompositeDrafter(models["draft"], specdec.NgramDrafter(max_ngram=3, min_ngram=3))
    if drafter == "store":
        # Lookup of 3-grams, else the datastore (which holds the 2-grams (0, 1), (1, 0) and (1, 1)
        # only), else the model: three kinds of proposal within one generation, two of them one-hot.
        # Measured over seeds 0..199: 72 looked-up proposals, 40 from the store, 177 from the model.
        return specdec.CompositeDrafter(models["draft"], specdec.NgramDrafter(max_ngram=3, min_ngram=3),
                                        datastore=specdec.Datastore([[0, 1, 0, 1, 1, 0, 1]], V))
    if drafter == "headcut":
        # Its head scores tokens 1..V-1 only: q(0) = 0, so every 0 the target writes is its
        # own token after a rejection, never an accepted draft.
        return specdec.ModelDrafter(models["draft"], head_tokens=list(range(1, V)))
    return specdec.NgramDrafter()


def speculative(models, drafter: str, setting: str):
    drafter, auto, _ = drafter.partition("-auto")
    k = "auto" if auto else K

    def one(seed):
        draft = make_drafter(models, drafter)
        return specdec.speculative_generate(models["target"], draft, None, PROMPT, L, num_draft_tokens=k,
                                            seed=seed, **SETTINGS[setting])
    return one


# ----------------------------------------------------------------------------- tests

CASES = [("model", "t1.0"), ("model", "t0.7-topk3"), ("model", "t1.3-topp0.8"), ("ngram", "t1.0"),
         ("composite", "t1.0"), ("model-auto", "t1.0"), ("headcut", "t1.0"),
         ("store", "t1.0"), ("store-auto", "t0.7-topk3")]


def test_reference_is_a_proper_sharp_enough_distribution(exact):
    # Sanity of the setup: the reference is normalized and top-k / top-p really cut outcomes
    # (sampling any of those is then an immediate failure in chisquare_pvalue).
    for name in SETTINGS:
        assert abs(exact(name).sum() - 1) < 1e-9
    assert (exact("t1.0") > 0).all()
    assert (exact("t0.7-topk3") > 0).sum() == 3 ** L
    assert (exact("t1.3-topp0.8") == 0).any()


def test_draft_differs_from_target(models):
    # Else the tests could not see a rule that leans towards the drafts. Mean total
    # variation between p and q at the drafted positions 2..L (the first token comes from the
    # prefill, without the draft). Measured: 0.28.
    p, q = (row_probs(models[m], PROMPT, L, SamplingParams(1.0))[:, 1:] for m in ("hf_target", "hf_draft"))
    assert 0.5 * float((p - q).abs().sum(-1).mean()) > 0.2


@pytest.mark.parametrize("drafter, setting", CASES, ids=[f"{d}-{s}" for d, s in CASES])
def test_speculative_matches_exact_distribution(models, exact, drafter, setting):
    t0 = time.perf_counter()
    tally = draw(speculative(models, drafter, setting))
    elapsed = time.perf_counter() - t0
    pvalue = chisquare_pvalue(tally.counts, exact(setting))
    # The runs went through every path of the rule: 2-draft blocks, rejections (so the target's
    # own token followed) and fully accepted blocks (so the bonus token was drawn).
    assert tally.proposed_at[K - 1] > 0.3 * N
    assert tally.drafted > tally.accepted
    assert tally.accepted_at[K - 1] > 0.02 * N
    assert pvalue > ALPHA, f"p-value {pvalue:.3g} ({elapsed:.1f} s)"


def reused_noise(draft, logits, params, noise, position):
    """A broken rule: every row of the block drawn with the noise of the block's first position."""
    for n, d in enumerate(draft):
        token = sampling.choose(logits[n], params, noise, position)
        if token != d:
            return n, token
    return len(draft), sampling.choose(logits[len(draft)], params, noise, position)


@pytest.mark.parametrize("drafter", ["model", "ngram", "store", "headcut"])
def test_detects_noise_reused_within_a_block(models, exact, drafter, monkeypatch):
    # The same test on a deliberately broken rule (monkeypatched where the loop looks it up):
    # the noise is not moved on along the block, so a block's tokens are drawn together.
    import specdec.decoding as decoding

    monkeypatch.setattr(decoding, "verify", reused_noise)
    tally = draw(speculative(models, drafter, "t1.0"))
    pvalue = chisquare_pvalue(tally.counts, exact("t1.0"))
    assert pvalue < BROKEN_MAX_P, f"p-value {pvalue:.3g}: the test has no power against this bug"


def test_plain_generate_matches_exact_distribution(models, exact):
    # Sanity of the reference itself, with the plain sampling loop.
    tally = draw(lambda seed: specdec.generate(models["target"], None, PROMPT, L, temperature=1.0, seed=seed))
    assert chisquare_pvalue(tally.counts, exact("t1.0")) > ALPHA


@pytest.mark.parametrize("drafter", ["plain", "model", "ngram", "raw-hf"])
def test_fixed_seed_reproduces_output(models, drafter):
    def run(seed):
        kw = dict(temperature=1.0, top_p=0.95, seed=seed)
        if drafter == "plain":
            return specdec.generate(models["target"], None, PROMPT, 16, **kw).token_ids
        draft = {"model": models["draft"], "ngram": specdec.NgramDrafter(), "raw-hf": models["hf_draft"]}[drafter]
        return specdec.speculative_generate(models["target"], draft, None, PROMPT, 16, num_draft_tokens=3,
                                            **kw).token_ids
    assert run(7) == run(7)
    assert len({tuple(run(seed)) for seed in range(5)}) > 1  # and the seed does matter


# ----------------------------------------------------------------------------- batches

# A second row with another prompt (shorter, so the rows' positions differ).
PROMPT2 = [1, 2, 0, 3, 1]


def draw_batch(models, drafter: str, n: int = N) -> list[Tally]:
    """n batched calls of two rows (PROMPT, PROMPT2), each row with its own seed: a tally per row."""
    tallies = [Tally(), Tally()]
    for seed in range(n):
        rows = specdec.speculative_generate(models["target"], make_drafter(models, drafter), None, [PROMPT, PROMPT2],
                                            L, num_draft_tokens=K, seed=[2 * seed, 2 * seed + 1], temperature=1.0)
        for tally, gen in zip(tallies, rows):
            tally.add(gen)
    return tallies


@pytest.mark.parametrize("drafter", ["model", "composite"])
def test_each_row_of_a_batch_matches_its_exact_distribution(models, drafter):
    # Rows of a batch accept and reject independently (ragged blocks in shared passes);
    # each row must still be drawn from its own prompt's distribution. Measured p-values:
    # model 0.62 / 0.51, composite 0.70 / 0.53 (rows 1 / 2).
    params = SamplingParams(**SETTINGS["t1.0"])
    for tally, prompt in zip(draw_batch(models, drafter), [PROMPT, PROMPT2]):
        pvalue = chisquare_pvalue(tally.counts, exact_distribution(models["hf_target"], prompt, L, params))
        assert tally.proposed_at[K - 1] > 0.3 * N and tally.drafted > tally.accepted
        assert pvalue > ALPHA, f"p-value {pvalue:.3g}"


def test_batch_rows_detect_noise_reused_within_a_block(models, monkeypatch):
    # Power of the batched check: the broken rule of test_detects_noise_reused_within_a_block.
    import specdec.decoding as decoding

    monkeypatch.setattr(decoding, "verify", reused_noise)
    params = SamplingParams(**SETTINGS["t1.0"])
    for tally, prompt in zip(draw_batch(models, "model"), [PROMPT, PROMPT2]):
        pvalue = chisquare_pvalue(tally.counts, exact_distribution(models["hf_target"], prompt, L, params))
        assert pvalue < BROKEN_MAX_P, f"p-value {pvalue:.3g}: the test has no power against this bug"
