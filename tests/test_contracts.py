"""What the docs promise under every default (docs/design.md, "Guarantees").

- Every token is the target's choice at its position (sampling.verify), so on the bf16 kernel,
  whose rows are those of one-token passes, seeded speculative output *is* seeded plain output,
  whatever the drafter, the schedule's k or the batch; a seeded batch row is its solo run.
- Where rows round differently with a block's size (torch: float32, machines without a compiler;
  llama.cpp) the output can part from plain decoding at a near tie, but `auto` then chooses from
  fixed costs, not clocks, so identical calls give identical output however the timings vary.

The timings are made to vary on purpose (a clock with jitter) so that a schedule that read the
clock would choose other blocks from one call to the next; each contract is also checked on that
broken variant, where it must fail.
"""
from __future__ import annotations

import random
import time

import pytest
import torch

import specdec.request as request
from specdec import CompositeDrafter, ModelDrafter, NgramDrafter, generate, load_model, speculative_generate
from specdec.models import kernel

from tiny import save_tiny

PROMPTS = [[3, 17, 5, 9, 3, 17, 5, 22, 41, 8], [60, 2, 2, 7, 13, 60, 2, 2, 7, 40, 1], [11, 12, 13, 14, 15, 16]]
KERNEL_SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                    max_position_embeddings=512)
needs_kernel = pytest.mark.skipif(kernel.library() is None, reason="the kernel cannot be built here (no C++ compiler)")


class JitterClock:
    """time.perf_counter with up to 3 ms of random delay added to each reading: a busy machine."""

    def __init__(self, seed: int):
        self.rng, self.offset = random.Random(seed), 0.0

    def perf_counter(self) -> float:
        self.offset += self.rng.uniform(0.0, 0.003)
        return time.perf_counter() + self.offset


@pytest.fixture
def busy(monkeypatch):
    """Each call to it re-seeds the loop's clock with new jitter."""
    def new(seed):
        monkeypatch.setattr(request, "time", JitterClock(seed))
    return new


def near_tie(model, a: int = 5, b: int = 6):
    """Make tokens a and b the usual argmax and nearly tied. In float32 b's output row is a's
    times 1 + 1e-7, so the two logits differ by about 1e-7 * |logit|: as much as a block's
    rounding moves them on the torch path. In bf16 (no room for 1e-7) b's row is a's with one
    weight moved by one unit in the last place."""
    w = model.module.lm_head.weight
    with torch.no_grad():
        w[a] = w[a] * 6
        if w.dtype == torch.float32:
            w[b] = (w[a].double() * (1 + 1e-7)).float()
        else:
            w[b] = w[a]
            i = int(w[a].float().abs().argmax())
            w[b, i] = (w[a, i].float() * (1 + 2 ** -7)).to(w.dtype)
    return model


@pytest.fixture(scope="module")
def f32(tmp_path_factory):
    """A float32 target (the torch path) with a built near tie, and a float32 draft."""
    d = tmp_path_factory.mktemp("contracts-f32")
    target = near_tie(load_model(save_tiny(d / "t", "llama", seed=0, **KERNEL_SHAPE), dtype="float32"))
    draft = load_model(save_tiny(d / "d", "llama", seed=1, **KERNEL_SHAPE), dtype="float32")
    assert not target.row_invariant
    return target, draft


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    """A bf16 target in a shape the kernel runs (row-invariant), with the same kind of near tie."""
    d = tmp_path_factory.mktemp("contracts-bf16")
    target = near_tie(load_model(save_tiny(d / "t", "llama", seed=0, **KERNEL_SHAPE), dtype="bfloat16"))
    draft = load_model(save_tiny(d / "d", "llama", seed=1, **KERNEL_SHAPE), dtype="bfloat16")
    return target, draft


def tie_in_play(model, prompts=PROMPTS, n=40) -> bool:
    """Each of the tied pair wins at some positions of greedy decoding, and together they are a
    fifth or more of the output (the share moves with a machine's float32 rounding: 0.25-0.4)."""
    outs = [generate(model, None, p, n).token_ids for p in prompts]
    counts = [sum(o.count(t) for o in outs) for t in (5, 6)]
    return min(counts) > 0 and sum(counts) >= 0.2 * sum(map(len, outs))


# ----------------------------------------------------------------------------- seeded sampling


@needs_kernel
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_k=20, top_p=0.9)])
def test_seeded_speculative_output_is_seeded_plain_output_on_the_kernel(bf16, busy, sampling):
    target, draft = bf16
    assert target.row_invariant
    for drafter in (ModelDrafter(draft), NgramDrafter(), CompositeDrafter(draft)):
        for i, p in enumerate(PROMPTS):
            busy(i)
            want = generate(target, None, p, 40, seed=7, **sampling).token_ids
            for k in (1, 4, "auto"):
                got = speculative_generate(target, drafter, None, p, 40, num_draft_tokens=k, seed=7, **sampling)
                assert got.token_ids == want, (drafter, k, p)


@needs_kernel
def test_a_seeded_batch_row_is_its_seeded_solo_run(bf16, busy):
    target, draft = bf16
    busy(0)
    rows = speculative_generate(target, draft, None, PROMPTS, 40, temperature=1.0, seed=11)
    for i, (p, row) in enumerate(zip(PROMPTS, rows)):
        solo = speculative_generate(target, draft, None, p, 40, temperature=1.0, seed=11 + i)
        assert row.token_ids == solo.token_ids == generate(target, None, p, 40, temperature=1.0, seed=11 + i).token_ids
    plain = generate(target, None, PROMPTS, 40, temperature=1.0, seed=11)
    assert [r.token_ids for r in plain] == [r.token_ids for r in rows]


@needs_kernel
def test_logprobs_are_plain_decodings_and_the_targets_own_on_the_kernel(bf16, busy):
    """Each token's logprobs come from the pass that chose it: speculative ones, greedy or
    sampled, in a batch or alone, are plain decoding's bit for bit, and a pass over prompt and
    output gives the same numbers."""
    target, draft = bf16
    for sampling in (dict(), dict(temperature=0.8, seed=3)):
        busy(1)
        plain = generate(target, None, PROMPTS, 30, logprobs=2, **sampling)
        for drafter in (CompositeDrafter(draft), NgramDrafter()):
            spec = speculative_generate(target, drafter, None, PROMPTS, 30, logprobs=2, **sampling)
            assert [(g.token_ids, g.logprobs) for g in spec] == [(g.token_ids, g.logprobs) for g in plain]
        solo = speculative_generate(target, draft, None, PROMPTS[1], 30, logprobs=2,
                                    **{k: v + (k == "seed") for k, v in sampling.items()})
        assert (solo.token_ids, solo.logprobs) == (plain[1].token_ids, plain[1].logprobs)
    p, g = PROMPTS[0], plain[0]
    target.reset(len(p) + len(g.token_ids))
    lp = torch.log_softmax(target.forward(p + g.token_ids)[len(p) - 1: -1].float(), -1)
    values, indices = lp.topk(2, -1)
    assert g.logprobs == [(lp[i, t].item(), list(zip(indices[i].tolist(), values[i].tolist())))
                          for i, t in enumerate(g.token_ids)]
    assert generate(target, None, p, 5).logprobs is None
    with pytest.raises(ValueError, match="logprobs"):
        generate(target, None, p, 5, logprobs=-1)


def test_a_seeded_auto_call_repeats_on_the_torch_path(f32, busy):
    target, draft = f32
    for p in PROMPTS:
        outs = set()
        for call in range(6):
            busy(call)
            outs.add(tuple(speculative_generate(target, draft, None, p, 48, temperature=1.0, seed=7).token_ids))
        assert len(outs) == 1


# ----------------------------------------------------------------------------- near ties


def test_the_tie_is_built(f32, bf16):
    assert tie_in_play(f32[0]) and tie_in_play(bf16[0])


def repeats(target, drafter, prompts, busy, calls=4, **kw):
    """Whether identical auto calls gave identical output, under a jittered clock."""
    for p in prompts:
        outs = set()
        for call in range(calls):
            busy(call)
            outs.add(tuple(speculative_generate(target, drafter, None, p, 60, **kw).token_ids))
        if len(outs) > 1:
            return False
    return True


def test_greedy_auto_calls_repeat_at_a_float32_near_tie(f32, busy, monkeypatch):
    target, draft = f32
    prompts = [p + [5] for p in PROMPTS] + [[5, 6] * 4, [6, 5, 9, 9, 5]]
    assert repeats(target, ModelDrafter(draft), prompts, busy)
    # The broken variant: a schedule that reads the clock on this path (as `auto` did before).
    monkeypatch.setattr(type(target), "row_invariant", True)
    assert not repeats(target, ModelDrafter(draft), prompts, busy, calls=6), \
        "the check has no power: a clock-driven schedule gave the same output every time"


def test_float32_is_exact_up_to_rounding_ties_and_the_kernel_exactly(f32, bf16):
    # docs/design.md: on the torch path a block's rows round differently from one-token passes,
    # so at a near tie the output may part from plain greedy output; only there (the top two
    # logits within float32's rounding). The kernel's bf16 rows are one-token passes: never.
    from specdec.bench.runner import divergence

    parted = 0
    for target, draft in (f32, bf16) if bf16[0].row_invariant else (f32,):
        for p in PROMPTS:
            want = generate(target, None, p, 60).token_ids
            for k in (2, 3, 5, 8):
                got = speculative_generate(target, draft, None, p, 60, num_draft_tokens=k).token_ids
                if got != want:
                    assert target is f32[0], "the kernel's output must be plain greedy output, always"
                    dv = divergence(target, p, want, got)
                    assert dv["tie"], dv
                    parted += 1
    assert parted > 0, "no float32 run parted at the built tie: the kernel's half of this test has no power"


# ----------------------------------------------------------------------------- temperatures


@pytest.mark.parametrize("t", [1e-40, 1e-9, 9e-6])
def test_temperatures_too_small_for_float32_are_refused(f32, t):
    target, draft = f32
    for call in (lambda: generate(target, None, PROMPTS[0], 4, temperature=t),
                 lambda: speculative_generate(target, draft, None, PROMPTS[0], 4, temperature=t)):
        with pytest.raises(ValueError, match="temperature must be 0 .greedy. or at least 1e-05"):
            call()


def test_the_smallest_temperature_allowed_samples_without_nan(f32):
    draft, target = f32  # (the target without the built tie, where even 1e-5 leaves a coin to toss)
    got = speculative_generate(target, draft, None, PROMPTS[0], 20, temperature=1e-5, seed=3)
    assert got.token_ids == generate(target, None, PROMPTS[0], 20).token_ids  # that cold is greedy


def _llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.mark.skipif(not _llama_cpp(), reason="needs llama-cpp-python (the llamacpp extra)")
def test_greedy_auto_calls_repeat_at_a_near_tie_on_llama_cpp(tmp_path, busy, monkeypatch):
    # The same built tie, written as a float32 GGUF file and run by llama.cpp.
    from specdec.models.gguf_write import write_gguf
    from tiny import tiny_hf_model

    paths = {}
    for name, seed in (("t", 0), ("d", 1)):
        hf = tiny_hf_model("llama", seed, **KERNEL_SHAPE)
        if name == "t":
            w = hf.lm_head.weight
            with torch.no_grad():
                w[5] = w[5] * 6
                w[6] = (w[5].double() * (1 + 1e-7)).float()
        hf.save_pretrained(tmp_path / name, safe_serialization=True)
        paths[name] = write_gguf(tmp_path / name, tmp_path / f"{name}.gguf", file_type="f32")
    target, draft = (load_model(paths[n], engine="llama.cpp") for n in ("t", "d"))
    assert not target.row_invariant and tie_in_play(target)
    prompts = [p + [5] for p in PROMPTS] + [[5, 6] * 4, [6, 5, 9, 9, 5]]
    assert repeats(target, NgramDrafter(), prompts, busy)
    assert repeats(target, ModelDrafter(draft), prompts, busy)
    monkeypatch.setattr(type(target), "row_invariant", True)  # the broken variant: clocks choose the blocks
    assert not repeats(target, ModelDrafter(draft), prompts, busy, calls=6), "the check has no power here"
