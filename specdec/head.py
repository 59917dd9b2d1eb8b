"""A judge of the model-free drafts that reads the target's own last hidden state.

A verify pass leaves, at the row whose logits chose the bonus token b, the target's normed
last hidden state h. A Medusa-style head (Cai et al. 2024) on h and b's embedding scores
the token after b:

    z = SiLU(W_h h + W_e e(b) + c)        score(v) = lm_head[v] . (h + z) = logit(v) + lm_head[v] . z

logit(v) is the target's own logit of v at that row, and W_h h comes out of the same pass
for 0.4% more of it: the engine scores W_h's rows with the output head's ("side rows",
`NativeLM.forward(..., side=W_h)`), so nothing else reads h. The lookups then propose with
it (`CompositeDrafter(..., head=...)`): among the datastore's candidates for the next token
the head's favourite leads the chain, and where neither the prompt nor the store has a
match the head's own best token does. The target keeps only drafts equal to its own choices,
so the output stays exact.

Trained (`specdec train-head`) on the target's hidden states over the datastore's own
replies, to predict the token two ahead; W starts at zero (the head then scores b itself).
An option: it makes 2-5% more tokens a pass, and its work a step costs nearly as much on a
2-core CPU (docs/benchmark.md, "The hidden-state head, built").
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .models.loading import SHIPPED_HEADS, tensor_digest

FORMAT = "specdec-head"
PROPOSABLE = 8192  # the tokens it may propose alone: the most frequent of its training data


def target_digest(module) -> str:
    """What ties a head to its target: the output head's weights (in bf16, whatever it runs in)."""
    return tensor_digest(module.lm_head.weight.detach().to(torch.bfloat16))[:16]


def as_float32(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a float32 numpy array. bf16 is float32's top half, so numpy widens
    it by a shift, in a microsecond; torch's conversion starts its thread team (about 30 us)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return (t.contiguous().view(torch.int16).numpy().astype(np.uint32) << 16).view(np.float32)
    return t.float().numpy()


class HiddenHead:
    """A trained head bound to its target (a native model): W [D, 2D] = [W_h, W_e], bias c."""

    def __init__(self, target, weight: torch.Tensor, bias: torch.Tensor, proposable: torch.Tensor, name="head"):
        module = getattr(target, "module", None)
        if module is None:
            raise ValueError(f"a hidden-state head needs a native target, not {target!r}")
        D = module.cfg.hidden_size
        if tuple(weight.shape) != (D, 2 * D) or tuple(bias.shape) != (D,):
            raise ValueError(f"{name}: its weights are {tuple(weight.shape)} and {tuple(bias.shape)}, "
                             f"the target needs ({D}, {2 * D}) and ({D},)")
        if proposable.ndim != 1 or not proposable.numel() or int(proposable.min()) < 0 or \
                int(proposable.max()) >= target.vocab_size:
            raise ValueError(f"{name}: its proposable tokens do not fit the target's vocabulary")
        self.name, self.target = name, target
        self.side = weight[:, :D].to(target.dtype).contiguous()  # W_h: side rows of the target's pass
        # The per-step work is small, but it runs cold, right after a pass has streamed the
        # weights through the caches: a 576 x 576 product there takes 85 us in numpy, and torch
        # adds its two threads' start-up, 150-190 us in all (scripts/probes/after_pass.py).
        # So W_e e(b) + c is kept per token once computed (a text's bonus tokens repeat), and
        # the rest is elementwise numpy.
        self.w_e, self.bias = np.ascontiguousarray(weight[:, D:].float().numpy()), bias.float().numpy()
        self.embed, self.lm_head = module.model.embed_tokens.weight.detach(), module.lm_head.weight.detach()
        self.proposable = proposable.long()  # (on the CPU: it indexes numpy rows too)
        self._proposable_rows = None  # their lm_head rows, in the target's dtype, made on first use
        self._of_token: dict[int, np.ndarray] = {}  # W_e e(b) + c by token b, filled as tokens come

    def z(self, side_out: np.ndarray, b: int) -> np.ndarray:
        """SiLU(W_h h + W_e e(b) + c) from the pass's side outputs W_h h at the row that chose b
        (float32 numpy rows, as the drafter keeps them)."""
        if (of_b := self._of_token.get(b)) is None:
            of_b = self._of_token[b] = self.w_e @ as_float32(self.embed[b]) + self.bias
        x = side_out + of_b
        return x / (1.0 + np.exp(-x))

    def scores(self, logits: np.ndarray, z: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """score(v) for each v in tokens: the target's logit plus lm_head[v] . z."""
        rows = self.lm_head[torch.from_numpy(tokens).to(self.lm_head.device)]
        return logits[tokens] + (as_float32(rows) * z).sum(axis=1)

    def best(self, logits: np.ndarray, z: np.ndarray) -> int:
        """Its own favourite among the proposable tokens. (8,192 rows: torch's bf16 product reads
        half the bytes of a float32 one, 0.24 against 0.33 ms.)"""
        if self._proposable_rows is None:
            self._proposable_rows = self.lm_head[self.proposable.to(self.lm_head.device)].contiguous()
        rows = self._proposable_rows
        mine = (rows @ torch.from_numpy(z).to(rows.device, rows.dtype)).float().cpu().numpy()
        return int(self.proposable[int((logits[self.proposable.numpy()] + mine).argmax())])

    def __repr__(self) -> str:
        return f"HiddenHead({self.name})"


def load_head(name_or_path, target) -> HiddenHead:
    """A head for `target`: by the name of the embedded target it ships for, or its file
    (safetensors, as `train_head` writes it); a ValueError if it is not one, or was trained
    for another target."""
    from safetensors import safe_open

    path = SHIPPED_HEADS.get(str(name_or_path), Path(str(name_or_path)).expanduser())
    if not path.is_file():
        raise ValueError(f"head {str(path)!r}: no such file")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in ("weight", "bias", "proposable")}
    except Exception as e:
        raise ValueError(f"head {str(path)!r}: not a specdec head ({e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"head {str(path)!r}: not a specdec head (no format metadata)")
    module = getattr(target, "module", None)
    if module is not None and meta.get("target") != target_digest(module):
        raise ValueError(f"head {str(path)!r} was trained for another target than {target.name}")
    return HiddenHead(target, tensors["weight"], tensors["bias"], tensors["proposable"], path.name)


# ----------------------------------------------------------------------------- training


@torch.inference_mode()
def last_hidden(module, ids: list[int]) -> torch.Tensor:
    """The normed last hidden state at every position of ids (torch path; one head row only)."""
    got = {}
    hook = module.model.norm.register_forward_hook(lambda m, i, o: got.__setitem__("h", o[0].clone()))
    try:
        module._forward_torch(torch.tensor(ids), module.new_cache(len(ids)), 0, False, module.lm_head.weight[:1])
    finally:
        hook.remove()
    return got["h"]


def collect(target, store, progress=None) -> dict:
    """h at every position of the store's sequences (8 tokens or more), with the tokens."""
    cut = np.flatnonzero(store.tokens == store.gap)
    seqs = [store.tokens[a + 1: b] for a, b in zip(np.concatenate([[-1], cut[:-1]]), cut)]
    seqs = [s for s in seqs if len(s) >= 8]
    H = torch.empty(sum(map(len, seqs)), target.module.cfg.hidden_size, dtype=torch.bfloat16)
    tokens, seq, at = [], [], 0
    for i, s in enumerate(progress(seqs) if progress else seqs):
        H[at: at + len(s)] = last_hidden(target.module, s.tolist())
        at += len(s)
        tokens.append(torch.from_numpy(s.astype(np.int64)))
        seq.append(torch.full((len(s),), i))
    return {"h": H, "tokens": torch.cat(tokens), "seq": torch.cat(seq)}


def _pairs(data, held: bool):
    """(h at t, token t+1, token t+2) within a sequence; held: every 20th sequence (held out)."""
    seq, tokens = data["seq"], data["tokens"]
    ok = (seq[:-2] == seq[2:]) & ((seq[:-2] % 20 == 0) == held)
    idx = torch.nonzero(ok).squeeze(1)
    return data["h"][idx], tokens[idx + 1], tokens[idx + 2]


def train_head(target, data: dict, out, *, epochs=2, batch=1024, lr=2e-3, seed=0, recipe="", log=print,
               progress=None) -> dict:
    """Fit W (from zero) to the token two ahead with cross-entropy over the target's own
    frozen head; write the head file to `out`. Returns the log: held-out top-1 per epoch."""
    torch.manual_seed(seed)
    module = target.module
    D = module.cfg.hidden_size
    embed, lm_head = module.model.embed_tokens.weight.detach(), module.lm_head.weight.detach()
    w = torch.nn.Linear(2 * D, D)
    torch.nn.init.zeros_(w.weight)
    torch.nn.init.zeros_(w.bias)

    def logits(h, b):
        x = torch.cat([h.float(), embed[b].float()], dim=-1)
        return F.linear((h.float() + F.silu(w(x))).to(lm_head.dtype), lm_head).float()

    def held_out_top1():
        with torch.no_grad():
            right = sum(int((logits(vh[i:i + 4096], vb[i:i + 4096]).argmax(-1) == vy[i:i + 4096]).sum())
                        for i in range(0, len(vh), 4096))
        return right / len(vh)

    h, b, y = _pairs(data, False)
    vh, vb, vy = _pairs(data, True)
    steps = epochs * math.ceil(len(h) / batch)
    opt = torch.optim.AdamW(w.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.05)
    history = {"pairs": len(h), "held_out_pairs": len(vh), "steps": steps, "top1_at_zero": held_out_top1(),
               "epochs": []}
    log(f"{len(h):,} training pairs, {len(vh):,} held out; held-out top-1 of the token two ahead at zero "
        f"(b itself): {history['top1_at_zero']:.3f}")
    start, bar = time.time(), progress(total=steps) if progress else None
    for epoch in range(epochs):
        perm = torch.randperm(len(h))
        losses = []
        for i in range(0, len(h), batch):
            j = perm[i:i + batch]
            loss = F.cross_entropy(logits(h[j], b[j]), y[j])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            if bar:
                bar.update()
                bar.set_postfix(loss=f"{loss.item():.3f}")
        top1 = held_out_top1()
        history["epochs"].append({"epoch": epoch + 1, "mean_loss": float(np.mean(losses)), "held_out_top1": top1,
                                  "seconds": round(time.time() - start, 1)})
        log(f"epoch {epoch + 1}: mean loss {np.mean(losses):.3f}, held-out top-1 {top1:.3f}")
    if bar:
        bar.close()
    counts = torch.bincount(data["tokens"], minlength=target.vocab_size)
    proposable = counts.argsort(descending=True)[:PROPOSABLE].sort().values.to(torch.int32)
    save_head(out, w.weight.detach(), w.bias.detach(), proposable, target_digest(module), recipe)
    return history


def save_head(path, weight, bias, proposable, digest: str, recipe: str = "") -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"weight": weight.to(torch.bfloat16).contiguous(), "bias": bias.float().contiguous(),
               "proposable": proposable.contiguous()}, str(path),
              metadata={"format": FORMAT, "target": digest, "recipe": recipe})
    return path
