"""What would the default gain if its lookups cost nothing? The ceiling of any faster lookup
(the step in C, say). For each held-out prompt the default drafter (prompt lookup + the shipped
datastore) is first asked, untimed, at every context of the greedy output, for its sources and
each source's longest proposal; then the same decoding runs timed, interleaved, with the real
drafter and with one that answers from the record (a dict lookup and a slice: a proposal of k
tokens is the first k of the longest, for both lookups). Greedy, so every run asks about the
same contexts and the outputs are the same; the schedule and the passes are the real ones.

    python3 scripts/probes/free_lookups.py [--trials 2] [--max-tokens 96] [--engine native]
"""
from __future__ import annotations

from _interleave import heldout_args, heldout_default, interleaved, print_over_baseline
from specdec import CompositeDrafter


def book(store, prompt: list[int], output: list[int], k_max: int) -> dict:
    """At every context of a greedy run (by its length), the default drafter's sources and each
    one's longest proposal."""
    drafter = CompositeDrafter(datastore=store)
    drafter.begin(len(prompt) + len(output))
    pages = {}
    for t in range(len(output) + 1):
        ids = prompt + output[:t]
        found = drafter.sources(ids)
        pages[len(ids)] = found, {s: drafter.propose_rows({0: (ids, k_max, s)}, None, {0: None}).get(0, ([], None))[0]
                                  for s in found}
    return pages


class Recorded(CompositeDrafter):
    """Answers from a book: what the default drafter offered at each context, at no search."""

    def __init__(self, datastore, book):
        super().__init__(datastore=datastore)
        self.book = book

    def sources(self, ids, row=0):
        return self.book[len(ids)][0]

    def propose_rows(self, requests, params, noises):
        out = {}
        for row, (ids, k, source) in requests.items():
            tokens = self.book[len(ids)][1][source][:k]
            if tokens:
                out[row] = tokens, None
        return out


def main() -> None:
    args = heldout_args()
    run = heldout_default(args.engine, args.max_tokens)
    books = {tuple(p.ids): book(run.store, p.ids, run.plain(p.ids).token_ids, run.k_max) for p in run.prompts}
    methods = {"plain": run.plain,
               "default": lambda ids: run.default(ids, "auto"),
               "default, lookups free": lambda ids: run.default(ids, "auto", Recorded(run.store, books[tuple(ids)]))}
    times, outs = interleaved(methods, run.prompts, args.trials)
    differ = sum(a.token_ids != b.token_ids for a, b in zip(outs["default"], outs["default, lookups free"]))
    assert args.engine != "native" or not differ, "greedy outputs differ on the native engine"
    print_over_baseline(times, run.prompts, "plain", ["default", "default, lookups free"], args.trials,
                        title=f"{args.engine} engine: ")
    print_over_baseline(times, run.prompts, "default", ["default, lookups free"], args.trials, title="paired: ")


if __name__ == "__main__":
    main()
