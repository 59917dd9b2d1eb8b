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

Fewest passes is not fastest where a block costs more than a one-token pass (llama.cpp's bf16
blocks on a CPU: 2 tokens at 1.3-1.8x). So, given the engine's measured cost of a pass over n
tokens, `fewest_units` finds the fastest way through the same runs: a perfect schedule, which
knows how many of each source's proposals the target will accept, drafts exactly those from
the best source (or takes a plain step) and pays the pass and the draft's own cost. Its speedup
over plain decoding bounds what any schedule of those drafters reaches on that engine (drafting
a lookup counted free, the loop too): the measured speedup beside it says how much of the
drafters' worth the schedule, which cannot see ahead, takes.

Between the two sits `auto` itself, replayed (`replay`): the same offers, the shipped schedule
choosing from what it has seen so far, each pass charged the same measured costs and nothing
outside the passes. Perfect over replayed is what not seeing ahead loses; replayed over
measured is what the loop costs around the target's passes (the drafter's lookups, the
schedule's arithmetic, reading the logits), and timing noise.
"""
from __future__ import annotations

import torch

from ..datastore import Datastore
from ..drafters import CompositeDrafter, Drafter, ModelDrafter, NgramDrafter
from ..sampling import SamplingParams
from ..schedule import AdaptiveK
from .stats import geomean

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
        proposal = lookup.propose(seq[: len(prompt_ids) + t], k_max, GREEDY, None)
        runs.append(agreeing(proposal, output[t:]))
    return runs


def datastore_runs(store: Datastore, prompt_ids: list[int], output: list[int], k_max: int) -> list[int]:
    """runs[t] for a datastore's proposals (deterministic, like prompt lookup's)."""
    seq = list(prompt_ids) + list(output)
    runs = [0]
    for t in range(1, len(output)):
        found = store.match(seq[: len(prompt_ids) + t])
        runs.append(agreeing(store.continuation(found, k_max), output[t:]) if found else 0)
    return runs


def offers(drafter: Drafter, prompt_ids: list[int], output: list[int], k_max: int) -> list[list[tuple]]:
    """Per position t of the output: (source, proposal length, drafts the target accepts, first
    proposed token) for each source a deterministic drafter offers there, in its order (t = 0:
    none, the first token comes from the prefill). Sources are named as `auto` keys them."""
    drafter.begin(len(prompt_ids) + len(output))
    seq = list(prompt_ids) + list(output)
    steps = [[]]
    for t in range(1, len(output)):
        ids = seq[: len(prompt_ids) + t]
        here = []
        for name in drafter.sources(ids):
            proposal = drafter.propose_rows({0: (ids, k_max, name)}, GREEDY, {0: None}).get(0, [])
            here.append((name, len(proposal), agreeing(proposal, output[t:]), proposal[0] if proposal else None))
        steps.append(here)
    return steps


def replay(schedule: AdaptiveK, steps: list[list[tuple]], pass_cost: dict[int, float]):
    """`schedule` choosing through one call's `offers`, learning as it goes: yields (t, the
    offers there {source: (length, accepted)}, the source chosen, drafted, accepted) for each
    pass. It measures each pass at pass_cost (its choices depend on ratios of times only, so
    one-token passes serve as seconds) and drafting as free."""
    n, t = len(steps), 1
    while t < n:
        offered = {name: (length, acc) for name, length, acc, *_ in steps[t]}
        source, k = schedule.choose(tuple(offered))
        k = min(k, n - t - 1)  # drafts past the end could never be kept
        drafted, accepted = (min(k, offered[source][0]), min(k, offered[source][1])) if k and source else (0, 0)
        yield t, offered, source, drafted, accepted
        schedule.update(drafted, accepted, 0.0, pass_cost[drafted + 1], source)
        t += accepted + 1


def replayed_units(steps: list[list[tuple]], pass_cost: dict[int, float], k_max: int) -> float:
    """One-token passes a fresh `auto` (AdaptiveK) spends over one call's offers."""
    return sum(pass_cost[drafted + 1] for *_, drafted, _ in replay(AdaptiveK(k_max), steps, pass_cost))


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


def fewest_units(runs: dict[str, list[int]], pass_cost: dict[int, float], draft_cost: dict[str, float]) -> float:
    """The least time, in one-token passes, to generate output[1:] when a step at position t
    may accept up to runs[s][t] drafts of source s: j drafts cost pass_cost[j + 1] (a pass over
    j + 1 tokens, in one-token passes; pass_cost[1] == 1) plus j * draft_cost[s], and move to
    t + j + 1. Plain decoding costs len(output) - 1."""
    n = len(next(iter(runs.values())))
    best = [0.0] * (n + 1)  # best[t]: from position t to the end
    for t in range(n - 1, 0, -1):
        best[t] = pass_cost[1] + best[t + 1]
        for s, r in runs.items():
            for j in range(1, r[t] + 1):
                best[t] = min(best[t], pass_cost[j + 1] + j * draft_cost[s] + best[min(t + j + 1, n)])
    return best[1] if n > 1 else 0.0


# Each kind: the sources a composite of them could draft from at a step.
def over_plain(n_tokens: int, units: float, plain: tuple[float, float] | None) -> float:
    """Speedup over plain decoding of a call that spends `units` one-token passes on the
    n_tokens - 1 tokens after the prefill's: decode only, or end to end given plain decoding's
    (seconds, prefill seconds) for the prompt (the prefill, the same work for both, dilutes it)."""
    ratio = (n_tokens - 1) / units
    if plain is None:
        return ratio
    seconds, prefill = plain
    return seconds / (prefill + (seconds - prefill) / ratio)


KINDS = {"lookup": ("lookup",), "datastore": ("datastore",), "lookup_or_datastore": ("lookup", "datastore"),
         "draft": ("draft",), "lookup_or_draft": ("lookup", "draft"),
         "all_three": ("lookup", "datastore", "draft")}


def ceilings(prompts, outputs: dict[str, list[int]], k_max: int, drafter: ModelDrafter | None = None,
             store: Datastore | None = None, pass_cost: dict[int, float] | None = None,
             draft_cost: dict | None = None, plain: dict[str, tuple[float, float]] | None = None,
             auto_k_max: int | None = None) -> dict:
    """Tokens per verification pass at best, for prompt lookup, the datastore and the draft
    model (each if given), and for the best of them at each step (what a composite of them
    could reach), pooled over the prompts of each category and overall as (tokens after the
    first) / passes.

    With `pass_cost` ({n: a pass over n tokens in one-token passes}, n up to k_max + 1) and
    `draft_cost` ({"c": a draft token's cost in one-token passes, "measured": how}), also
    "speedup" (and "draft_cost", as charged): per kind, the perfect schedule's speedup over
    plain decoding (`fewest_units`), per prompt and pooled as geometric means: end to end where
    `plain` gives each prompt's (seconds, prefill seconds) of plain decoding (the prefill is the
    same work for both), else decode only. With `auto_k_max` too, "replayed": the same for `auto`
    itself (drafting at most that many a step), replayed through the offers of prompt lookup and
    of lookup + the datastore (`replay`)."""
    have = {"lookup", *(["datastore"] if store is not None else []), *(["draft"] if drafter is not None else [])}
    kinds = [kind for kind, sources in KINDS.items() if have.issuperset(sources)]
    cats = sorted({p.category for p in prompts})
    tokens = {c: 0 for c in cats + ["overall"]}
    passes = {kind: dict.fromkeys(tokens, 0) for kind in kinds}
    ratios = {kind: {c: [] for c in tokens} for kind in kinds}
    cost = {"lookup": 0.0, "datastore": 0.0, "draft": draft_cost["c"] if draft_cost else 0.0}
    replays = {}  # kind -> the drafter `auto` chooses from, as the bench's methods of those sources run it
    if pass_cost and auto_k_max:
        replays["lookup"] = NgramDrafter
        if store is not None:
            replays["lookup_or_datastore"] = lambda: CompositeDrafter(datastore=store)
    replayed = {kind: {c: [] for c in tokens} for kind in replays}
    for p in prompts:
        out = outputs[p.id]
        speedup = lambda units: over_plain(len(out), units, plain[p.id] if plain else None)  # noqa: E731
        runs = {"lookup": lookup_runs(p.ids, out, k_max)}
        if store is not None:
            runs["datastore"] = datastore_runs(store, p.ids, out, k_max)
        if drafter is not None:
            runs["draft"] = draft_runs(drafter, p.ids, out, k_max)
        for kind in kinds:
            sources = {s: runs[s] for s in KINDS[kind]}
            best = [max(r[t] for r in sources.values()) for t in range(len(out))]
            ratio = speedup(fewest_units(sources, pass_cost, cost)) if pass_cost and len(out) > 1 else None
            for where in (p.category, "overall"):
                passes[kind][where] += fewest_passes(best)
                if ratio is not None:
                    ratios[kind][where].append(ratio)
        for kind, make in replays.items():
            if len(out) > 1:
                ratio = speedup(replayed_units(offers(make(), p.ids, out, auto_k_max), pass_cost, auto_k_max))
                for where in (p.category, "overall"):
                    replayed[kind][where].append(ratio)
        for where in (p.category, "overall"):
            tokens[where] += max(len(out) - 1, 0)

    def pooled(values: dict) -> dict:
        return {"overall": values.pop("overall"), "categories": values}

    report = {"k_max": k_max, **{kind: pooled({where: tokens[where] / n if n else None
                                               for where, n in passes[kind].items()}) for kind in kinds}}
    if pass_cost:
        if drafter is not None and draft_cost:
            report["draft_cost"] = draft_cost
        report["speedup"] = {"end_to_end": plain is not None, **{kind: pooled({
            where: geomean(r) if r else None for where, r in ratios[kind].items()})
            for kind in kinds}}
    if replays:
        report["replayed"] = {"k_max": auto_k_max, **{kind: pooled({
            where: geomean(r) if r else None for where, r in replayed[kind].items()})
            for kind in replays}}
    return report
