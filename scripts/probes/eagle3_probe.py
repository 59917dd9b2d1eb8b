"""Would an EAGLE-3-style draft pay on the Spec-Bench mix? A probe, not a shipped drafter.

EAGLE-3 (Li et al. 2025) changes two things from the EAGLE-1 layer that
`feature_draft_probe.py` measured (its first draft right more often than the token draft's,
its later drafts hardly):
- it reads a fusion of the target's low, middle and high hidden states, not only the top one;
- it drops the feature regression and trains with "training-time test": the draft unrolls on
  its own outputs during training, so its second and third drafts are trained as they are
  used (each unrolled step attends to the true features of the verified prefix and to its
  own earlier steps, the attention pattern it has when drafting).

This script trains such a layer (one decoder layer, started from the target's top layer, the
target's frozen norm and head restricted to the shipped draft's 8192 head tokens, the loss
against the target's own top-32 distribution) on a `specdec distill` run's data, and
replays it with the target's exact features of the accepted tokens against the target's
greedy output on the held-out Spec-Bench-mix prompts, beside token drafts (the shipped one,
and optionally one distilled on the same data). Per category: first drafts right, tokens
per verification pass at k = 4 and at best, the composite rule (prompt lookup where it
matches, else the draft) at k = 4, and the decode speedup those passes would give with the
measured verify cost and draft costs.

    python3 scripts/probes/eagle3_probe.py --data drafts-local/specbench-mix/data \\
        --compare drafts-local/specbench-mix --save drafts-local/eagle3-layer.safetensors
    python3 scripts/probes/eagle3_probe.py --load drafts-local/eagle3-layer.safetensors   # replay again

Replayed in float32; the draft step is timed in bfloat16.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from specdec import ModelDrafter, generate, load_model, load_tokenizer
from specdec.bench.ceiling import draft_runs
from specdec.bench.runner import forward_ms
from specdec.bench.suite import load_suite, render
from specdec.distill import load_data
from specdec.models import kernel
from specdec.models.llama import rope_inv_freq, rotate_half

sys.path.insert(0, str(Path(__file__).parent))
from feature_draft_probe import K_MAX, Head, replay  # noqa: E402

HELDOUT = Path(__file__).parents[2] / "specdec/bench/prompts/heldout-specbench-v1.jsonl"


def rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@torch.inference_mode()
def features(target, ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """The outputs of the given target layers at every position, each RMS-normalized, [T, L, d]."""
    seen = {}
    hooks = [target.module.model.layers[i].register_forward_hook(
        lambda m, args, out, i=i: seen.__setitem__(i, out)) for i in layers]
    lib = kernel.library()
    try:
        kernel.use(None)  # the torch path, where the hooks see every layer
        target.reset(len(ids))
        target.module(target.as_tensor(ids), target.cache, last_only=True)
    finally:
        kernel.use(lib)
        for h in hooks:
            h.remove()
    return torch.stack([rms(seen[i][0].float()) for i in layers], 1).bfloat16()


class Eagle3(nn.Module):
    """fuse(low, mid, high) -> fc(embedding, feature) -> one decoder layer -> the next hidden state."""

    def __init__(self, target, n_layers: int):
        super().__init__()
        m = target.module
        cfg, d = m.cfg, m.cfg.hidden_size
        self.h, self.kvh, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.fuse = nn.Linear(n_layers * d, d, bias=False)
        self.fc = nn.Linear(2 * d, d, bias=False)
        top = m.model.layers[-1]
        self.layer = type(top)(cfg)
        self.layer.load_state_dict({k: v.float() for k, v in top.state_dict().items()})
        self.register_buffer("inv_freq", rope_inv_freq(cfg).float(), persistent=False)

    def fused(self, feats):
        """[T, L, d] target features -> [T, d], the draft's input feature for the next position."""
        return rms(self.fuse(feats.flatten(1).to(self.fuse.weight.dtype)))

    def qkv(self, emb, feat, start: int):
        T = emb.shape[0]
        a = self.layer.self_attn
        x = self.fc(torch.cat([emb, feat], -1))
        y = self.layer.input_layernorm(x)
        q = a.q_proj(y).view(T, self.h, self.hd).transpose(0, 1)
        k = a.k_proj(y).view(T, self.kvh, self.hd).transpose(0, 1)
        v = a.v_proj(y).view(T, self.kvh, self.hd).transpose(0, 1)
        pos = torch.arange(start, start + T, dtype=torch.float32)
        ang = torch.cat([torch.outer(pos, self.inv_freq)] * 2, -1)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        return x, q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def finish(self, x, o):
        """Residual, output projection and MLP, from the attention output o [H, T, hd]."""
        x = x + self.layer.self_attn.o_proj(o.transpose(0, 1).reshape(x.shape[0], -1))
        return x + self.layer.mlp(self.layer.post_attention_layernorm(x))

    def expand(self, t):
        return t.repeat_interleave(self.h // self.kvh, 0)

    def unrolled(self, emb, f1, steps: int):
        """Training-time test over a whole sequence. emb [T, d]: embeddings of tokens 1..T;
        f1 [T, d]: fused target features of positions 0..T-1. Step s predicts, at every
        position j, the hidden state after j as drafting would at its s-th draft: its input
        feature is its own step s-1 output at j - 1, and it attends to step 1's keys up to
        j - s + 1 (the verified prefix) and to step t's key at j - s + t for t = 2..s."""
        T = emb.shape[0]
        scale = self.hd ** -0.5
        outs, keys, feat = [], [], f1
        pos = torch.arange(T)
        for s in range(1, steps + 1):
            x, q, k, v = self.qkv(emb, feat, start=1)
            keys.append((self.expand(k), self.expand(v)))
            K1, V1 = keys[0]
            main = (q @ K1.transpose(1, 2)) * scale
            main = main.masked_fill(pos[None, :] > (pos[:, None] - s + 1), float("-inf"))
            diag, vals = [], []
            for t in range(2, s + 1):
                shift = s - t  # step t's key sits at j - shift
                Kt, Vt = keys[t - 1]
                Kt = F.pad(Kt, (0, 0, shift, 0))[:, :T]
                vals.append(F.pad(Vt, (0, 0, shift, 0))[:, :T])
                d = (q * Kt).sum(-1, keepdim=True) * scale
                diag.append(d.masked_fill((pos < shift)[None, :, None], float("-inf")))
            p = torch.cat([main] + diag, -1).softmax(-1)
            o = p[..., :T] @ V1
            for i, vt in enumerate(vals):
                o = o + p[..., T + i:T + i + 1] * vt
            a = self.finish(x, o)
            outs.append(a)
            feat = F.pad(rms(a), (0, 0, 1, 0))[:T]  # step s's output at j - 1 feeds step s + 1 at j
        return outs

    def step(self, emb, feat, position: int, past):
        """One drafting step at `position` with a KV list `past` (keys/values [KVH, n, hd]);
        returns its hidden state and the past with its own key appended."""
        x, q, k, v = self.qkv(emb[None], feat[None], start=position)
        K = torch.cat([past[0], k], 1)
        V = torch.cat([past[1], v], 1)
        o = F.scaled_dot_product_attention(q[None], K[None], V[None], enable_gqa=True)[0]
        return self.finish(x, o)[0], (K, V)


def labels(example, head_column, T: int):
    """Rows (positions, 0-based over tokens 1..T) with the target's top-32 mapped into the head:
    (rows, column ids [n, 32] with -1 outside the head, probabilities renormalized over them)."""
    rows = torch.arange(len(example.top_ids)) + example.prompt_len - 2  # position P-1+t, token index -1
    cols = head_column[example.top_ids]
    p = example.top_logp.masked_fill(cols < 0, float("-inf")).softmax(-1).nan_to_num(0.0)
    keep = (rows >= 0) & (rows < T) & (cols >= 0).any(-1)
    return rows[keep], cols[keep].clamp(min=0), p[keep]


def train(draft, head, embed, data, epochs: int, lr: float, steps: int, seed: int):
    params = list(draft.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    col = torch.full((embed.num_embeddings,), -1, dtype=torch.long)
    col[head.ids] = torch.arange(len(head.ids))
    rng = random.Random(seed)
    total, n = epochs * len(data), 0
    for epoch in range(epochs):
        order = list(range(len(data)))
        rng.shuffle(order)
        bar = tqdm(order, desc=f"epoch {epoch + 1}/{epochs}", unit="seq")
        recent = []
        for i in bar:
            example, feats = data[i]
            tokens = example.tokens
            with torch.no_grad():
                emb = embed(tokens[1:]).float()
            T = emb.shape[0]
            rows, cols, p = labels(example, col, T)
            if not len(rows):
                continue
            f1 = draft.fused(feats[:-1].float())
            outs = draft.unrolled(emb, f1, steps)
            losses = []
            for a in outs:
                logq = head.logits(a[rows]).log_softmax(-1)
                losses.append(-(p * logq.gather(-1, cols)).sum(-1).mean())
            loss = sum(losses) / len(losses)
            for g in opt.param_groups:
                g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * n / total))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            n += 1
            recent.append([x.item() for x in losses])
            if n % 50 == 0:
                bar.set_postfix(loss="/".join(f"{sum(c) / len(c):.2f}" for c in zip(*recent[-50:])))


@torch.inference_mode()
def eagle_runs(draft, head, embed, ids, out, feats, k_max: int) -> list[int]:
    """runs[t]: drafts the target accepts with out[:t] generated, the layer starting from the
    exact features of the accepted tokens and its own outputs after that."""
    seq = torch.tensor(ids + out)
    P, n = len(ids), len(out)
    emb = embed(seq[1:]).float()
    f1 = draft.fused(feats[:-1].float())
    (a1,) = draft.unrolled(emb, f1, 1)  # index j - 1 holds position j
    _, _, K, V = draft.qkv(emb, f1, start=1)
    runs = [0] * n
    for t in range(1, n):
        pos = P + t - 1
        past = (K[:, :pos], V[:, :pos])  # positions 1..pos
        x = a1[pos - 1]
        accepted = 0
        while accepted < k_max and P + t + accepted < len(seq):
            if head.token(x) != int(seq[P + t + accepted]):
                break
            accepted += 1
            nxt = P + t + accepted - 1
            if accepted == k_max or nxt + 1 >= len(seq):
                break
            x, past = draft.step(emb[nxt - 1], rms(x), nxt, past)
        runs[t] = accepted
    return runs


@torch.inference_mode()
def step_cost(target, draft, head_tokens, t1: float, context: int = 300) -> float:
    """One bf16 drafting step (fusing one new position's features, the layer with `context`
    keys cached, the restricted head) over a one-token target pass."""
    layer = Eagle3(target, draft.fuse.in_features // draft.fc.out_features).to(torch.bfloat16)
    layer.load_state_dict(draft.state_dict())
    head = Head(target, head_tokens, torch.bfloat16)
    d = draft.fc.out_features
    past = (torch.zeros(layer.kvh, context, layer.hd, dtype=torch.bfloat16),) * 2
    emb = target.module.model.embed_tokens(torch.tensor([5]))[0]
    feats = torch.zeros(1, draft.fuse.in_features // d, d, dtype=torch.bfloat16)
    times = []
    for _ in range(25):
        start = time.perf_counter()
        f = layer.fused(feats)[0]
        x, _ = layer.step(emb, f, context, past)
        head.logits(x).argmax()
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:]) * 1e3 / t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", help="a `specdec distill` run's data folder (to train on)")
    ap.add_argument("--load", help="a layer saved with --save, instead of training one")
    ap.add_argument("--save", help="write the trained layer here (safetensors)")
    ap.add_argument("--compare", help="a token draft (a distill run's folder) to replay beside the shipped one")
    ap.add_argument("--layers", default="2,15,27", help="target layers whose outputs are fused")
    ap.add_argument("--steps", type=int, default=3, help="training-time-test unroll")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--max-seqs", type=int, default=0, help="train on at most this many sequences (0: all)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--outputs", default="/tmp/eagle3-heldout-outputs.json", help="cache of the greedy outputs")
    args = ap.parse_args()
    if not (args.data or args.load):
        ap.error("give --data to train a layer, or --load to replay a saved one")
    torch.manual_seed(0)
    torch.set_num_threads(2)
    layers = tuple(int(x) for x in args.layers.split(","))
    tok = load_tokenizer("smollm2-135m-instruct")
    target = load_model("smollm2-135m-instruct")
    shipped = load_model("smollm2-135m-instruct-draft")
    head = Head(target, shipped.head_tokens)
    embed = target.module.model.embed_tokens
    draft = Eagle3(target, len(layers))
    if args.load:
        draft.load_state_dict(load_file(args.load))
    else:
        examples = load_data(Path(args.data))
        if args.max_seqs:
            examples = random.Random(0).sample(examples, min(args.max_seqs, len(examples)))
        data = [(e, features(target, e.tokens.tolist(), layers)) for e in tqdm(examples, desc="target features", unit="seq")]
        print(f"{len(data)} sequences, {sum(len(e.tokens) for e, _ in data)} tokens")
        start = time.perf_counter()
        train(draft, head, embed, data, args.epochs, args.lr, args.steps, seed=0)
        print(f"trained in {time.perf_counter() - start:.0f} s")
        del data
    if args.save:
        save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, args.save)

    prompts = load_suite(HELDOUT)
    render(prompts, target, tok)
    cached = Path(args.outputs)
    if cached.exists():
        outputs = json.loads(cached.read_text())
    else:
        outputs = {p.id: generate(target, tok, p.ids, args.max_tokens).token_ids for p in tqdm(prompts, desc="greedy outputs")}
        cached.write_text(json.dumps(outputs))
    token_drafts = {"shipped draft": ModelDrafter(shipped)}
    if args.compare:
        token_drafts[Path(args.compare).name] = ModelDrafter(load_model(args.compare))
    drafts = {"eagle-3 layer": lambda ids, out: eagle_runs(draft, head, embed, ids, out,
                                                            features(target, ids + out, layers), K_MAX)}
    for name, d in token_drafts.items():
        drafts[name] = lambda ids, out, d=d: draft_runs(d, ids, out, K_MAX)
    rows = replay(prompts, outputs, drafts)
    ms = forward_ms(target, [1, 5], 300)
    t1, verify = ms[1], ms[5] / ms[1]
    c = {"eagle-3 layer": step_cost(target, draft, shipped.head_tokens, t1)}
    for name, d in token_drafts.items():
        c[name] = forward_ms(d.model, [1], 300)[1] / t1
    print(f"\ntarget pass {t1:.1f} ms (1 token), verify cost at 5 tokens {verify:.2f}; draft step c: "
          + ", ".join(f"{k} {v:.3f}" for k, v in c.items()) + "\n")
    print("| category | draft | first draft right | tokens/pass k=4 | at best | composite rule k=4 "
          "| lookup or it, at best | decode speedup, composite k=4 (est.) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for where, r in sorted(rows.items(), key=lambda kv: (kv[0] == "grounded", kv[0])):
        n = r["tokens"]
        for name in drafts:
            passes = r[f"{name} composite"]
            speedup = n / (passes * verify + r[f"{name} composite drafted"] * c[name])
            label = "all" if where == "grounded" else where
            print(f"| {label} | {name} | {r[f'{name} first'] / n:.2f} | {n / r[f'{name} k']:.2f} "
                  f"| {n / r[f'{name} best']:.2f} | {n / passes:.2f} | {n / r[f'{name} or lookup best']:.2f} "
                  f"| {speedup:.2f}x |")


if __name__ == "__main__":
    main()
