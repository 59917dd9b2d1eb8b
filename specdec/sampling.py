"""Sampling math: logits to probabilities, and the speculative acceptance rules.

Kept apart from any model so that it can be read, and tested, on its own.

Greedy verification accepts the longest prefix of the draft that equals the target's
argmax, then appends the target's own token (its correction at the first mismatch, or a
bonus token when all drafts were accepted). The output is exactly greedy decoding.

Sampled verification (Leviathan et al. 2023, Chen et al. 2023) accepts draft token d
with probability min(1, p(d) / q(d)); at the first rejection it samples from the
residual norm(max(0, p - q)); if all k drafts pass it samples a bonus token from p.
Then every emitted token is distributed exactly as p, whatever q is:
    P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) * residual(x)
              = min(q(x), p(x)) + max(0, p(x) - q(x)) = p(x).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (argmax), not a tiny temperature."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Warp logits (temperature, then top-k, then top-p) and normalize; float32, same shape.

    Target and draft must go through this same function, so that p and q are the
    distributions the acceptance rule assumes.
    """
    logits = logits.float()
    if params.greedy:
        # The greedy "distribution": all mass on the argmax (used only for bookkeeping).
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
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
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from `probs` (1-D, non-negative, any positive total) by inverting its CDF.

    torch.multinomial takes about 1 ms over a 49k-token vocabulary on a 2-core CPU, a third
    of a small draft's forward pass; a cumulative sum and a binary search take ~0.15 ms.
    searchsorted(right=True) returns the first i with cdf[i] > u, so a token of probability
    0 (cdf[i] == cdf[i-1]) is never drawn."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand((), generator=generator, dtype=torch.float64, device=cdf.device) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    return i if i < len(cdf) else int(probs.nonzero()[-1])  # u * total rounded up to the total


def argmax(logits: torch.Tensor):
    """Index of the largest logit along the last axis (the first on ties, a NaN before all, as
    torch's): an int for one row, a list for several. A float32 CPU tensor goes through numpy:
    torch's reduction takes 50-180 us for 1-5 rows of a 49k vocabulary on 2 cores, numpy's
    4-20, and the loops take it once a step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def select(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Next token from one position's logits: argmax when greedy, else a sample of the warped p."""
    if params.greedy:
        return argmax(logits)
    return sample(logits_to_probs(logits, params), generator)


def greedy_accept(draft: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification. target_logits[i] scores the token after draft[:i]; shape [k+1, V].

    Returns (number of drafts accepted, the target's token that follows them).
    """
    choice = argmax(target_logits)
    n = 0
    while n < len(draft) and draft[n] == choice[n]:
        n += 1
    return n, choice[n]


def tree_accept(tokens: list[int], parents: list[int], target_logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    """Verification of a tree of deterministic drafts (q one-hot on each node). tokens[i] is a
    drafted node whose parent is node parents[i] (-1: the context); target_logits[0] scores
    the token after the context, target_logits[i + 1] the token after node i's path.

    Returns (the accepted path's nodes, in order; the target's token that follows them).
    From the context, draw the target's next token (argmax when greedy); if a child is that
    token, move to it and draw again, else stop with the token drawn. Every token kept is
    exactly a draw from the target's distribution given the tokens before it, so the output
    is distributed as plain sampling's (for a chain this is rejection sampling with one-hot
    q: accept d with probability p(d), else draw from p without d)."""
    children: list[dict[int, int]] = [{} for _ in range(len(tokens) + 1)]
    for i, (t, parent) in enumerate(zip(tokens, parents)):
        children[parent + 1][t] = i
    choice = argmax(target_logits) if params.greedy else None
    path, row = [], 0
    while True:
        y = choice[row] if params.greedy else sample(logits_to_probs(target_logits[row], params), generator)
        node = children[row].get(y)
        if node is None:
            return path, y
        path.append(node)
        row = node + 1


def rejection_sample(
    draft: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Modified rejection sampling. Returns (number of drafts accepted, next token).

    draft_probs: [k, V] the draft's (warped) q at each drafted position, or None for a
    deterministic drafter, whose q is one-hot on the proposed token.
    target_probs: [k+1, V] the target's (warped) p; row k gives the bonus token.
    """
    k = len(draft)
    uniforms = torch.rand(k, generator=generator, device=target_probs.device).tolist()
    for i, d in enumerate(draft):
        p_d = float(target_probs[i, d])
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        # Accept with probability min(1, p/q). If q(d) = 0 the drafter proposed a token it
        # gives no mass to; then p/q is infinite when p(d) > 0, and d is rejected if p(d) = 0.
        if (p_d > 0 and q_d == 0) or uniforms[i] * q_d < p_d:
            continue
        return i, sample(residual(target_probs[i], draft_probs, i, d), generator)
    return k, sample(target_probs[k], generator)


def residual(p: torch.Tensor, draft_probs: torch.Tensor | None, i: int, d: int) -> torch.Tensor:
    """norm(max(0, p - q)) at draft position i; falls back to p if it is all zero."""
    if draft_probs is None:
        r = p.clone()
        r[d] = 0.0  # q is one-hot on d
    else:
        r = (p - draft_probs[i]).clamp_min(0.0)
    total = float(r.sum())
    # All zero only when p == q up to rounding, where rejection has probability ~0;
    # sampling p then is the limit of the exact rule.
    return p if total <= 0.0 else r / total
