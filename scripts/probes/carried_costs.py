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

import argparse

import torch

import specdec
from _interleave import interleaved, print_over_baseline
from specdec import CompositeDrafter, generate, speculative_generate
from specdec.bench.suite import load_suite, render
from specdec.schedule import AdaptiveK

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

    last = AdaptiveK(k_max=k_max)  # the previous carried call's schedule

    def carried(ids):
        nonlocal last
        s = AdaptiveK(k_max=k_max)
        s.verify_n, s.verify_s = dict(last.verify_n), dict(last.verify_s)
        last = s
        return default(ids, s)

    methods = {"plain": lambda ids: generate(target, None, ids, args.max_tokens),
               "auto (fresh)": lambda ids: default(ids, "auto"),
               "costs carried": carried}
    times, outs = interleaved(methods, prompts, args.trials)
    assert all(a.token_ids == b.token_ids for a, b in zip(outs["auto (fresh)"], outs["costs carried"]))
    print_over_baseline(times, prompts, "plain", [m for m in methods if m != "plain"], args.trials,
                        title=f"{args.engine} engine: ")
    print_over_baseline(times, prompts, "auto (fresh)", ["costs carried"], args.trials, title="paired: ")


if __name__ == "__main__":
    main()
