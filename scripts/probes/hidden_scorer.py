"""Can the target's own last hidden state tell the model-free drafts' right proposals from
wrong ones before they are verified? (Issue 22: the default loses most of its way to the
perfect schedule in drafts that fail and copy runs cut short, docs/benchmark.md.)

A verify pass leaves the target's normed last hidden state h of the last verified position,
whose logits chose the bonus token b. A Medusa-style head (Cai et al. 2024) reads h and b's
embedding and scores the token after b: h' = h + SiLU(W [h; e(b)]), logits = lm_head(h'),
W 576 x 1152, started at zero (it then scores b itself). Scoring a proposal's first token
costs one 1152 x 576 product and a dot per candidate: nothing beside a pass.

    python3 scripts/probes/hidden_scorer.py collect --out /tmp/hs   # the target over the store's replies
    python3 scripts/probes/hidden_scorer.py train --data /tmp/hs --epochs 2
    python3 scripts/probes/hidden_scorer.py replay --data /tmp/hs [--max-tokens 96]

`collect` runs the target (teacher-forced, torch path) over the shipped datastore's own
sequences and keeps h at every position; `train` fits the head to the token two ahead,
holding 5% of the sequences out; `replay` walks the target's greedy output on the 26
held-out prompts (which neither the store nor the head saw) and, at each step, compares
what each signal says about the default's proposal with whether the target accepts it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

import specdec
import specdec.head
from specdec.bench.suite import load_suite, render
from specdec.drafters import find_match

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"


@torch.inference_mode()
def hidden_states(module, ids: list[int], logits: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The normed last hidden state and the float logits at every position of ids (without
    logits, one token's column only: a fraction of the work)."""
    got = {}
    hook = module.model.norm.register_forward_hook(lambda m, i, o: got.__setitem__("h", o[0].clone()))
    try:
        cache = module.new_cache(len(ids))
        rows = None if logits else module.lm_head.weight[:1]
        out = module._forward_torch(torch.tensor(ids), cache.row(0), 0, False, rows)
    finally:
        hook.remove()
    return got["h"], out


class Head(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        d = module.cfg.hidden_size
        self.w = torch.nn.Linear(2 * d, d)
        torch.nn.init.zeros_(self.w.weight)
        torch.nn.init.zeros_(self.w.bias)
        self.embed = module.model.embed_tokens.weight.detach()  # frozen: the target's own
        self.lm_head = module.lm_head.weight.detach()

    def features(self, h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x = torch.cat([h.float(), self.embed[b].float()], dim=-1)
        return h.float() + F.silu(self.w(x))

    def forward(self, h, b):
        return F.linear(self.features(h, b).to(self.lm_head.dtype), self.lm_head).float()


def collect(args) -> None:
    """The product's collection (specdec.head.collect), kept as a file for train and replay."""
    target = specdec.load_model("smollm2-135m-instruct")
    store = specdec.load_datastore("smollm2-135m-instruct")
    data = specdec.head.collect(target, store, lambda xs: tqdm(xs, desc="sequences"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(data, out / "hidden.safetensors")
    print(f"{len(data['tokens']):,} positions -> {out / 'hidden.safetensors'}")


def train(args) -> None:
    """The product's training (specdec.head.train_head), from a collected file."""
    target = specdec.load_model("smollm2-135m-instruct")
    data = load_file(Path(args.data) / "hidden.safetensors")
    specdec.head.train_head(target, data, Path(args.data) / "head.safetensors", epochs=args.epochs,
                            batch=args.batch, lr=args.lr, progress=lambda total: tqdm(total=total, desc="training"))


def load_weights(head: Head, path) -> Head:
    """A head file's W and c (a specdec head file, or the probe's older one) into a Head."""
    state = load_file(str(path))
    head.w.load_state_dict({k: state[k].float() for k in ("weight", "bias")})
    return head


def auc(scores, labels) -> float:
    """The chance a right proposal scores above a wrong one (ties half)."""
    from scipy.stats import rankdata
    s, y = np.asarray(scores, float), np.asarray(labels, bool)
    r = rankdata(s)
    n1, n0 = y.sum(), (~y).sum()
    return float((r[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0)) if n1 and n0 else float("nan")


def default_chain(ids, store, k=4):
    match, found = find_match(np.asarray(ids), 3, 1), store.match(ids)
    return ids[match[0]: match[0] + k] if match else store.continuation(found, k) if found else []


def head_then_store(ids, store, first: int, k=4):
    """The head's token, then what the store (or lookup) would draft after it."""
    return [first] + default_chain(ids + [first], store, k - 1)


def rerank(ids, store, score, margin: float, k=4):
    """The default chain, unless the head likes its own top token better by `margin` (log p)."""
    chain, top = default_chain(ids, store, k), int(score.argmax())
    if not chain or (top != chain[0] and float(score[top] - score[chain[0]]) > margin):
        return head_then_store(ids, store, top, k)
    return chain


def store_candidates(ids, store, score, k=4, branches=1):
    """Among the store's first tokens after the match (and lookup's), the one the head likes
    best (with branches > 1: that many, best first, each with its chain: a tree)."""
    found = store.match(ids)
    cands = {}
    chain = default_chain(ids, store, k)
    if chain:
        cands[chain[0]] = chain
    if found:
        at = store.voters(found)
        nxt = store.tokens[at]
        for v in np.unique(nxt[nxt != store.gap]).tolist():
            cands.setdefault(v, None)
    if not cands:
        return head_then_store(ids, store, int(score.argmax()), k)
    best = sorted(cands, key=lambda v: -float(score[v]))[:branches]
    chains = [cands[v] or head_then_store(ids, store, v, k) for v in best]
    return chains if branches > 1 else chains[0]


RULES = {
    "the default's (lookup, else the store)": lambda ids, store, score: default_chain(ids, store),
    "the head's token, then the default's": lambda ids, store, score: head_then_store(ids, store, int(score.argmax())),
    "the default's unless the head prefers its own by 0": lambda ids, store, score: rerank(ids, store, score, 0.0),
    "the default's unless the head prefers its own by 1": lambda ids, store, score: rerank(ids, store, score, 1.0),
    "the default's unless the head prefers its own by 2": lambda ids, store, score: rerank(ids, store, score, 2.0),
    "the store's candidate the head likes best": store_candidates,
    "the default's, else (nothing offered) the head's token and the default's after it":
        lambda ids, store, score: default_chain(ids, store) or head_then_store(ids, store, int(score.argmax())),
    "the store's candidate it likes best, else the head's token": lambda ids, store, score: (
        store_candidates(ids, store, score) if default_chain(ids, store) else
        head_then_store(ids, store, int(score.argmax()))),
    "a tree: the two candidates it likes best, each with its chain": lambda ids, store, score: store_candidates(
        ids, store, score, branches=2),
    "a tree: the three it likes best": lambda ids, store, score: store_candidates(ids, store, score, branches=3),
}


def replay(args) -> None:
    target = specdec.load_model("smollm2-135m-instruct")
    store = specdec.load_datastore("smollm2-135m-instruct")
    head = Head(target.module)
    load_weights(head, Path(args.data) / "head.safetensors")
    prompts = load_suite(args.prompts)
    render(prompts, target, target.tokenizer)
    rows = []  # one per step that a source proposed at
    chains, rows_of = {}, {}
    for p in tqdm(prompts, desc="prompts"):
        out = specdec.generate(target, None, p.ids, args.max_tokens).token_ids
        seq = p.ids + out
        hs, logits = hidden_states(target.module, seq)
        with torch.no_grad():
            scores = torch.log_softmax(head(hs, torch.tensor(seq[1:] + [0])), -1)
        lp = torch.log_softmax(logits, -1)
        for rule in RULES:
            t = 1
            while t < len(out):
                ids = seq[: len(p.ids) + t]
                chain = RULES[rule](ids, store, scores[len(ids) - 2])
                if chain and isinstance(chain[0], list):  # a tree of chains: the target walks the one it writes
                    rows_of.setdefault(rule, []).append(sum(map(len, chain)))
                    chain = next((c for c in chain if c[0] == out[t]), chain[0])
                right = 0
                while right < len(chain) and t + right < len(out) and chain[right] == out[t + right]:
                    right += 1
                chains.setdefault(rule, []).append(1 + right)
                t += right + 1
        t = 1
        while t < len(out):
            ids = seq[: len(p.ids) + t]  # the last is the bonus token b; h of the one before it is known
            at = len(ids) - 2
            match, found = find_match(np.asarray(ids), 3, 1), store.match(ids)
            if match:
                src, n, chain = "lookup", match[1], ids[match[0]: match[0] + 4]
            elif found:
                src, n, chain = "store", found[0], store.continuation(found, 4)
            else:
                chain = []
            if not chain:
                t += 1
                continue
            right = 0
            while right < len(chain) and t + right < len(out) and chain[right] == out[t + right]:
                right += 1
            p_b = float(lp[at, ids[-1]].exp())
            ent = float(-(lp[at].exp() * lp[at]).sum())
            top = int(scores[at].argmax())
            rows.append(dict(cat=p.category, src=src, n=n, right=right, first=right > 0, p_b=p_b, ent=ent,
                             head=float(scores[at, chain[0]]), head_top=bool(top == out[t]) if t < len(out) else False,
                             head_agrees=bool(top == chain[0])))
            t += right + 1
    if args.dump:
        Path(args.dump).write_text(json.dumps(rows))
    print("\nchains of 4 walked through the target's output (tokens a pass = 1 + accepted, at every step):")
    for rule, got in chains.items():
        rows = f", {np.mean(rows_of[rule]):.1f} drafts a pass" if rule in rows_of else ""
        print(f"  {rule:62s} {np.mean(got):.3f} tokens a pass, {len(got)} passes{rows}")
    print(f"\n{len(rows)} proposing steps on {len(prompts)} prompts; first proposal right "
          f"{np.mean([r['first'] for r in rows]):.3f}; the head's own top-1 right {np.mean([r['head_top'] for r in rows]):.3f}")
    for src in ("lookup", "store"):
        sub = [r for r in rows if r["src"] == src]
        y = [r["first"] for r in sub]
        print(f"\n{src}: {len(sub)} steps, first right {np.mean(y):.3f}; AUC of each signal for it:")
        for name, f in (("match length", lambda r: r["n"]), ("target's p(b)", lambda r: r["p_b"]),
                        ("target's -entropy", lambda r: -r["ent"]), ("head's log p(first)", lambda r: r["head"])):
            print(f"  {name:22s} {auc([f(r) for r in sub], y):.3f}")
        agree = [r for r in sub if r["head_agrees"]]
        rest = [r for r in sub if not r["head_agrees"]]
        print(f"  head's top-1 is the proposal: {len(agree)} steps, right {np.mean([r['first'] for r in agree]):.3f}; "
              f"otherwise {len(rest)}, right {np.mean([r['first'] for r in rest]):.3f}")
        for q in (0.25, 0.5):
            cut = np.quantile([r["head"] for r in sub], q)
            lo = [r for r in sub if r["head"] < cut]
            print(f"  head's lowest {q:.0%}: right {np.mean([r['first'] for r in lo]):.3f}, "
                  f"tokens {np.mean([r['right'] for r in lo]):.2f} a step; the rest {np.mean([r['first'] for r in sub if r['head'] >= cut]):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--out", required=True)
    t = sub.add_parser("train")
    t.add_argument("--data", required=True)
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--batch", type=int, default=1024)
    t.add_argument("--lr", type=float, default=1e-3)
    r = sub.add_parser("replay")
    r.add_argument("--data", required=True)
    r.add_argument("--prompts", default=HELDOUT)
    r.add_argument("--max-tokens", type=int, default=96)
    r.add_argument("--dump", help="write every proposing step's signals here (JSON), to fit a calibration")
    args = ap.parse_args()
    torch.set_num_threads(2)
    {"collect": collect, "train": train, "replay": replay}[args.cmd](args)


if __name__ == "__main__":
    main()
