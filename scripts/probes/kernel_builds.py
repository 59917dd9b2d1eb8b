"""Two or more builds of the native kernel, end to end: plain decoding and the default drafter
(prompt lookup + the shipped datastore, `auto`) on the held-out Spec-Bench-mix prompts, each
build made the engine's kernel in turn (`kernel.use`), interleaved in one process, so a
noisy spell hits every build alike. Greedy: every build must give the same tokens.

    python3 scripts/probes/kernel_builds.py NAME=libspecdec_kernel.so NAME=... [--trials 2] [--max-tokens 96]

A commit's build: `git worktree add /tmp/old COMMIT && PYTHONPATH=/tmp/old python3 -c "from
specdec.models import kernel; print(kernel.build())"` prints its path.
"""
from __future__ import annotations

import argparse

import torch

import specdec
from _interleave import interleaved, print_over_baseline
from specdec import CompositeDrafter, generate, speculative_generate
from specdec.bench.suite import load_suite, render
from specdec.models import kernel

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("libs", nargs="+", metavar="NAME=PATH")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(2)
    libs = {name: kernel.load(path) for name, path in (a.split("=", 1) for a in args.libs)}
    target = specdec.load_model("smollm2-135m-instruct")
    store = specdec.load_datastore("smollm2-135m-instruct")
    prompts = load_suite(HELDOUT)
    render(prompts, target, target.tokenizer)

    def on(lib, run):
        def call(ids):
            kernel.use(lib)
            return run(ids)
        return call

    methods = {}
    for name, lib in libs.items():
        methods[f"{name} plain"] = on(lib, lambda ids: generate(target, None, ids, args.max_tokens))
        methods[f"{name} default"] = on(lib, lambda ids: speculative_generate(
            target, CompositeDrafter(datastore=store), None, ids, args.max_tokens))
    times, outs = interleaved(methods, prompts, args.trials)
    first = next(iter(outs.values()))
    assert all([o.token_ids for o in out] == [o.token_ids for o in first] for out in outs.values())
    base = next(iter(libs))
    for name in libs:
        print_over_baseline(times, prompts, f"{base} plain", [f"{name} plain", f"{name} default"], args.trials,
                            title=f"{name}: ")
    names = list(libs)
    for name in names[1:]:
        print_over_baseline(times, prompts, f"{base} default", [f"{name} default"], args.trials, title="paired: ")


if __name__ == "__main__":
    main()
