"""How fast does the target write `specdec distill`'s data: on the native engine (batched
kernel passes) against transformers' `generate`, on the same 32 training prompts (the
spec-bench mix), 128 tokens, sampled at temperature 0.7 with the top-32 labels kept, as
`distill` does. The native engine runs first and last, so a noisy spell shows.

    python3 scripts/probes/distill_writes.py
"""
from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec import distill as D
from specdec import load_model
from specdec.distill_prompts import training_conversations
from specdec.models.loading import hf_checkpoint


def main() -> None:
    torch.set_num_threads(2)
    path = hf_checkpoint("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    ids = sorted((tokenizer(D._render(tokenizer, c[:1], []), add_special_tokens=False)["input_ids"]
                  for c in training_conversations(64, 7, mix="spec-bench")), key=len)[16:48]
    native = load_model(path, dtype="bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, use_safetensors=True).eval()
    eos = set(native.eos_token_ids)
    print(f"{len(ids)} prompts of {len(ids[0])}-{len(ids[-1])} tokens, 128 new tokens each, temperature 0.7")
    for name, model in (("native", native), ("transformers", hf), ("native", native)):
        start = time.perf_counter()
        rows = D.target_writes(model, ids, 128, 0.7, 32, eos, 2, torch.Generator().manual_seed(0))
        seconds = time.perf_counter() - start
        n = sum(len(r[0]) for r in rows)
        print(f"  {name:12s} {n} tokens in {seconds:5.1f} s: {n / seconds:4.0f} tok/s, "
              f"{60 * len(ids) / seconds:4.0f} sequences a minute")


if __name__ == "__main__":
    main()
