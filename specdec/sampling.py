"""Sampling math: logits to a choice of token, and the speculative acceptance rule.

Kept apart from any model so that it can be read, and tested, on its own.

Vocabulary. A *position* is a token's index in its row's sequence (prompt, then output).
The *noise* of a position is a vector of Gumbel(0, 1) draws, one per vocabulary id, made
from the row's seed and that position alone (`Noise`). The target's *choice* at a position
is argmax(logits / T + noise) over the warped logits (temperature, top-k, top-p): the
Gumbel-max trick, an exact draw from the target's distribution p. Greedy (T = 0) is the
argmax, without noise.

The acceptance rule, the same for greedy and sampling: the target scores [pending, d_1..d_k]
in one pass; at each position of the block it makes its choice exactly as plain decoding
would make it there; drafts are kept while they equal its choices; the first choice that
differs (or the one after d_k) is its own token. So every token emitted is the target's
choice at its position, given the tokens before it: the output is plain decoding's output
with the same seed, whatever was drafted, however many tokens a step drafted, and whatever
else shared the batch (Daliri, Musco and Suresh 2024, "drafter-invariant" speculative
decoding). Sampled output therefore has exactly the target's distribution, and a seeded
call is reproducible whatever schedule timing noise picks.

A deterministic draft (lookup, datastore, a greedy draft model) is accepted with
probability p(d), as under Leviathan et al.'s rule with a one-hot q. A sampled draft model
draws its token with the same noise, argmax(q-logits / T + noise), so it agrees with the
target whenever the two distributions are close: a Gumbel coupling, which accepts with
probability at least (1 - TV) / (1 + TV) (TV: the distributions' total-variation distance),
where Leviathan's rule accepts 1 - TV. That is the price of drafter-invariance, paid only
by sampled model drafts.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

MIN_TEMPERATURE = 1e-5  # below it, logits / T and the differences of its scores lose float32's precision


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (argmax), not a tiny temperature."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampled logits: divided by the temperature, then -inf outside top-k and top-p; float32,
    same shape. softmax of it is p; argmax of it plus a position's noise is a draw from p.

    Target and draft go through this same function, so that both draw from what they mean."""
    logits = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Keep the smallest head of the sorted list whose mass reaches top_p: a token
        # stays if the mass strictly before it is still below top_p (the first always stays).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p: the warped logits normalized (one-hot on the argmax when greedy); float32, same shape."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.float().argmax(-1), logits.shape[-1]).float()
    return warp(logits, params).softmax(-1)


def _mix(x: int) -> int:
    """splitmix64's finalizer: nearby inputs (seed, position) give unrelated 64-bit outputs."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class Noise:
    """One row's random numbers, keyed by position: the Gumbel noise that picks the token at
    position i is the same whichever pass, block or batch computes it. seed None: a fresh
    random seed (an unseeded call)."""

    def __init__(self, seed: int | None, device="cpu"):
        self.seed = secrets.randbits(63) if seed is None else seed
        self.generator = torch.Generator(device=device)

    def gumbel(self, position: int, n: int) -> torch.Tensor:
        """[n] float64 Gumbel(0, 1) draws for `position`."""
        self.generator.manual_seed(_mix(_mix(self.seed) ^ position) >> 1)
        u = torch.rand(n, generator=self.generator, dtype=torch.float64, device=self.generator.device)
        return -torch.log(-torch.log(u))


def argmax(logits: torch.Tensor):
    """Index of the largest logit along the last axis (the first on ties, a NaN before all, as
    torch's): an int for one row, a list for several. A float32 CPU tensor goes through numpy:
    torch's reduction takes 50-180 us for 1-5 rows of a 49k vocabulary on 2 cores, numpy's
    4-20, and the loops take it once a step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def choose(logits: torch.Tensor, params: SamplingParams, noise: Noise, position: int) -> int:
    """The token at `position` from the logits [V] that score it: argmax when greedy, else
    argmax(warped logits + the position's noise), a draw from p."""
    if params.greedy:
        return argmax(logits)
    x = warp(logits, params)
    return argmax(x.double() + noise.gumbel(position, x.shape[-1]))


def verify(draft: list[int], target_logits: torch.Tensor, params: SamplingParams, noise: Noise,
           position: int) -> tuple[int, int]:
    """The acceptance rule (module docstring). target_logits [k+1, V]: row i scores the token
    at `position` + i, after draft[:i]. Returns (drafts accepted, the target's token after them)."""
    if params.greedy:  # every row's argmax at once: one reduction
        choice = argmax(target_logits)
        n = 0
        while n < len(draft) and draft[n] == choice[n]:
            n += 1
        return n, choice[n]
    for n, d in enumerate(draft):
        token = choose(target_logits[n], params, noise, position + n)
        if token != d:
            return n, token
    return len(draft), choose(target_logits[len(draft)], params, noise, position + len(draft))


def logprobs(logits: torch.Tensor, ids: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each row i of logits [n, V] (n >= len(ids)): the log-probability of ids[i] there, and
    the `top` most likely ids with theirs. Of the model's own distribution (before temperature,
    top-k and top-p), as vLLM reports them by default."""
    lp = torch.log_softmax(logits[:len(ids)].float(), -1)
    chosen = lp[torch.arange(len(ids)), torch.tensor(ids, dtype=torch.long)].tolist()  # ids may be []
    values, indices = lp.topk(top, -1) if top else (lp[:, :0], lp[:, :0].long())
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, indices.tolist(), values.tolist())]
