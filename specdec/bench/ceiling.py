"""How far a drafter could go on these prompts: the fewest target passes, replayed.

Greedy speculative output is the target's own greedy output, so at every step the
accepted sequence is a prefix of the baseline's output, and what a deterministic drafter
proposes there depends on that prefix alone. The benchmark can therefore replay a drafter
against the baseline's output without running the target: `runs[t]` is how many of its
proposals the target would accept with output[:t] generated (capped at k_max drafts).

A pass at position t can accept any 0..runs[t] drafts (a schedule may propose fewer)
and always adds one token of the target's, so the fewest passes over an output is a jump
game, which `fewest_passes` solves exactly. Its tokens per pass bound what any schedule
of that drafter reaches with at most k_max drafts a step; and since no verification pass
costs less than a plain decoding step and drafting is taken as free, the same number
bounds the decode speedup. Where the target paraphrases instead of copying, this says
how little prompt lookup can give before anything is timed.
"""
from __future__ import annotations

import torch

from ..drafters import ModelDrafter, NgramDrafter
from ..sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def agreeing(proposal, truth) -> int:
    """How many proposed tokens the target accepts: the length of the common prefix."""
    n = 0
    for a, b in zip(proposal, truth):
        if a != b:
            break
        n += 1
    return n


def lookup_runs(prompt_ids: list[int], output: list[int], k_max: int,
                lookup: NgramDrafter | None = None) -> list[int]:
    """runs[t]: prompt-lookup drafts the target accepts with output[:t] generated (runs[0]:
    none, the first token comes from the prefill)."""
    lookup = lookup or NgramDrafter()
    lookup.begin(len(prompt_ids) + len(output))
    seq = list(prompt_ids) + list(output)
    runs = [0]
    for t in range(1, len(output)):
        proposal, _ = lookup.propose(seq[: len(prompt_ids) + t], k_max, GREEDY, None)
        runs.append(agreeing(proposal, output[t:]))
    return runs


@torch.inference_mode()
def draft_choices(drafter: ModelDrafter, seq: list[int]) -> list[int]:
    """The draft's greedy token after each prefix seq[:i + 1], from one forward pass."""
    drafter.model.reset(len(seq))
    return drafter.model.forward(seq).argmax(-1).tolist()


def draft_runs(drafter: ModelDrafter, prompt_ids: list[int], output: list[int], k_max: int,
               choices: list[int] | None = None) -> list[int]:
    """runs[t] for a greedy draft model (`choices`: its `draft_choices` on prompt + output, if
    already at hand).

    While its proposals are right, the draft's inputs are the accepted tokens themselves,
    so its greedy proposals from position t are its argmaxes along the true sequence, read
    from a single forward pass (in half precision a near-tie may round the other way than
    in the step-by-step passes; the run is then off by the rest of that run)."""
    if choices is None:
        choices = draft_choices(drafter, list(prompt_ids) + list(output))
    p, n = len(prompt_ids), len(output)
    runs = [0] * (n + 1)
    for t in range(n - 1, 0, -1):
        runs[t] = min(runs[t + 1] + 1, k_max) if choices[p + t - 1] == output[t] else 0
    return runs[:n]


def fewest_passes(runs: list[int]) -> int:
    """Verification passes needed to generate output[1:] when a pass at position t may
    accept up to runs[t] drafts (len(runs) == len(output)).

    Breadth first over positions: after p passes every position up to `reach` can be
    the next to generate (accept fewer drafts to stop short), so pass p + 1 reaches the
    furthest j + runs[j] + 1 over the positions first reachable with p passes."""
    n = len(runs)
    passes, lo, reach = 0, 1, 1
    while reach < n:
        lo, reach = reach + 1, max(j + runs[j] + 1 for j in range(lo, reach + 1))
        passes += 1
    return passes


def ceilings(prompts, outputs: dict[str, list[int]], k_max: int, drafter: ModelDrafter | None = None) -> dict:
    """Tokens per verification pass at best, for prompt lookup, for the draft model (if any)
    and for the better of the two at each step (what a composite drafter could reach), pooled
    over the prompts of each category and overall as (tokens after the first) / passes."""
    kinds = ["lookup"] + (["draft", "lookup_or_draft"] if drafter is not None else [])
    cats = sorted({p.category for p in prompts})
    tokens = {c: 0 for c in cats + ["overall"]}
    passes = {kind: dict.fromkeys(tokens, 0) for kind in kinds}
    for p in prompts:
        out = outputs[p.id]
        runs = {"lookup": lookup_runs(p.ids, out, k_max)}
        if drafter is not None:
            runs["draft"] = draft_runs(drafter, p.ids, out, k_max)
            runs["lookup_or_draft"] = [max(a, b) for a, b in zip(runs["lookup"], runs["draft"])]
        for where in (p.category, "overall"):
            tokens[where] += max(len(out) - 1, 0)
            for kind in kinds:
                passes[kind][where] += fewest_passes(runs[kind])
    table = {kind: {where: tokens[where] / n if n else None for where, n in passes[kind].items()} for kind in kinds}
    return {"k_max": k_max, **{kind: {"overall": v.pop("overall"), "categories": v} for kind, v in table.items()}}
