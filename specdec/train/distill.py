"""`specdec distill`: train a small draft model for a target, on the target's own outputs.

On-policy distillation (as in DistillSpec): the target answers a prompt set (one greedy
and one sampled continuation per prompt) and its logits at every generated position are
kept (top-k log-probabilities) as soft labels. The draft, a few-layer model of the same
Llama family, is trained to match them (forward KL on the target's top-k). What matters
for speculation is agreement with the target on text the target writes, which is why
the data is the target's own generations and the headline metric is held-out greedy
agreement (the draft's argmax equals the target's).

When the draft has the target's width it shares the target's (tied) embedding and output
matrix, frozen: the trainable part is then only the layers, small enough to ship in git,
and the draft's output lives in exactly the target's token space.

Everything is resumable: generated shards are kept, training checkpoints every
`save_every` steps (safetensors, never a pickle), and the run is deterministic for a
seed. Outputs in `out/`: data/, train-state/, train-log.jsonl, recipe.json and the
final checkpoint (config.json + model.safetensors + tokenizer), loadable by
`load_model` and by transformers.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .prompts import MIXES

# In a folder of its own: a checkpoint loader reads every *.safetensors beside the draft.
STATE_FILE = "train-state/state.safetensors"
PASSAGE_TOKENS = 192  # length of the passages the target writes to be summarized
OWN_TURN_TOKENS = 96  # longest user turn the target writes for mix "self"
OWN_TURN_TEMPERATURE = 0.9  # below 1: its own turns read like requests, not noise, and still differ
LOG_FILE = "train-log.jsonl"
DATASTORE_FILE = "datastore/datastore.safetensors"  # in a folder of its own, as STATE_FILE


@dataclass
class DistillConfig:
    target: str
    out: str
    layers: int = 2
    hidden: int | None = None  # None: the target's width (embeddings shared, frozen)
    intermediate: int | None = None  # None: the target's
    prompts: int = 1200
    heldout: int = 48  # prompts kept out of training, for the agreement metric
    max_new_tokens: int = 160
    temperature: float = 0.7  # of the sampled continuation (the greedy one is always made)
    gen_batch: int = 32
    top_k: int = 32  # soft labels kept per position
    steps: int = 3000
    batch_tokens: int = 4096  # label positions per step (approximately)
    lr: float = 1e-3
    warmup: int = 100
    eval_every: int = 250
    save_every: int = 250
    seed: int = 0
    head_tokens: int = 8192  # tokens the draft's head scores, in training and drafting (most written by the target); 0: all
    threads: int | None = None
    mix: str = "v1"  # the training prompts (distill_prompts.MIXES): "v1", the shipped draft's; "spec-bench"
    command: list[str] = field(default_factory=list)  # the command line, recorded in recipe.json

    def check(self) -> None:
        for name in ("layers", "prompts", "max_new_tokens", "gen_batch", "top_k", "steps", "batch_tokens",
                     "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.heldout < self.prompts:
            raise ValueError(f"heldout must be between 1 and prompts - 1, got {self.heldout}")
        if self.head_tokens < 0:
            raise ValueError(f"head_tokens must be >= 0 (0: the full vocabulary), got {self.head_tokens}")
        if self.hidden is not None and self.hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {self.hidden}")
        if not self.lr > 0 or self.temperature <= 0:
            raise ValueError("lr and temperature must be > 0")
        if self.mix not in MIXES:
            raise ValueError(f"mix must be one of {MIXES}, got {self.mix!r}")


# ---------------------------------------------------------------- data: the target writes

def _render(tokenizer, turns: list[str], replies: list[str]) -> str:
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(replies):
            messages.append({"role": "assistant", "content": replies[i]})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@torch.inference_mode()
def target_writes(model, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_k: int,
                  eos_ids, pad_id: int = 0, generator: torch.Generator | None = None):
    """Continue each prompt (greedy if temperature is 0, else sampled); return per prompt
    (completion ids, top-k ids, top-k log-probs of the target's untempered distribution).

    `model`: a specdec model whose engine batches (the native one: its kernel runs all rows'
    one-token passes together, several times faster than transformers' generate here), or a
    transformers model (`generate`; it samples from torch's global generator)."""
    from ..models.base import LanguageModel

    if isinstance(model, LanguageModel):
        return _writes_batched(model, prompts, max_new_tokens, temperature, top_k, set(eos_ids), generator)
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):  # left padding: every row's next token is at the end
        ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p), 1
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else dict(do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=0,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=pad_id,
                         eos_token_id=list(eos_ids) or None, **sampling)
    logp = torch.stack(out.logits, 1).float().log_softmax(-1)
    values, indices = logp.topk(top_k, dim=-1)
    rows = []
    for b in range(len(prompts)):
        completion = out.sequences[b, width:].tolist()
        n = next((i + 1 for i, t in enumerate(completion) if t in eos_ids), len(completion))
        rows.append((completion[:n], indices[b, :n].to(torch.int32), values[b, :n].half()))
    return rows


def _writes_batched(model, prompts, max_new_tokens, temperature, top_k, eos_ids, generator):
    from ..models.base import Rows

    rows = Rows(model, len(prompts))
    rows.reset(max(map(len, prompts)) + max_new_tokens)
    logits = [x[-1] for x in rows.forward(prompts, last_only=True)]
    done = [False] * len(prompts)
    out = [([], [], []) for _ in prompts]  # per row: completion, top-k ids, top-k log-probs
    for _ in range(max_new_tokens):
        live = [b for b in range(len(prompts)) if not done[b]]
        if not live:
            break
        x = torch.stack([logits[b] for b in live]).float()
        values, indices = x.log_softmax(-1).topk(top_k, dim=-1)
        chosen = (x.argmax(-1) if not temperature else
                  torch.multinomial((x / temperature).softmax(-1), 1, generator=generator)[:, 0])
        blocks = [[] for _ in prompts]
        for j, b in enumerate(live):
            token = int(chosen[j])
            out[b][0].append(token)
            out[b][1].append(indices[j])
            out[b][2].append(values[j])
            done[b] = token in eos_ids or len(out[b][0]) == max_new_tokens
            blocks[b] = [] if done[b] else [token]
        if all(done):
            break
        step = rows.forward(blocks)
        logits = [step[b][-1] if blocks[b] else None for b in range(len(prompts))]
    return [(comp, torch.stack(ids).to(torch.int32), torch.stack(logp).half()) for comp, ids, logp in out]


def user_turn_prefix(tokenizer) -> str:
    """The chat template's text before a user turn's content (a system turn, if the template
    adds one, and the user header)."""
    mark = "\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    return text[: text.index(mark)]


def target_prompts(model, tokenizer, n: int, seed: int, eos_ids, pad_id: int = 0, exclude=frozenset(),
                   batch: int = 32, progress=False) -> list[str]:
    """Up to `n` distinct user turns the target writes itself (mix "self"): from its chat
    template up to a user turn's text and an opener (distill_prompts.OPENERS), sampled until
    it ends the turn. A turn it does not end within OWN_TURN_TOKENS, a near-empty one, or
    one in `exclude` (the bench's prompts) is dropped; deterministic for a seed."""
    from tqdm import tqdm

    from .prompts import openers

    prefix = user_turn_prefix(tokenizer)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # transformers' generate samples from the global generator
    out, seen, tries = [], set(exclude), 0
    bar = tqdm(total=n, desc="target writes prompts", unit="prompt", disable=not progress)
    while len(out) < n and tries < 4 * n:  # a target that never ends a turn gives up, not loops
        starts = openers(batch, seed + tries)
        tries += batch
        ids = [tokenizer(prefix + o, add_special_tokens=False)["input_ids"] for o in starts]
        rows = target_writes(model, ids, OWN_TURN_TOKENS, OWN_TURN_TEMPERATURE, 1, eos_ids, pad_id, generator)
        for opener, (comp, _, _) in zip(starts, rows):
            if not comp or comp[-1] not in eos_ids:
                continue
            text = (opener + tokenizer.decode(comp, skip_special_tokens=True)).strip()  # its first token has its space
            if len(text) >= 16 and text not in seen and len(out) < n:
                seen.add(text)
                out.append(text)
                bar.update()
    bar.close()
    return out


def generate_data(cfg: DistillConfig, progress=True) -> Path:
    """Make (or finish making) the on-policy data set in out/data, one shard per batch."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer
    from tqdm import tqdm

    from ..bench.suite import HISTORY_TOKENS, SUITE_DIR, load_suite
    from .prompts import passage_requests, training_conversations
    from ..models.loading import hf_checkpoint, load_model

    data = Path(cfg.out) / "data"
    data.mkdir(parents=True, exist_ok=True)
    path = hf_checkpoint(cfg.target)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    # The target writes on our native engine where it runs (batched kernel passes), else
    # through transformers.
    writer = load_model(path, dtype="bfloat16")
    model = writer if writer.batches else writer.model  # HFAdapter: the transformers model inside
    eos = set(writer.eos_token_ids)
    # No prompt of the bench's own files is trained on (the suite and the held-out Spec-Bench mix).
    bench = {turn for p in load_suite() + load_suite(SUITE_DIR / "heldout-specbench-v1.jsonl") for turn in p.turns}

    def replies_to(first_turns: list[str], max_tokens: int, desc: str) -> list[str]:
        """The target's greedy reply to each one-turn conversation, in batches."""
        out = []
        for s in tqdm(range(0, len(first_turns), cfg.gen_batch), desc=desc, unit="batch", disable=not progress):
            ids = [encode(_render(tokenizer, [t], [])) for t in first_turns[s:s + cfg.gen_batch]]
            out += [tokenizer.decode(comp, skip_special_tokens=True).strip()
                    for comp, _, _ in target_writes(model, ids, max_tokens, 0, 1, eos, pad)]
        return out

    # The target first writes short reports and stories, then is asked to summarize them.
    passages_file = data / "passages.json"
    if not passages_file.exists():
        # spec-bench joins several reports into long articles: it asks for more of them.
        n = cfg.prompts // (3 if cfg.mix != "v1" else 8)
        stories = replies_to(passage_requests(n, cfg.seed), PASSAGE_TOKENS, "target writes passages")
        whole = [t[: t.rfind(".") + 1] for t in stories]  # whole sentences only
        passages_file.write_text(json.dumps([" ".join(t.split()) for t in whole if len(t) >= 250]))
    written = json.loads(passages_file.read_text())
    own = []
    if cfg.mix == "self":  # half the prompts are the target's own user turns
        own_file = data / "own-prompts.json"
        if not own_file.exists():
            own_file.write_text(json.dumps(target_prompts(model, tokenizer, cfg.prompts // 2, cfg.seed, eos, pad,
                                                          bench, cfg.gen_batch, progress)))
        own = [[t] for t in json.loads(own_file.read_text())]
    convs = training_conversations(cfg.prompts - len(own), cfg.seed, exclude=bench | {t[0] for t in own},
                                   written=written, mix=cfg.mix) + own
    if own:  # both halves in the held-out prompts (the first `heldout`) and in every batch of lengths
        random.Random(cfg.seed).shuffle(convs)

    # Earlier turns of a two-turn conversation get the target's own short greedy reply first.
    history_file = data / "history.json"
    if not history_file.exists():
        multi = [i for i, c in enumerate(convs) if len(c) > 1]
        first = replies_to([convs[i][0] for i in multi], HISTORY_TOKENS, "target writes first replies")
        history_file.write_text(json.dumps({i: [r] for i, r in zip(multi, first)}))
    replies = {int(k): v for k, v in json.loads(history_file.read_text()).items()}

    rendered = [_render(tokenizer, c, replies.get(i, [])) for i, c in enumerate(convs)]
    texts = [encode(t) for t in rendered]
    # Similar lengths share a batch (less padding); the held-out prompts are the first `heldout`.
    jobs = [(i, temp) for i in range(len(texts)) for temp in (0.0, cfg.temperature)]
    jobs.sort(key=lambda j: len(rendered[j[0]]))
    batches = [jobs[s:s + cfg.gen_batch] for s in range(0, len(jobs), cfg.gen_batch)]
    torch.manual_seed(cfg.seed)
    bar = tqdm(total=len(batches), desc="target writes", unit="batch", disable=not progress)
    for n, batch in enumerate(batches):
        shard = data / f"shard-{n:04d}.safetensors"
        if shard.exists():
            bar.update()
            continue
        torch.manual_seed(cfg.seed * 100003 + n)  # resumable: each shard's sampling seed is fixed
        generator = torch.Generator().manual_seed(cfg.seed * 100003 + n)
        tensors = {}
        for temp in sorted({t for _, t in batch}):
            idx = [i for i, t in batch if t == temp]
            rows = target_writes(model, [texts[i] for i in idx], cfg.max_new_tokens, temp, cfg.top_k, eos, pad,
                                 generator)
            for i, (comp, top_ids, top_logp) in zip(idx, rows):
                key = f"{i}.{'greedy' if temp == 0 else 'sampled'}"
                tensors[f"{key}.tokens"] = torch.tensor(texts[i] + comp, dtype=torch.int32)
                tensors[f"{key}.prompt_len"] = torch.tensor([len(texts[i])], dtype=torch.int32)
                tensors[f"{key}.top_ids"], tensors[f"{key}.top_logp"] = top_ids.contiguous(), top_logp.contiguous()
        save_file(tensors, str(shard.with_suffix(".tmp")))
        os.replace(shard.with_suffix(".tmp"), shard)
        bar.update()
    bar.close()
    return data


@dataclass
class Example:
    prompt: int  # index of the prompt it came from
    greedy: bool
    tokens: torch.Tensor  # prompt + completion
    prompt_len: int
    top_ids: torch.Tensor  # [n, k]: the target's top-k after prompt + completion[:t]
    top_logp: torch.Tensor


def load_data(data: Path) -> list[Example]:
    from safetensors.torch import load_file

    examples = []
    for shard in sorted(Path(data).glob("shard-*.safetensors")):
        t = load_file(str(shard))
        for key in sorted({k.rsplit(".", 1)[0] for k in t}):
            i, kind = key.split(".")
            if t[f"{key}.top_ids"].shape[0] == 0:
                continue
            examples.append(Example(int(i), kind == "greedy", t[f"{key}.tokens"].long(),
                                    int(t[f"{key}.prompt_len"][0]), t[f"{key}.top_ids"].long(),
                                    t[f"{key}.top_logp"].float()))
    return examples


# ---------------------------------------------------------------- the draft

def draft_config(target_config, cfg: DistillConfig):
    from transformers import LlamaConfig as HFLlamaConfig

    t = target_config
    hidden = cfg.hidden or t.hidden_size
    same_width = hidden == t.hidden_size
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    if hidden > t.hidden_size or hidden % head_dim:
        raise ValueError(f"hidden must be a multiple of the target's head size {head_dim}, at most its width "
                         f"{t.hidden_size}; got {hidden}")
    heads = t.num_attention_heads if same_width else hidden // head_dim
    kv = getattr(t, "num_key_value_heads", heads) if same_width else max(1, heads // 3)
    while heads % kv:
        kv -= 1
    return HFLlamaConfig(
        vocab_size=t.vocab_size, hidden_size=hidden,
        intermediate_size=cfg.intermediate or (t.intermediate_size if same_width else hidden * 8 // 3 // 64 * 64),
        num_hidden_layers=cfg.layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        rms_norm_eps=t.rms_norm_eps, max_position_embeddings=t.max_position_embeddings,
        rope_parameters=dict(getattr(t, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}),
        tie_word_embeddings=bool(getattr(t, "tie_word_embeddings", False)) or not same_width,
        bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id,
        pad_token_id=getattr(t, "pad_token_id", None), hidden_act="silu",
    )


def init_draft(target, cfg: DistillConfig):
    """A Llama draft initialized from the target: its first layers, final norm and embeddings.

    At the target's width the embeddings and output head are the target's, frozen (tied if
    the target's are). At a smaller width the embeddings are the target's projected on their
    top singular directions, tied to the head, and trained.
    """
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    config = draft_config(target.config, cfg)
    draft = LlamaForCausalLM(config).float()
    emb = target.get_input_embeddings().weight.detach().float()
    if config.hidden_size == target.config.hidden_size:
        draft.model.embed_tokens.weight.data.copy_(emb)
        draft.model.embed_tokens.weight.requires_grad_(False)
        if not config.tie_word_embeddings:
            draft.lm_head.weight.data.copy_(target.get_output_embeddings().weight.detach().float())
            draft.lm_head.weight.requires_grad_(False)
        n = min(cfg.layers, target.config.num_hidden_layers)
        for i in range(n):
            draft.model.layers[i].load_state_dict(target.model.layers[i].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
    else:
        _, _, v = torch.linalg.svd(emb, full_matrices=False)
        proj = emb @ v[: config.hidden_size].T
        draft.model.embed_tokens.weight.data.copy_(proj / proj.std() * emb.std())
    draft.tie_weights()
    return draft


def _lr(step: int, cfg: DistillConfig) -> float:
    warmup = min(cfg.warmup, cfg.steps // 10)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def label_hidden(draft, batch: list[Example]):
    """Run the draft on a right-padded batch; hidden states where each label is predicted."""
    width = max(len(e.tokens) for e in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for b, e in enumerate(batch):
        ids[b, : len(e.tokens)], mask[b, : len(e.tokens)] = e.tokens, 1
    hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state
    # The label for completion token t is predicted at position prompt_len - 1 + t.
    rows = torch.cat([torch.full((len(e.top_ids),), b) for b, e in enumerate(batch)])
    cols = torch.cat([torch.arange(len(e.top_ids)) + e.prompt_len - 1 for e in batch])
    return hidden[rows, cols]


class Head:
    """The rows of the output head the draft scores: all of them, or the head-token list
    (what ModelDrafter scores at inference, so training optimizes exactly what is used;
    it also makes a training step much cheaper: the full head dominates its cost)."""

    def __init__(self, vocab_size: int, ids: torch.Tensor | None = None):
        self.ids = ids
        self.column = torch.arange(vocab_size) if ids is None else torch.full((vocab_size,), -1, dtype=torch.long)
        if ids is not None:
            self.column[ids] = torch.arange(len(ids))

    def logits(self, draft, hidden: torch.Tensor) -> torch.Tensor:
        weight = draft.lm_head.weight if self.ids is None else draft.lm_head.weight[self.ids]
        return F.linear(hidden, weight)

    def token(self, column: torch.Tensor) -> torch.Tensor:
        return column if self.ids is None else self.ids[column]


def save_state(path: Path, step: int, trained: dict, optim: dict, rng: torch.Tensor) -> None:
    """The resume state as safetensors, never a pickle: the trained tensors, the optimizer's
    per-parameter tensors and the RNG state as tensors; the step and the optimizer's
    param_groups (plain numbers) as JSON metadata. Written whole, then moved into place."""
    from safetensors.torch import save_file

    tensors = {f"model.{k}": v.contiguous() for k, v in trained.items()}
    for i, per_param in optim["state"].items():
        for key, v in per_param.items():
            tensors[f"optim.{i}.{key}"] = torch.as_tensor(v).contiguous()
    tensors["rng"] = rng
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"step": str(step), "param_groups": json.dumps(optim["param_groups"])})
    os.replace(tmp, path)


def load_state(path: Path) -> tuple[int, dict, dict, torch.Tensor]:
    """(step, trained tensors, optimizer state dict, RNG state) from `save_state`'s file."""
    from safetensors import safe_open

    trained, per_param = {}, {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        for key in f.keys():
            kind, _, rest = key.partition(".")
            if kind == "model":
                trained[rest] = f.get_tensor(key)
            elif kind == "optim":
                i, _, name = rest.partition(".")
                per_param.setdefault(int(i), {})[name] = f.get_tensor(key)
        rng = f.get_tensor("rng")
    return int(meta["step"]), trained, {"state": per_param, "param_groups": json.loads(meta["param_groups"])}, rng


def distill_loss(logits: torch.Tensor, top_cols: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """Forward KL from the target's top-k distribution, renormalized over the tokens the draft
    scores (`top_cols`: their columns in `logits`, -1 for the others), to the draft's."""
    scored = top_cols >= 0
    rows = scored.any(-1)  # a position whose top-k is all unscored teaches nothing
    p = top_logp.masked_fill(~scored, float("-inf"))[rows].softmax(-1)
    logq = logits[rows].float().log_softmax(-1).gather(-1, top_cols[rows].clamp_min(0))
    return (p * (p.clamp_min(1e-30).log() - logq)).sum(-1).mean()


def batches(examples: list[Example], batch_tokens: int, rng: random.Random, pool: int = 16):
    """An endless stream of batches with about `batch_tokens` label positions each.

    Examples of similar length share a batch, because a batch is padded to its longest
    example (prompts run from 20 to 500 tokens, so a random batch is half padding): each
    shuffled pass is cut into pools of about `pool` batches, each pool is sorted by length
    and cut into batches, and a pool's batches come in random order."""
    while True:
        order = examples[:]
        rng.shuffle(order)
        start = 0
        while start < len(order):
            end, labels = start, 0
            while end < len(order) and labels < pool * batch_tokens:
                labels += len(order[end].top_ids)
                end += 1
            group = sorted(order[start:end], key=lambda e: len(e.tokens))
            cut, n = [[]], 0
            for e in group:
                if n >= batch_tokens:
                    cut.append([])
                    n = 0
                cut[-1].append(e)
                n += len(e.top_ids)
            rng.shuffle(cut)
            yield from cut
            start = end


@torch.no_grad()
def agreement(draft, examples: list[Example], head: Head) -> float:
    """Fraction of positions where the draft's argmax (over its head) is the target's argmax."""
    hits = total = 0
    draft.eval()
    for s in range(0, len(examples), 8):
        chunk = examples[s:s + 8]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = head.logits(draft, label_hidden(draft, chunk))
        target = torch.cat([e.top_ids[:, 0] for e in chunk])
        hits += int((head.token(logits.argmax(-1)) == target).sum())
        total += len(target)
    draft.train()
    return hits / max(total, 1)


def train(cfg: DistillConfig, examples: list[Example], target, progress=True, head_ids: torch.Tensor | None = None):
    """Train (or resume training) a draft initialized from `target` (a transformers model),
    scoring only the tokens `head_ids` if given (see `head_token_ids`)."""
    from tqdm import tqdm

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    held = [e for e in examples if e.prompt < cfg.heldout and e.greedy]
    train_set = [e for e in examples if e.prompt >= cfg.heldout]
    if not train_set or not held:
        raise ValueError("no training data: generate_data made no usable examples")
    draft = init_draft(target, cfg)
    head = Head(draft.config.vocab_size, head_ids)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, rng_state = 0, None
    state_file = out / STATE_FILE
    if (out / "train-state.pt").exists() and not state_file.exists():
        raise ValueError(f"{out} holds a resume state in the old pickle form (train-state.pt), which is no "
                         "longer read: delete it to train from the start, or use a new --out")
    if state_file.exists():  # resume
        step, trained, optim, rng_state = load_state(state_file)
        draft.load_state_dict(trained, strict=False)
        opt.load_state_dict(optim)
    rng = random.Random(cfg.seed)
    stream = batches(train_set, cfg.batch_tokens, rng)
    for _ in range(step):  # replay the data order so a resumed run sees what an unbroken one would
        next(stream)
    if rng_state is not None:
        torch.set_rng_state(rng_state)
    log = (out / LOG_FILE).open("a")
    if step == 0:
        a = agreement(draft, held, head)
        log.write(json.dumps({"step": 0, "heldout_greedy_agreement": round(a, 4)}) + "\n")
        log.flush()
    bar = tqdm(total=cfg.steps, initial=step, desc="distill", unit="step", disable=not progress)
    start, losses = time.perf_counter(), []
    draft.train()
    while step < cfg.steps:
        batch = next(stream)
        for g in opt.param_groups:
            g["lr"] = _lr(step, cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = head.logits(draft, label_hidden(draft, batch))
        top_cols = head.column[torch.cat([e.top_ids for e in batch])]
        loss = distill_loss(logits, top_cols, torch.cat([e.top_logp for e in batch]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        losses.append(float(loss.detach()))
        bar.update()
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            a = agreement(draft, held, head)
            row = {"step": step, "loss": round(sum(losses) / len(losses), 4), "lr": _lr(step - 1, cfg),
                   "heldout_greedy_agreement": round(a, 4), "seconds": round(time.perf_counter() - start, 1)}
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.write(f"step {step}: loss {row['loss']}, held-out greedy agreement {a:.3f}")
            losses = []
        if step % cfg.save_every == 0 or step == cfg.steps:
            trainable = {k: p.detach() for k, p in draft.named_parameters() if p.requires_grad}
            save_state(state_file, step, trainable, opt.state_dict(), torch.get_rng_state())
    bar.close()
    log.close()
    return draft


DRAFT_GGUF = "draft.bf16.gguf"


def save_draft(draft, target_path: Path, out: Path) -> None:
    """A standard checkpoint: config.json, model.safetensors (bf16), tokenizer, generation config."""
    import shutil

    from ..models.registry import TOKENIZER_FILES

    draft = draft.to(torch.bfloat16)
    draft.config.dtype = "bfloat16"
    draft.save_pretrained(str(out), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (target_path / name).exists():
            shutil.copy(target_path / name, out / name)


def _written(e: Example) -> torch.Tensor:
    return e.tokens[e.prompt_len:]


def head_token_ids(cfg: DistillConfig, examples: list[Example], vocab_size: int, eos_ids) -> torch.Tensor | None:
    """The cfg.head_tokens tokens the target wrote most often in the training completions,
    plus its end tokens, sorted; None for the full vocabulary (head_tokens 0 or >= it).
    A draft whose head scores only these costs much less per token (see ModelDrafter)."""
    if not cfg.head_tokens or cfg.head_tokens >= vocab_size:
        return None
    counts = torch.bincount(torch.cat([_written(e) for e in examples if e.prompt >= cfg.heldout]),
                            minlength=vocab_size)
    keep = torch.zeros(vocab_size, dtype=torch.bool)
    keep[counts.argsort(descending=True, stable=True)[: cfg.head_tokens]] = True
    keep[list(eos_ids)] = True
    return keep.nonzero()[:, 0]


def write_head_tokens(ids: torch.Tensor | None, examples: list[Example], heldout: int, out: Path) -> None:
    """head_tokens.json: the list, and how much of the held-out completions it covers (none: no file)."""
    from ..models.registry import HEAD_TOKENS_FILE

    path = Path(out) / HEAD_TOKENS_FILE
    if ids is None:
        path.unlink(missing_ok=True)
        return
    held = torch.cat([_written(e) for e in examples if e.prompt < heldout])
    coverage = float(torch.isin(held, ids).float().mean())
    path.write_text(json.dumps({"heldout_coverage": round(coverage, 4), "token_ids": ids.tolist()}) + "\n")


def export_shipped(run: Path, dest: Path, target: str) -> Path:
    """The form that ships in git: the draft without the matrices it shares with its target
    (embeddings, and the output head if untied): config.json, layers.safetensors and
    shared.json (each shared tensor's sha256), plus the recipe and the training log.
    `materialize_draft` puts it back together."""
    import shutil

    from safetensors.torch import load_file, save_file

    from ..models.loading import hf_checkpoint, read_tensor, tensor_digest
    from ..models.registry import HEAD_TOKENS_FILE, SHARED_TENSORS

    run, dest = Path(run), Path(dest)
    state = load_file(str(run / "model.safetensors"))
    shared = {}
    for name in SHARED_TENSORS:
        if name not in state:
            continue
        mine, theirs = state.pop(name), read_tensor(hf_checkpoint(target), name)
        if not torch.equal(mine, theirs.to(mine.dtype)):
            raise ValueError(f"{run} does not share {target}'s {name} (trained at another width?): ship it whole")
        shared[name] = tensor_digest(theirs)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dest / "layers.safetensors"), metadata={"format": "pt"})
    shutil.copy(run / "config.json", dest / "config.json")
    (dest / "shared.json").write_text(json.dumps({"target": target, "sha256": shared}, indent=1) + "\n")
    for name in (LOG_FILE, "recipe.json", "train-log.png", HEAD_TOKENS_FILE):
        if (run / name).exists():
            shutil.copy(run / name, dest / name)
    return dest


def plot_log(out: Path) -> Path:
    """train-log.png: training loss and held-out greedy agreement against the step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [json.loads(line) for line in (Path(out) / LOG_FILE).read_text().splitlines()]
    fig = Figure(figsize=(7, 3.2))
    FigureCanvasAgg(fig)
    ax_loss, ax_agree = fig.subplots(1, 2)
    trained = [r for r in rows if "loss" in r]
    ax_loss.plot([r["step"] for r in trained], [r["loss"] for r in trained], marker="o")
    ax_loss.set(xlabel="step", ylabel="KL to the target (nats)", title="training loss")
    ax_agree.plot([r["step"] for r in rows], [r["heldout_greedy_agreement"] for r in rows], marker="o")
    ax_agree.set(xlabel="step", ylabel="argmax agreement", title="held-out greedy agreement", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(Path(out) / "train-log.png", dpi=110)
    return Path(out) / "train-log.png"


def distill(cfg: DistillConfig, progress=True) -> Path:
    from transformers import AutoModelForCausalLM

    from ..models.base import eos_ids_of
    from ..models.loading import hf_checkpoint

    cfg.check()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    recipe = out / "recipe.json"
    if recipe.exists():
        free = ("command", "threads", "out")  # these do not change what is trained
        old = {k: v for k, v in json.loads(recipe.read_text()).items() if k not in free}
        new = {k: v for k, v in asdict(cfg).items() if k not in free}
        if old != new:
            changed = sorted(k for k in new if old.get(k) != new[k])
            raise ValueError(f"{out} holds a run with other settings ({', '.join(changed)}); use a new --out")
    recipe.write_text(json.dumps(asdict(cfg), indent=1) + "\n")
    target_path = hf_checkpoint(cfg.target)
    data = generate_data(cfg, progress)
    target = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=torch.float32, use_safetensors=True,
                                                  trust_remote_code=False)
    examples = load_data(data)
    eos_ids = eos_ids_of(target.generation_config) + eos_ids_of(target.config)
    head_ids = head_token_ids(cfg, examples, target.config.vocab_size, eos_ids)
    draft = train(cfg, examples, target, progress, head_ids)
    del target
    save_draft(draft, target_path, out)
    write_head_tokens(head_ids, examples, cfg.heldout, out)
    write_draft_gguf(out, cfg.target)
    write_datastore([data], out / DATASTORE_FILE, draft.config.vocab_size, " ".join(cfg.command))
    plot_log(out)
    return out


def write_datastore(data_dirs, out: Path, vocab_size: int, recipe: str = "") -> Path:
    """The target's replies in the runs' data (each written reply once) as a datastore for
    retrieval drafting (specdec.datastore): what it writes again and again, whatever the prompt."""
    from ..datastore import Datastore

    replies = {}
    for data in data_dirs:
        for e in load_data(Path(data)):
            reply = _written(e).numpy()
            replies.setdefault(reply.tobytes(), reply)
    if not replies:
        raise ValueError(f"no training data in {', '.join(map(str, data_dirs))}")
    return Datastore(list(replies.values()), vocab_size, name=Path(out).name).save(out, recipe)


def write_draft_gguf(out: Path, target: str) -> Path:
    """The draft as GGUF too (bf16, full output head: GGUF has no head-token list), for the
    llama.cpp engine and for `llama-server -md`. Where the target is a GGUF file (embedded or
    given), its tokenizer metadata is copied, so llama.cpp sees the two vocabularies as one."""
    from ..models.gguf_write import write_gguf
    from ..models.registry import EMBEDDED_GGUF, embedded_gguf_path

    source = embedded_gguf_path(target) if target in EMBEDDED_GGUF else Path(target)
    return write_gguf(out, out / DRAFT_GGUF, metadata_from=source if source.suffix == ".gguf" else None)
