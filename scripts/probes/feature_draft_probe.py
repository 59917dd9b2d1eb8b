"""Would a feature-level draft close RAG's gap to 2x? A probe, not a shipped drafter.

EAGLE (Li et al. 2024) drafts from the target's own last hidden state instead of from
tokens alone: one decoder layer reads (embedding of token i, target feature at i - 1),
predicts the feature at i, and the target's frozen norm and output head turn it into
token i + 1; further drafts feed the predicted feature back in. The target computes the
features of every accepted token during verification anyway, so the draft starts each
block from exact features.

This script trains such a layer on the target's own writing (the data folder of a
`specdec distill` run, which holds prompts the bench never uses), then replays it, like
the bench's ceilings (specdec/bench/ceiling.py), against the target's greedy output on
the bench's grounded prompts, and prints per category: the share of first drafts right,
tokens per verification pass at k = 4 and at best (up to 16 drafts, drafting free), the
same with prompt lookup where it matches, the shipped draft beside it, and the decode
speedup that would follow from the measured verify cost and the layer's measured cost.

    specdec distill --target smollm2-135m-instruct --out runs/probe --prompts 2000 \\
        --heldout 40 --max-new-tokens 128 --steps 1    # the shipped draft's data (~50 min)
    python3 scripts/probes/feature_draft_probe.py --data runs/probe/data --save runs/probe/layer.safetensors
    python3 scripts/probes/feature_draft_probe.py --load runs/probe/layer.safetensors   # replay it again

The layer is replayed in float32 and timed in bfloat16.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from specdec import ModelDrafter, generate, load_model, load_tokenizer
from specdec.bench.ceiling import draft_runs, fewest_passes, lookup_runs
from specdec.bench.runner import forward_ms
from specdec.bench.suite import load_suite, render
from specdec.distill import load_data
from specdec.drafters import find_match
from specdec.models.llama import rope_inv_freq, rotate_half

K_MAX = 16


@torch.inference_mode()
def features(target, ids: list[int]) -> torch.Tensor:
    """The target's last hidden state at every position, RMS-normalized (without the norm's
    weight), [T, d]. Raw, a few dimensions reach thousands and would swamp the regression."""
    seen = {}
    hook = target.module.model.layers[-1].register_forward_hook(lambda m, args, out: seen.setdefault("x", out))
    try:
        target.reset(len(ids))
        target.module(target.as_tensor(ids), target.cache, last_only=True)
    finally:
        hook.remove()
    x = seen["x"][0].float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + target.module.model.norm.eps)).bfloat16()


class FeatureDraft(nn.Module):
    """fc(embedding, feature) -> one Llama decoder layer -> the next feature (EAGLE-1)."""

    def __init__(self, target):
        super().__init__()
        m = target.module
        cfg, d = m.cfg, m.cfg.hidden_size
        self.h, self.kvh, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.fc = nn.Linear(2 * d, d, bias=False)
        last = m.model.layers[-1]  # start from the target's top layer: less to learn from little data
        self.layer = type(last)(cfg)
        self.layer.load_state_dict({k: v.float() for k, v in last.state_dict().items()})
        self.register_buffer("inv_freq", rope_inv_freq(cfg).float(), persistent=False)

    def rope(self, start: int, T: int, dtype):
        pos = torch.arange(start, start + T, dtype=torch.float32)
        emb = torch.cat([torch.outer(pos, self.inv_freq)] * 2, dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, emb, feat, start: int, past=None):
        """emb, feat: [T, d] for positions start..start+T-1 (feat: the feature one position
        earlier). past: (K, V) of earlier positions. Returns (predicted features, (K, V))."""
        T = emb.shape[0]
        a = self.layer.self_attn
        x = self.fc(torch.cat([emb, feat], -1))[None]
        y = self.layer.input_layernorm(x)
        q = a.q_proj(y).view(1, T, self.h, self.hd).transpose(1, 2)
        k = a.k_proj(y).view(1, T, self.kvh, self.hd).transpose(1, 2)
        v = a.v_proj(y).view(1, T, self.kvh, self.hd).transpose(1, 2)
        cos, sin = self.rope(start, T, x.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        L = k.shape[2]
        mask = torch.arange(L)[None, :] <= torch.arange(L - T, L)[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        x = x + a.o_proj(o.transpose(1, 2).reshape(1, T, -1))
        x = x + self.layer.mlp(self.layer.post_attention_layernorm(x))
        return x[0], (k, v)


class Head:
    """The target's frozen final norm and output head, restricted to the draft's head tokens."""

    def __init__(self, target, ids, dtype=torch.float32):
        m = target.module
        self.ids = torch.as_tensor(ids)
        self.norm_w = m.model.norm.weight.detach().to(dtype)
        self.eps = m.model.norm.eps
        self.w = m.lm_head.weight.detach()[self.ids].to(dtype)

    def logits(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_w
        return x @ self.w.T

    def token(self, x) -> int:
        return int(self.ids[self.logits(x).argmax(-1)])


def train(draft, head, embed, data, epochs: int, lr: float, seed: int):
    """EAGLE's loss: smooth L1 on the next feature + 0.1 x cross-entropy against the target's
    (head-restricted) distribution, with uniform noise on the input features."""
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    total, step = epochs * len(data), 0
    log = []
    for epoch in range(epochs):
        order = list(range(len(data)))
        rng.shuffle(order)
        bar = tqdm(order, desc=f"epoch {epoch + 1}/{epochs}", unit="seq")
        for i in bar:
            tokens, feats = data[i]
            f = feats.float()
            with torch.no_grad():
                emb = embed(tokens[1:]).float()
            noisy = f[:-1] + (torch.rand_like(f[:-1]) - 0.5) * 0.2
            pred, _ = draft(emb, noisy, start=1)
            reg = F.smooth_l1_loss(pred, f[1:])
            with torch.no_grad():
                p_target = head.logits(f[1:]).softmax(-1)
            cls = -(p_target * head.logits(pred).log_softmax(-1)).sum(-1).mean()
            loss = reg + 0.1 * cls
            for g in opt.param_groups:  # cosine decay
                g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / total))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)
            opt.step()
            step += 1
            log.append((reg.item(), cls.item()))
            if step % 50 == 0:
                r, c = (sum(x) / len(log[-50:]) for x in zip(*log[-50:]))
                bar.set_postfix(reg=f"{r:.3f}", cls=f"{c:.3f}")


@torch.inference_mode()
def feature_runs(draft, head, embed, ids: list[int], out: list[int], feats, k_max: int) -> list[int]:
    """runs[t]: drafts the target accepts with out[:t] generated, the layer drafting from the
    exact features of the accepted tokens and its own predicted features after that."""
    seq = torch.tensor(ids + out)
    P, n = len(ids), len(out)
    f = feats.float()
    pred, (K, V) = draft(embed(seq[1:]).float(), f[:-1], start=1)  # position j at index j - 1
    runs = [0] * n
    for t in range(1, n):
        pos = P + t - 1  # the pending token's position; the first draft is the token after it
        past = (K[:, :, :pos], V[:, :, :pos])  # positions 1..pos
        x = pred[pos - 1]
        accepted = 0
        while accepted < k_max and P + t + accepted < len(seq):
            if head.token(x) != int(seq[P + t + accepted]):
                break
            accepted += 1
            if accepted == k_max or P + t + accepted >= len(seq):
                break
            nxt = P + t + accepted - 1  # the position just drafted, now an input
            y, past = draft(embed(seq[nxt:nxt + 1]).float(), x[None], start=nxt, past=past)
            x = y[0]
        runs[t] = accepted
    return runs


def passes_at_k(runs: list[int], k: int) -> int:
    """Verification passes with k drafts a step."""
    t, passes = 1, 0
    while t < len(runs):
        t += min(runs[t], k) + 1
        passes += 1
    return passes


def composite_passes(seq: list[int], P: int, lookup: list[int], model: list[int], k: int) -> tuple[int, int]:
    """(passes, model drafts) of the composite rule at k: prompt lookup where the context
    has a match (free), else the model."""
    t, passes, drafted = 1, 0, 0
    while t < len(lookup):
        match = lookup[t] > 0 or find_match(np.asarray(seq[: P + t]), 3, 1) is not None
        t_next = t + min(lookup[t] if match else model[t], k) + 1
        drafted += 0 if match else min(k, len(lookup) - t - 1)
        passes += 1
        t = t_next
    return passes, drafted


def replay(prompts, outputs, drafts: dict, k: int = 4) -> dict:
    """Per category and over all: tokens after the first, and for each draft the first drafts
    right, passes at k and at best, the composite rule's passes and drafts at k, and the
    best of lookup or the draft at each pass."""
    rows = defaultdict(lambda: defaultdict(float))
    for p in tqdm(prompts, desc="replay"):
        out = outputs[p.id]
        lookup = lookup_runs(p.ids, out, K_MAX)
        for name, runs_of in drafts.items():
            runs = runs_of(p.ids, out)
            passes, drafted = composite_passes(p.ids + out, len(p.ids), lookup, runs, k)
            for where in (p.category, "grounded"):
                r = rows[where]
                r[f"{name} first"] += sum(x > 0 for x in runs[1:])
                r[f"{name} k"] += passes_at_k(runs, k)
                r[f"{name} best"] += fewest_passes(runs)
                r[f"{name} composite"] += passes
                r[f"{name} composite drafted"] += drafted
                r[f"{name} or lookup best"] += fewest_passes([max(a, b) for a, b in zip(lookup, runs)])
        for where in (p.category, "grounded"):
            rows[where]["tokens"] += max(len(out) - 1, 0)
    return rows


@torch.inference_mode()
def costs(target, shipped: ModelDrafter, trained: FeatureDraft, head_tokens, context: int = 300) -> dict:
    """The target's 1-token pass (ms) and its 5-token pass relative to it, after `context`
    tokens, and c (a draft step / a 1-token target pass) for each draft in bfloat16."""
    ms = forward_ms(target, [1, 5], context)
    t1 = ms[1]
    layer = FeatureDraft(target).to(torch.bfloat16)
    layer.load_state_dict(trained.state_dict())
    head = Head(target, head_tokens, torch.bfloat16)
    cache = torch.zeros(1, layer.kvh, context, layer.hd, dtype=torch.bfloat16)
    emb = target.module.model.embed_tokens(torch.tensor([5]))
    feat = torch.zeros(1, layer.fc.out_features, dtype=torch.bfloat16)
    times = []
    for _ in range(17):
        start = time.perf_counter()
        head.logits(layer(emb, feat, start=context, past=(cache, cache))[0]).argmax()
        times.append(time.perf_counter() - start)
    return {"t1": t1, "verify": ms[5] / t1,
            "feature": statistics.median(times[2:]) * 1e3 / t1,
            "shipped draft": forward_ms(shipped.model, [1], context)[1] / t1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", help="a `specdec distill` run's data folder (to train on)")
    ap.add_argument("--load", help="a layer saved with --save, instead of training one")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--outputs", help="cache of the greedy outputs (JSON; written if missing)")
    ap.add_argument("--save", help="write the trained layer here (safetensors)")
    args = ap.parse_args()
    if not (args.data or args.load):
        ap.error("give --data to train a layer, or --load to replay a saved one")
    torch.manual_seed(0)
    torch.set_num_threads(2)
    tok = load_tokenizer("smollm2-135m-instruct")
    target = load_model("smollm2-135m-instruct")
    shipped = load_model("smollm2-135m-instruct-draft")
    head = Head(target, shipped.head_tokens)
    embed = target.module.model.embed_tokens

    draft = FeatureDraft(target)
    if args.load:
        draft.load_state_dict(load_file(args.load))
    else:
        examples = load_data(Path(args.data))
        data = [(e.tokens.long(), features(target, e.tokens.tolist()).clone())
                for e in tqdm(examples, desc="target features", unit="seq")]
        print(f"{len(data)} sequences, {sum(len(t) for t, _ in data)} tokens")
        train(draft, head, embed, data, args.epochs, args.lr, seed=0)
    if args.save:
        save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, args.save)

    prompts = load_suite(categories=["code_editing", "rag", "summarization"])
    render(prompts, target, tok)
    cached = Path(args.outputs) if args.outputs else None
    if cached and cached.exists():
        outputs = json.loads(cached.read_text())
    else:
        outputs = {p.id: generate(target, tok, p.ids, 128).token_ids for p in tqdm(prompts, desc="greedy outputs")}
        if cached:
            cached.write_text(json.dumps(outputs))
    shipped_drafter = ModelDrafter(shipped)
    rows = replay(prompts, outputs, {
        "feature": lambda ids, out: feature_runs(draft, head, embed, ids, out, features(target, ids + out), K_MAX),
        "shipped draft": lambda ids, out: draft_runs(shipped_drafter, ids, out, K_MAX)})
    c = costs(target, shipped_drafter, draft, shipped.head_tokens)

    print(f"\ntarget pass {c['t1']:.1f} ms (1 token), verify cost at 5 tokens {c['verify']:.2f}; one draft "
          f"step: feature layer c = {c['feature']:.3f}, shipped draft c = {c['shipped draft']:.3f}\n")
    print("| category | draft | first draft right | tokens/pass k=4 | at best | composite rule k=4 "
          "| lookup or it, at best | decode speedup, composite k=4 (est.) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for where, r in sorted(rows.items()):
        n = r["tokens"]
        for name in ("feature", "shipped draft"):
            passes = r[f"{name} composite"]
            speedup = n / (passes * c["verify"] + r[f"{name} composite drafted"] * c[name])
            print(f"| {where} | {name} | {r[f'{name} first'] / n:.2f} | {n / r[f'{name} k']:.2f} "
                  f"| {n / r[f'{name} best']:.2f} | {n / passes:.2f} | {n / r[f'{name} or lookup best']:.2f} "
                  f"| {speedup:.2f}x |")


if __name__ == "__main__":
    main()
