"""How fast could the drafters make decoding on an engine, with a perfect schedule? A replay
with foresight: at every step the schedule knows how many of each source's proposals the
target will accept, drafts exactly those from the best source, and pays the engine's measured
cost for that pass. No schedule of these drafters can beat it, so where it stays under a bar,
no schedule change reaches the bar.

The replay is the bench's (`specdec.bench.ceiling.ceilings`, which `specdec bench` reports as
"With a perfect schedule"): the target's greedy output on the 26 held-out prompts (96 tokens),
each source's accepted runs at every position, and the fastest way through them at the
engine's cost of a pass over n tokens, measured here after 300 cached (the draft model's own
cost c beside it). Plain decoding costs a one-token pass a token; both share the prompt's
reading, measured per prompt, for the end-to-end figures. Geometric means of per-prompt ratios.

    python3 scripts/probes/oracle_schedule.py [--engine native|llama.cpp] [--k-max 16] [--rounds 5]
"""
from __future__ import annotations

import argparse
import time

import torch

import specdec
from specdec.bench.ceiling import KINDS, ceilings
from specdec.bench.runner import forward_ms
from specdec.bench.suite import load_suite, render

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="native", choices=["native", "llama.cpp"])
    ap.add_argument("--k-max", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = specdec.load_model("smollm2-135m-instruct", engine=args.engine)
    draft = specdec.ModelDrafter(specdec.load_model("smollm2-135m-instruct-draft", engine=args.engine))
    v = forward_ms(target, range(1, args.k_max + 2), context=300, rounds=args.rounds)  # ms
    c_draft = forward_ms(draft.model, [1], context=300, rounds=args.rounds)[1] / v[1]
    print(f"engine {args.engine}: one-token pass {v[1]:.2f} ms after 300 cached; a pass over n = 2, 3, 5, 9, 17 "
          "tokens: " + " / ".join(f"{v[n] / v[1]:.2f}" for n in (2, 3, 5, 9, 17) if n in v)
          + f" one-token passes; the draft's pass c = {c_draft:.3f} of the target's")
    # The replay reads the draft's argmaxes along the true sequence from one pass, on the native
    # engine (llama.cpp's multi-token logits would round alike but for ties).
    replayed = draft if args.engine == "native" else specdec.ModelDrafter(specdec.load_model("smollm2-135m-instruct-draft"))
    prompts = load_suite(HELDOUT)
    render(prompts, target, target.tokenizer)
    outputs, plain = {}, {}
    for p in prompts:
        outputs[p.id] = specdec.generate(target, None, p.ids, args.max_tokens).token_ids
        target.reset(len(p.ids) + 1)
        start = time.perf_counter()
        target.forward(p.ids, last_only=True)
        prefill = time.perf_counter() - start
        plain[p.id] = (prefill + (len(outputs[p.id]) - 1) * v[1] / 1e3, prefill)
    cost = {n: t / v[1] for n, t in v.items()}
    store = specdec.load_datastore("smollm2-135m-instruct")
    for title, timing in (("decode", None), ("end to end", plain)):
        charged = {"c": c_draft, "measured": "apart, warm"}
        sp = ceilings(prompts, outputs, args.k_max, replayed, store, cost, charged, timing)["speedup"]
        cats = sorted(sp["lookup"]["categories"]) + ["all"]
        print(f"\nthe perfect schedule over plain decoding, {title}, k <= {args.k_max} ({len(prompts)} prompts, "
              f"{args.max_tokens} tokens; geometric means of per-prompt ratios):")
        print(f"  {'':20s}" + "".join(f"{w[:10]:>11s}" for w in cats))
        for kind in KINDS:
            row = {**sp[kind]["categories"], "all": sp[kind]["overall"]}
            print(f"  {kind:20s}" + "".join(f"{row[w]:10.2f}x" for w in cats))


if __name__ == "__main__":
    main()
