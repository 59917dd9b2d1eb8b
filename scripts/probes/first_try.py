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

import argparse

import torch

import specdec
from _interleave import interleaved, print_over_baseline
from specdec import CompositeDrafter, generate, speculative_generate
from specdec.bench.suite import load_suite, render
from specdec.schedule import AdaptiveK

from schedule_replay import FirstTryTwo

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--engine", default="native", choices=["native", "llama.cpp"])
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = specdec.load_model("smollm2-135m-instruct", engine=args.engine)
    store = specdec.load_datastore("smollm2-135m-instruct")
    prompts = load_suite(HELDOUT)
    render(prompts, target, target.tokenizer)
    tile = getattr(target, "pass_tile", None)
    k_max = min(AdaptiveK.K_MAX, tile - 1) if tile else AdaptiveK.K_MAX  # as "auto" takes it

    def default(ids, k):
        return speculative_generate(target, CompositeDrafter(datastore=store), None, ids, args.max_tokens,
                                    num_draft_tokens=k)

    new, old = "auto (first tries at the prior's best k)", "first tries at 2"
    methods = {"plain": lambda ids: generate(target, None, ids, args.max_tokens),
               old: lambda ids: default(ids, FirstTryTwo(k_max=k_max)),
               new: lambda ids: default(ids, "auto")}
    times, outs = interleaved(methods, prompts, args.trials)
    differ = sum(a.token_ids != b.token_ids for a, b in zip(outs[new], outs[old]))
    # (llama.cpp rounds a block's rows unlike its one-token passes, so there greedy outputs may part at ties)
    assert args.engine != "native" or not differ, "greedy outputs differ on the native engine"
    print(f"{differ} of {len(outs[new])} outputs differ between the two")
    print_over_baseline(times, prompts, "plain", [old, new], args.trials, title=f"{args.engine} engine: ")
    print_over_baseline(times, prompts, old, [new], args.trials, title="paired: ")


if __name__ == "__main__":
    main()
