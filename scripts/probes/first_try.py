"""How many tokens should a source's first try draft? `auto` drafts a source it has not measured
yet at once (a new match length of prompt lookup or the datastore), to learn what it does,
and now that first try drafts the k a source right half the time would make
the most of at the verify costs measured so far (`AdaptiveK.first_try`: 3-4 where blocks
cost little more than a one-token pass); before, it drafted 2 on any engine. The default
drafter (prompt lookup + the shipped datastore) with each, over plain decoding, interleaved
on the held-out Spec-Bench-mix prompts; greedy, so the outputs are the same.

    python3 scripts/probes/first_try.py [--trials 2] [--max-tokens 96] [--engine native]
"""
from __future__ import annotations

from _interleave import heldout_args, heldout_default, interleaved, print_over_baseline
from schedule_replay import FirstTryTwo


def main() -> None:
    args = heldout_args()
    run = heldout_default(args.engine, args.max_tokens)
    new, old = "auto (first tries at the prior's best k)", "first tries at 2"
    methods = {"plain": run.plain, old: lambda ids: run.default(ids, FirstTryTwo(k_max=run.k_max)),
               new: lambda ids: run.default(ids, "auto")}
    times, outs = interleaved(methods, run.prompts, args.trials)
    differ = sum(a.token_ids != b.token_ids for a, b in zip(outs[new], outs[old]))
    # (llama.cpp rounds a block's rows unlike its one-token passes, so there greedy outputs may part at ties)
    assert args.engine != "native" or not differ, "greedy outputs differ on the native engine"
    print(f"{differ} of {len(outs[new])} outputs differ between the two")
    print_over_baseline(times, run.prompts, "plain", [old, new], args.trials, title=f"{args.engine} engine: ")
    print_over_baseline(times, run.prompts, old, [new], args.trials, title="paired: ")


if __name__ == "__main__":
    main()
