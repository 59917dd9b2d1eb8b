"""Where `auto`'s steps go: every step of the default drafter (prompt lookup + the shipped
datastore) sorted by why the schedule took it (a plain step, a first try of an unmeasured
source, a probe after plain steps, a draft it expected to pay), with each kind's accepted
tokens and its net cost: the pass's time over a plain step's, less one, less the tokens it
won, summed, in one-token passes (positive: the kind loses time).

    python3 scripts/probes/schedule_steps.py [--engine llama.cpp] [--categories stem,humanities,qa,roleplay,math_reasoning]
"""
from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch

import specdec
from specdec.bench.suite import load_suite
from specdec.models.loading import load_datastore
from specdec.schedule import AdaptiveK

HELDOUT = Path(__file__).resolve().parents[2] / "specdec/bench/prompts/heldout-specbench-v1.jsonl"


class Traced(AdaptiveK):
    """An AdaptiveK that logs, per step, (source, k, why, accepted, verify seconds)."""

    def __init__(self):
        super().__init__()
        self.log = []

    def choose_batch(self, rows):
        plan = super().choose_batch(rows)
        src, k = plan[0]
        why = ("plain" if not k else "probe" if self.sources[src].probing else
               "first try" if self.sources[src].t_draft is None else "draft")
        self.log.append([src, k, why])
        return plan

    def update_batch(self, outcomes, draft_seconds, verify_seconds):
        self.log[-1] += [outcomes[0][2], verify_seconds]
        super().update_batch(outcomes, draft_seconds, verify_seconds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="native")
    ap.add_argument("--categories", default="stem,humanities,qa,roleplay,math_reasoning")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [p.turns[0] for p in load_suite(HELDOUT, categories=args.categories.split(","))]
    target = specdec.load_model("smollm2-135m-instruct", engine=args.engine)
    tok, store = target.tokenizer, load_datastore("smollm2-135m-instruct")
    specdec.generate(target, tok, prompts[0], 8, chat=True)  # warm up
    total = collections.Counter()
    for p in prompts:
        schedule = Traced()
        drafter = specdec.CompositeDrafter(lookup=specdec.NgramDrafter(), datastore=store, tokenizer=tok)
        specdec.speculative_generate(target, drafter, tok, p, args.max_tokens, chat=True, num_draft_tokens=schedule)
        plain = [v for _, k, _, _, v in schedule.log if not k]
        one = sum(plain) / len(plain) if plain else schedule.pass_time(1)
        for src, k, why, accepted, seconds in schedule.log:
            kind = why if not k else f"{why}, {'lookup' if src.startswith('lookup') else 'datastore'}"
            total[kind, "steps"] += 1
            total[kind, "accepted"] += accepted
            total[kind, "cost"] += seconds / one - 1 - accepted
    print(f"{len(prompts)} prompts ({args.categories}), {args.engine} engine, {args.max_tokens} tokens")
    for kind in sorted({kind for kind, _ in total}):
        print(f"  {kind:22s} steps {total[kind, 'steps']:5d}  accepted {total[kind, 'accepted']:5d}  "
              f"net cost {total[kind, 'cost']:7.1f} one-token passes")


if __name__ == "__main__":
    main()
