"""How many drafts a step should `auto` allow? On the AMX kernel a pass of 17 rows pays for a
second round of tile products (`kernel.tile_rows`), a step the schedule's line of verify costs
does not see. The default drafter (prompt lookup + datastore) and lookup alone, each with
`AdaptiveK(k_max=K)`, over plain decoding on the held-out Spec-Bench-mix prompts, paired per
prompt, interleaved. Greedy, so every output is the same.

    python3 scripts/probes/schedule_kmax.py [--trials 2] [--max-tokens 96] [--k-max 16 15 12 8]
"""
from __future__ import annotations

import argparse

import torch

import specdec
from _interleave import interleaved, print_over_baseline
from specdec import CompositeDrafter, NgramDrafter, generate, speculative_generate
from specdec.bench.suite import load_suite, render
from specdec.models import kernel
from specdec.schedule import AdaptiveK

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k-max", type=int, nargs="+", default=[16, 15, 12, 8])
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = specdec.load_model("smollm2-135m-instruct")
    store = specdec.load_datastore("smollm2-135m-instruct")
    prompts = load_suite(HELDOUT)
    render(prompts, target, target.tokenizer)
    n = args.max_tokens
    methods = {"plain": lambda ids: generate(target, None, ids, n)}
    for km in args.k_max:
        methods[f"default, k <= {km}"] = lambda ids, km=km: speculative_generate(
            target, CompositeDrafter(lookup=NgramDrafter(), datastore=store), None, ids, n,
            num_draft_tokens=AdaptiveK(k_max=km))
    for km in args.k_max[:2]:
        methods[f"lookup, k <= {km}"] = lambda ids, km=km: speculative_generate(
            target, NgramDrafter(), None, ids, n, num_draft_tokens=AdaptiveK(k_max=km))
    times, _ = interleaved(methods, prompts, args.trials)  # (method, prompt) -> seconds per token
    names = [m for m in methods if m != "plain"]
    print_over_baseline(times, prompts, "plain", names, args.trials, f"kernel {kernel.isa()}; ")


if __name__ == "__main__":
    main()
