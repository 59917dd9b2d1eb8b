"""What a decoding step costs outside the model passes and the drafter: the loop's own time.

Runs plain decoding and the default drafter (prompt lookup + the shipped datastore, `auto`)
on held-out prompts of the given categories, and reports, per target pass, the wall time
that none of the Stats timings (prefill, draft, verify) holds: building the context, finding
the drafter's sources, the schedule, acceptance bookkeeping, rollback. Rounds alternate the
two loops; medians.

    python3 scripts/probes/loop_overhead.py [--categories stem,humanities,qa] [--rounds 3] [--parts] [--engine llama.cpp]

--parts then times the default's step apart, with hooks around its parts (each hook adds
about a microsecond): per target pass, all the time outside the target's passes, and in it
the drafter's sources (the lookups' searches), its proposals, the schedule's choice and
update, and greedy verification's argmax; on llama.cpp (`--engine llama.cpp`) also the
time in `llama_decode` itself (the rest of the target's passes is the engine's batch and its
copy of the logits) and the share of passes whose size differs from the pass before (where
llama.cpp rebuilds its graph). The hooks wrap names, not lines, so the probe runs
on an older checkout too (`PYTHONPATH=OLD python3 scripts/probes/loop_overhead.py --parts`).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

import specdec
from specdec import CompositeDrafter, decoding
from specdec.schedule import AdaptiveK
from specdec.bench.suite import load_suite
from specdec.models import llamacpp
from specdec.models.loading import load_datastore

HELDOUT = Path(__file__).resolve().parents[2] / "specdec/bench/prompts/heldout-specbench-v1.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--categories", default="stem,humanities,qa")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parts", action="store_true", help="also the default's step, part by part")
    ap.add_argument("--engine", default="native", choices=["native", "llama.cpp"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [p.turns[0] for p in load_suite(HELDOUT, categories=args.categories.split(","))]
    target = specdec.load_model("smollm2-135m-instruct", engine=args.engine)
    tok, store = target.tokenizer, load_datastore("smollm2-135m-instruct")
    loops = {
        "plain": lambda p: specdec.generate(target, tok, p, args.max_tokens, chat=True),
        "default": lambda p: specdec.speculative_generate(
            target, specdec.CompositeDrafter(lookup=specdec.NgramDrafter(), datastore=store, tokenizer=tok),
            tok, p, args.max_tokens, chat=True),
    }
    loops["plain"](prompts[0])  # warm up
    per_pass = {name: [] for name in loops}
    for _ in range(args.rounds):
        for name, run in loops.items():
            untimed = passes = 0
            for p in prompts:
                start = time.perf_counter()
                g = run(p)
                untimed += time.perf_counter() - start - sum(g.stats.timings.values())
                passes += g.stats.target_calls
            per_pass[name].append(untimed / passes)
    print(f"{len(prompts)} prompts ({args.categories}), {args.max_tokens} tokens, median of {args.rounds} rounds:")
    for name, xs in per_pass.items():
        print(f"  {name}: {statistics.median(xs) * 1e3:.3f} ms a target pass outside the timed work")
    if args.parts:
        parts(loops["default"], prompts, args.rounds, args.engine)


def parts(run, prompts, rounds: int, engine: str) -> None:
    """Per target pass: the time outside the target's passes, and the parts of it that the hooks
    below time (medians of `rounds` rounds)."""
    spent = Counter()

    def hook(owner, name, label):
        f = getattr(owner, name)

        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[label] += time.perf_counter() - start
        setattr(owner, name, timed)

    hook(decoding._Run, "forward", "the target's passes")
    hook(CompositeDrafter, "sources", "drafter: sources (the lookups' searches)")
    hook(CompositeDrafter, "propose_rows", "drafter: proposals")
    hook(AdaptiveK, "choose_batch", "schedule: choice")
    hook(AdaptiveK, "update_batch", "schedule: update")
    hook(decoding, "verify", "verification: argmax, accepted drafts")
    sizes = []
    if engine == "llama.cpp":  # the engine's own work around llama_decode, and how often a pass's size changes
        lib = llamacpp.llama_cpp()
        hook(lib, "llama_decode", "the target's passes: llama_decode")
        decode = lib.llama_decode
        lib.llama_decode = lambda ctx, batch: (sizes.append(batch.n_tokens), decode(ctx, batch))[1]
    rows = defaultdict(list)
    for _ in range(rounds):
        spent.clear()
        passes, total = 0, 0.0
        for p in prompts:
            start = time.perf_counter()
            passes += run(p).stats.target_calls
            total += time.perf_counter() - start
        rows["outside the target's passes"].append((total - spent["the target's passes"]) / passes)
        for label, seconds in spent.items():
            rows[label].append(seconds / passes)
        if sizes:
            rows["share of passes whose size changes"].append(sum(a != b for a, b in zip(sizes, sizes[1:])) / len(sizes))
            sizes.clear()
    print(f"the default's step, ms a target pass (median of {rounds} rounds):")
    for label, xs in rows.items():
        if label.startswith("share"):
            print(f"  {label:42s} {statistics.median(xs):7.2f}")
        else:
            print(f"  {label:42s} {statistics.median(xs) * 1e3:7.3f}")


if __name__ == "__main__":
    main()
