"""Does a quantized draft GGUF bring the default to 1.4x llama.cpp's plain decoding? On the
llama.cpp engine the shipped draft's bf16 GGUF scores its full 49,152-token head (GGUF has
no head-token list), so a draft step costs c = 0.2 of a target pass. Written as Q8_0 or
Q4_0 (gguf's own quantizer, `write_gguf(file_type=...)`) it reads 2-4x fewer bytes.

This times one-token passes of the target (bf16) and each draft form after 300 cached
tokens, then runs, interleaved per prompt on the 26 held-out prompts, llama.cpp's own
greedy loop, our plain decoding, and the composite (default) and the draft alone with
`auto` on each draft form, all on the llama.cpp engine with the bf16 target; greedy, so
the outputs are the target's. Speedups are over llama.cpp's loop, per prompt (median of
the trials), averaged geometrically.

    python3 scripts/probes/quantized_draft.py [--trials 2] [--max-tokens 96]
"""
from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import specdec
from _interleave import interleaved
from specdec import CompositeDrafter, ModelDrafter, generate, speculative_generate
from specdec.bench.methods import LlamaCpp
from specdec.bench.suite import load_suite, render
from specdec.models.gguf_write import write_gguf
from specdec.models.llamacpp import LlamaCppLM
from specdec.models.loading import embedded_gguf_path, hf_checkpoint

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"
CACHED = 300


def one_token_ms(model, reps: int = 30) -> float:
    model.reset(CACHED + 2)
    model.forward(list(range(1000, 1000 + CACHED)), last_only=True)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        model.forward([7])
        times.append(time.perf_counter() - start)
        model.rollback(CACHED)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    target = specdec.load_model("smollm2-135m-instruct", engine="llama.cpp")
    drafts = {"bf16": specdec.load_model("smollm2-135m-instruct-draft", engine="llama.cpp")}
    tmp = Path(tempfile.mkdtemp())
    for file_type in ("q8_0", "q4_0"):
        path = write_gguf(hf_checkpoint("smollm2-135m-instruct-draft"), tmp / f"draft.{file_type}.gguf",
                          file_type=file_type, metadata_from=embedded_gguf_path("smollm2-135m-instruct"))
        drafts[file_type] = LlamaCppLM(path, tokenizer=drafts["bf16"].tokenizer, name=file_type)
    t1 = statistics.median(one_token_ms(target) for _ in range(3))
    print(f"one-token pass after {CACHED} cached: target bf16 {t1:.2f} ms")
    for name, d in drafts.items():
        ms = one_token_ms(d)
        print(f"  draft {name:5s} {ms:5.2f} ms  c = {ms / t1:.3f}  ({d.path.stat().st_size / 2**20:.0f} MiB)")

    prompts = load_suite(HELDOUT)
    render(prompts, target, target.tokenizer)
    peer = LlamaCpp("llama.cpp-greedy", target.path, eos_ids=target.eos_token_ids, n_ctx=4096, threads=2)
    methods = {"llama.cpp greedy": lambda ids: peer.call(ids, args.max_tokens)[0],
               "ours, plain": lambda ids: generate(target, None, ids, args.max_tokens)}
    for name, d in drafts.items():
        for kind, make in (("composite", CompositeDrafter), ("draft", ModelDrafter)):
            methods[f"{kind}, {name}"] = lambda ids, drafter=make(d): speculative_generate(
                target, drafter, None, ids, args.max_tokens)
    times, outputs = interleaved(methods, prompts, args.trials)
    stats = {name: [g.stats for g in outs if hasattr(g, "stats")] for name, outs in outputs.items()}
    print(f"over llama.cpp's greedy loop, {len(prompts)} held-out prompts, {args.trials} trials, "
          f"{args.max_tokens} tokens, geometric mean of per-prompt ratios:")
    for name in methods:
        ratios = [statistics.median(times["llama.cpp greedy", p.id]) / statistics.median(times[name, p.id])
                  for p in prompts]
        line = f"  {name:18s} {math.exp(statistics.fmean(map(math.log, ratios))):.2f}x"
        s = stats.get(name)
        if s and sum(x.drafted for x in s):
            line += (f"   accepted/drafted {sum(x.accepted for x in s) / max(1, sum(x.drafted for x in s)):.2f}"
                     f"   tokens a pass {sum(x.generated for x in s) / sum(x.target_calls for x in s):.2f}")
        print(line)


if __name__ == "__main__":
    main()
