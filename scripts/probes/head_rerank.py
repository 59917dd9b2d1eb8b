"""Timed: does choosing the default's first draft with the hidden-state head pay in the real
loop? (docs/benchmark.md, "Route: the target's hidden state as a judge": replayed, choosing
among lookup's and the store's first tokens the one the head likes best makes 4.4% more
tokens a pass on the held-out prompts.)

The head (hidden_scorer.py) reads the target's normed last hidden state h at the row that chose
the bonus token b: score(v) = lm_head[v] . (h + SiLU(W_h h + W_e e(b) + c)). lm_head[v] . h is the
target's own logit of v, and W_h h comes out of the same pass with no kernel change: the
kernel scores whatever head rows it is given, so W_h's 576 rows are appended to lm_head's (0.4%
of a pass). The drafter then takes, among lookup's first token and the store's first tokens,
the one with the best score, and the default's chain after it (lookup, else the store).
Interleaved with the shipped default on the 26 held-out prompts, `auto` for both, greedy (the
outputs must be plain greedy's), paired per prompt.

    python3 scripts/probes/head_rerank.py --head /tmp/hs/head.safetensors [--store-only] [--head-alone] [--trials 2]

--store-only chooses only where `auto` chose the store (not over lookup's copies); --head-alone
adds the head's own token as a source where neither lookup nor the store has anything.
"""
from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch
from safetensors.torch import load_file
import torch.nn.functional as F

import specdec
from _interleave import interleaved, print_over_baseline
from hidden_scorer import head_then_store
from specdec import CompositeDrafter, NgramDrafter, generate, speculative_generate
from specdec.bench.suite import load_suite, render

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"
HEAD_TOKENS = "specdec/assets/smollm2-135m-instruct-draft/head_tokens.json"  # the shipped draft's 8,192


class HeadedTarget:
    """The target with W_h's rows appended to its output head: each pass keeps, by position,
    its rows' logits and W_h h, and gives the loop the logits."""

    def __init__(self, target, w: torch.Tensor):
        self.target, self.module, self.V = target, target.module, target.vocab_size
        D = self.module.cfg.hidden_size
        self.rows = torch.cat([self.module.lm_head.weight, w[:, :D].to(torch.bfloat16)]).contiguous()
        self.at: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, ids, last_only=False):
        start, n = self.target.cache_len, len(ids)
        self.module._scatter_head = lambda x, _ids: x  # the raw rows: logits, then W_h h
        try:
            out = self.module(self.target.as_tensor(ids), self.target.cache, last_only=last_only, head=(None, self.rows))
        finally:
            del self.module._scatter_head
        first = start + n - out.shape[0]
        self.at = {first + i: (out[i, :self.V], out[i, self.V:]) for i in range(out.shape[0])}
        return out[:, :self.V]


class RerankDrafter(CompositeDrafter):
    """The default drafter (lookup, else the store) whose first token is the one the head
    likes best among lookup's and the store's first tokens; with head_alone, the head's own
    token where neither has anything."""

    def __init__(self, store, headed: HeadedTarget, state: dict, store_only: bool = False, head_alone: bool = False):
        super().__init__(lookup=NgramDrafter(), datastore=store)
        D = headed.module.cfg.hidden_size
        self.headed, self.w_e, self.c = headed, state["weight"][:, D:].float(), state["bias"].float()
        self.embed, self.lm_head = headed.module.model.embed_tokens.weight, headed.module.lm_head.weight
        self.changed, self.store_only, self.head_alone = 0, store_only, head_alone
        self.vocab = torch.tensor(json.loads(open(HEAD_TOKENS).read())["token_ids"])
        self.vocab_rows = self.lm_head[self.vocab].float()

    def sources(self, ids, row=0):
        """Where neither lookup nor the store has anything, the head's own token (--head-alone)."""
        found = super().sources(ids, row)
        if not found and self.head_alone and self.headed.at.get(len(ids) - 2) is not None:
            return ("head",)
        return found

    def z(self, ids):
        logits, wh = self.headed.at[len(ids) - 2]
        return logits, F.silu(wh + self.w_e @ self.embed[ids[-1]].float() + self.c)

    def propose_rows(self, requests, params, noises):
        alone = {b: r for b, r in requests.items() if r[2] == "head"}
        out = super().propose_rows({b: r for b, r in requests.items() if b not in alone}, params, noises)
        for b, (ids, k, _) in alone.items():  # the head's best among the draft's head tokens
            logits, z = self.z(ids)
            best = int(self.vocab[int((logits[self.vocab] + self.vocab_rows @ z).argmax())])
            out[b] = head_then_store(ids, self.store.store, best, k), None
        for b, (ids, k, src) in requests.items():
            if b in alone:
                continue
            chain = out.get(b, ([], None))[0]
            got = self.headed.at.get(len(ids) - 2)
            found = self.store._match(ids, b)
            if not chain or got is None or not found or (self.store_only and not src.startswith("store")):
                continue
            store = self.store.store
            nxt = store.tokens[store.voters(found)]
            cands = torch.tensor(sorted({chain[0], *np.unique(nxt[nxt != store.gap]).tolist()}))
            if len(cands) == 1:
                continue
            logits, z = self.z(ids)
            score = logits[cands] + (self.lm_head[cands].float() @ z)
            best = int(cands[int(score.argmax())])
            if best != chain[0]:
                self.changed += 1
                out[b] = head_then_store(ids, self.store.store, best, k), None
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--prompts", default=HELDOUT)
    ap.add_argument("--store-only", action="store_true", help="choose only where `auto` chose the store, not lookup")
    ap.add_argument("--head-alone", action="store_true",
                    help="where neither source has anything, draft the head's own token (a source of its own)")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = specdec.load_model("smollm2-135m-instruct")
    headed_target = specdec.load_model("smollm2-135m-instruct")  # its own cache; the same weights' values
    store = specdec.load_datastore("smollm2-135m-instruct")
    state = load_file(args.head)
    headed = HeadedTarget(headed_target, state["weight"])
    headed_target.forward = headed.forward
    rerank = RerankDrafter(store, headed, state, store_only=args.store_only, head_alone=args.head_alone)
    prompts = load_suite(args.prompts)
    render(prompts, target, target.tokenizer)
    n = args.max_tokens
    methods = {
        "plain": lambda ids: generate(target, None, ids, n),
        "default": lambda ids: speculative_generate(target, CompositeDrafter(lookup=NgramDrafter(), datastore=store),
                                                    None, ids, n),
        "reranked by the head": lambda ids: speculative_generate(headed_target, rerank, None, ids, n),
    }
    times, outputs = interleaved(methods, prompts, args.trials)
    same = all(a.token_ids == b.token_ids for a, b in zip(outputs["plain"], outputs["reranked by the head"]))
    print(f"reranked outputs equal plain greedy's: {same}; first tokens changed: {rerank.changed}")
    for name in ("default", "reranked by the head"):
        tp = [o.stats.target_calls for o in outputs[name]]
        print(f"  {name}: tokens a target call {sum(len(o.token_ids) for o in outputs[name]) / sum(tp):.3f}")
    print_over_baseline(times, prompts, "plain", list(methods), args.trials)
    ratios = [statistics.median(times["default", p.id]) / statistics.median(times["reranked by the head", p.id])
              for p in prompts]
    print(f"reranked over the default, paired: {np.exp(np.mean(np.log(ratios))):.3f}x")


if __name__ == "__main__":
    main()
