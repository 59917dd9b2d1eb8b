"""The two decoding loops: `generate` (plain, KV-cached) and `speculative_generate`.

Invariant shared by both loops: after every step the target's cache holds the K/V of
exactly the accepted sequence except its last token, which is "pending" -- it is the
first input of the next forward pass. Positions are absolute token indices, so the
cache length is always the position of the pending token. Request checks, rows, stats
and streaming live in request.py; the acceptance rule in sampling.py; k in schedule.py.
"""
from __future__ import annotations

from typing import Callable

from .bridge import for_target
from .drafters import as_drafter
from .models.base import Rows
from .models.hf import as_language_model
from .request import Generation, Request, Run, Stats, Timer
from .sampling import choose, verify
from .schedule import AdaptiveK, FixedCosts, as_schedule


def generate(model, tokenizer, prompt, max_tokens: int, *, temperature=0.0, top_k=None, top_p=None,
             seed=None, chat=False, stream: Callable | None = None, logprobs: int | None = None
             ) -> Generation | list[Generation]:
    """Plain decoding: one prefill pass picks the first token from the last prompt position;
    each later token is one pass over only the newest token, reusing the cache.

    prompt: a string or token ids, or a list of them: a batch, decoded together on engines
    that batch (one pass a step for all rows; a row that has finished costs nothing more),
    returning one Generation per row, each exactly the row's own single run. seed: an int
    (row i uses seed + i) or one seed per row. stream gets the new ids, or (row, new ids).
    logprobs: n to have each token's log-probability and its n likeliest alternatives
    (Generation.logprobs)."""
    model = as_language_model(model, tokenizer)
    run = Run(model, tokenizer, prompt, max_tokens, temperature, top_k, top_p, seed, chat, stream, logprobs)
    live = run.live()
    if live:
        tokens, scores = run.prefill()
    while live:
        for b in live:
            run.emit(b, run.add(b, [tokens[b]], scores[b]))
        live = run.live()
        if not live:
            break
        with run.timer(live)("verify"):
            logits = run.rows.forward([[tokens[b]] if b in live else [] for b in range(run.size)])
            for b in live:
                position = len(run.sequence(b))
                tokens[b], scores[b] = choose(logits[b][-1], run.params, run.noises[b], position), logits[b][-1:]
    return run.results()


def auto_k_max(model, rows: int = 1) -> int:
    """The most drafts a step `auto` takes on `model`. One row's blocks stay within the engine's
    tile of rows, if it has one: a block of one more costs a second round of products, which the
    schedule's line of verify costs does not see (on the AMX VM, capped at 15 the default made
    1.74x and 1.76x plain decoding in two runs, against 1.70x and 1.72x at 16:
    probe at 3681d61: scripts/probes/schedule_kmax.py)."""
    tile = getattr(model, "pass_tile", None)
    return min(AdaptiveK.K_MAX, tile - 1) if tile and rows == 1 else AdaptiveK.K_MAX


def speculative_generate(model, draft, tokenizer, prompt, max_tokens: int, *, num_draft_tokens="auto",
                         temperature=0.0, top_k=None, top_p=None, seed=None, chat=False,
                         stream: Callable | None = None, logprobs: int | None = None) -> Generation | list[Generation]:
    """Speculative decoding: the drafter proposes k tokens, the target scores
    [pending, d1..dk] in one pass, and the acceptance rule keeps a prefix plus one
    target token. Every token is the target's choice at its position (sampling.verify), so
    greedy output equals `generate`'s and seeded sampled output `generate`'s with that seed, on
    engines whose block rows are one-token passes (the bf16 kernel); elsewhere up to rounding
    ties, and identical calls give identical output (docs/design.md, "Guarantees").

    num_draft_tokens: "auto" (the default) chooses k (0 included) each step from the measured
    acceptance and costs (see `specdec.schedule.AdaptiveK`); an `AdaptiveK` does the same
    starting from what it learned in earlier calls (and goes on learning); an integer k
    drafts k tokens a step (`schedule.FixedK`).

    prompt: one prompt, or a list of them (a batch; the engines and a model draft must batch),
    as in `generate`: one Generation per row, each exactly the row's own single run. Each row
    accepts its own number of drafts a step (ragged acceptance); one verify pass a step scores
    every live row's block; a finished row drops out of the passes. With "auto" the schedule
    chooses each row's k a step, for the most tokens per second over all rows.

    A draft model's own context limits only the draft: past it, a step drafts nothing (a
    plain decoding step, counted in `stats.plain_steps`) and the output is unchanged.

    logprobs: as in `generate`; each comes from the verify row that chose its token, so on the
    kernel they are plain decoding's, bit for bit."""
    model = as_language_model(model, tokenizer)
    run = Run(model, tokenizer, prompt, max_tokens, temperature, top_k, top_p, seed, chat, stream, logprobs)
    drafter = for_target(as_drafter(draft, tokenizer), model, tokenizer)  # bridged, or refused, here
    schedule = as_schedule(num_draft_tokens, auto_k_max(model, run.size), model.pass_tile)
    # Where the target's rows round differently with a block's size, clocks must not choose the
    # blocks (schedule.py): the same inputs then give the same output.
    fixed = None if model.row_invariant else FixedCosts(*model.block_cost)
    drafter.check_prompts(run.prompt_ids)
    if run.size > 1 and not drafter.batches:
        raise ValueError(f"the draft ({drafter!r}) runs one prompt at a time; batches need a draft on an engine "
                         "that batches (the native engine)")
    live = run.live()
    if live:
        tokens, scores = run.prefill()
        drafter.begin(run.capacity, run.size)
        with run.timer(live)("draft"):
            drafter.prefill(run.prompt_ids)
        for b in live:
            run.emit(b, run.add(b, [tokens[b]], scores[b]))
        live = run.live()
    while live:
        new = speculative_step(run.rows, drafter, schedule, fixed, {b: run.requests[b] for b in live})
        for b in live:
            run.emit(b, new[b])
        live = run.live()
    return run.results(drafter)


def speculative_step(rows: Rows, drafter, schedule, fixed: FixedCosts | None, requests: dict[int, Request],
                     drafting: set[int] | None = None, totals: Stats | None = None) -> dict[int, list[int]]:
    """One step over the live rows (row -> its Request): plan, propose, verify, accept, learn, keep.
    Returns each row's new ids. drafting: the rows that may draft (default: all); the others take
    a plain step in the same pass. totals: a Stats that also counts every row's drafts (a server's).
    fixed: the costs the schedule learns from where clocks must not choose blocks (None: clocks)."""
    live = list(requests)
    ids = {b: r.sequence() for b, r in requests.items()}
    # Plan: a source and k per row; no source (no match, a draft past its context) is a plain step.
    sources = [drafter.sources(ids[b], b) if drafting is None or b in drafting else () for b in live]
    plan = dict(zip(live, schedule.choose_batch(sources)))
    asks = {b: (ids[b], min(k, requests[b].room()), src) for b, (src, k) in plan.items()
            if min(k, requests[b].room()) > 0}
    step, setup, proposals = Timer([r.stats for r in requests.values()], rows.model.device), drafter.setup_seconds, {}
    with step("draft"):  # propose: one call per sampling setting (a model draft samples its rows with one)
        for params in {requests[b].params for b in asks}:
            group = {b: a for b, a in asks.items() if requests[b].params == params}
            proposals |= drafter.propose_rows(group, params, {b: requests[b].noise for b in group})
    setup = drafter.setup_seconds - setup  # a draft reading a prompt: not a cost of drafting
    drafted = {b: proposals.get(b, []) for b in live}
    with step("verify"):  # verify: one pass scores every live row's [pending, d1..dk]
        logits = rows.forward([[ids[b][-1]] + drafted[b] if b in ids else [] for b in range(rows.batch)])
        verdicts = {b: verify(drafted[b], logits[b], r.params, r.noise, len(ids[b])) for b, r in requests.items()}
    new = {b: r.accept(drafted[b], *verdicts[b], totals, logits[b]) for b, r in requests.items()}  # accept
    outcomes = [(plan[b][0], len(drafted[b]), verdicts[b][0]) for b in live]
    costs = fixed.step(outcomes) if fixed else (step.elapsed.get("draft", 0.0) - setup, step.elapsed["verify"])
    schedule.update_batch(outcomes, *costs)  # learn
    lengths = rows.lengths  # keep: each cache holds its accepted sequence but the pending last token
    for b, r in requests.items():
        lengths[b] = len(r.sequence()) - 1
    rows.rollback(lengths)
    for b, r in requests.items():  # the drafter sees the accepted sequences
        drafter.commit(r.sequence(), b)
    return new
