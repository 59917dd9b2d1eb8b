"""Would `auto` gain from starting each call at the verify costs the last call measured? What
a verify pass costs is the engine's and the machine's, not the prompt's, so a schedule could
carry them. On the held-out Spec-Bench-mix prompts, the default drafter (prompt lookup + the
shipped datastore) with `num_draft_tokens="auto"` (a fresh schedule each call, which measures
the costs again) against the same with a schedule that starts from the verify costs of the
previous call (acceptance not carried), each over plain decoding, interleaved; greedy, so
the outputs are the same. --engine llama.cpp runs them on the llama.cpp engine.

    python3 scripts/probes/carried_costs.py [--trials 2] [--max-tokens 96] [--engine native]
"""
from __future__ import annotations

from _interleave import heldout_args, heldout_default, interleaved, print_over_baseline
from specdec.schedule import AdaptiveK


def main() -> None:
    args = heldout_args()
    run = heldout_default(args.engine, args.max_tokens)
    last = AdaptiveK(k_max=run.k_max)  # the previous carried call's schedule

    def carried(ids):
        nonlocal last
        s = AdaptiveK(k_max=run.k_max)
        s.verify_n, s.verify_s = dict(last.verify_n), dict(last.verify_s)
        last = s
        return run.default(ids, s)

    methods = {"plain": run.plain, "auto (fresh)": lambda ids: run.default(ids, "auto"), "costs carried": carried}
    times, outs = interleaved(methods, run.prompts, args.trials)
    assert all(a.token_ids == b.token_ids for a, b in zip(outs["auto (fresh)"], outs["costs carried"]))
    print_over_baseline(times, run.prompts, "plain", [m for m in methods if m != "plain"], args.trials,
                        title=f"{args.engine} engine: ")
    print_over_baseline(times, run.prompts, "auto (fresh)", ["costs carried"], args.trials, title="paired: ")


if __name__ == "__main__":
    main()
