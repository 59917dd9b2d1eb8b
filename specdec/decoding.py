"""The two decoding loops: `generate` (plain, KV-cached) and `speculative_generate`.

Invariant shared by both loops: after every step the target's cache holds the K/V of
exactly the accepted sequence except its last token, which is "pending" -- it is the
first input of the next forward pass. Positions are absolute token indices, so the
cache length is always the position of the pending token.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .bridge import bridged, vocab_fingerprint
from .drafters import Drafter, as_drafter
from .models.base import LanguageModel, Rows, as_language_model
from .schedule import AdaptiveK, FixedCosts
from .sampling import MIN_TEMPERATURE, Noise, SamplingParams, choose, tree_accept, verify


@dataclass
class Stats:
    """What a generation cost, and how well the drafter did.

    target_calls: target forward passes, the prefill included.
    draft_calls: draft-model forward passes (0 for a model-free drafter such as n-gram).
    drafted: tokens proposed by the drafter, summed over steps.
    accepted: proposed tokens the target accepted (bonus and correction tokens excluded).
    rejections: steps in which a proposed token was rejected (accepted / (accepted +
        rejections) estimates the per-token acceptance probability alpha of Leviathan et al.).
    plain_steps: verification passes with nothing drafted, so plain decoding steps: the
        drafter had no proposal (no n-gram match, or a draft model past its own context),
        or `num_draft_tokens="auto"` chose k = 0.
    accepted_per_position[i]: among steps that proposed at least i+1 tokens, the fraction
        in which drafts 1..i+1 were all accepted. (With a fixed proposal length it can only
        fall with i; a drafter that proposes fewer tokens on some steps can break that.)
    generated: new tokens returned.
    timings: seconds spent in the target prefill, in the drafter, and in target
        verification / decode passes ("prefill", "draft", "verify").
    drafter: the drafter's own counts; a draft with another tokenizer (specdec.bridge)
        reports "bridge_steps" (steps it proposed in) and "boundary_misses" (those whose
        first rejected token read like the target's own text, cut at another place).
    """

    target_calls: int = 0
    draft_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0
    plain_steps: int = 0
    generated: int = 0
    proposed_at: list[int] = field(default_factory=list)  # steps that proposed >= i+1 tokens
    accepted_at: list[int] = field(default_factory=list)  # steps that accepted >= i+1 tokens
    timings: dict = field(default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "verify": 0.0})
    drafter: dict = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (nan when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def accepted_per_position(self) -> list[float]:
        accepted = self.accepted_at + [0] * (len(self.proposed_at) - len(self.accepted_at))
        return [a / p for a, p in zip(accepted, self.proposed_at)]

    @property
    def tokens_per_target_call(self) -> float:
        """New tokens per target forward pass, prefill included: exactly 1.0 for plain decoding
        that runs to its limit; k+1 at most per verification pass (accepted drafts + 1)."""
        return self.generated / self.target_calls if self.target_calls else math.nan

    def record_step(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += accepted < drafted
        self.plain_steps += drafted == 0
        for store, n in ((self.proposed_at, drafted), (self.accepted_at, accepted)):
            store.extend([0] * (n - len(store)))
            for i in range(n):
                store[i] += 1


@dataclass
class Generation:
    """token_ids: new tokens only, ending with the EOS token when finish_reason == "eos".
    text: their decoding with special tokens skipped (None without a tokenizer).
    finish_reason: "eos" or "length"."""

    token_ids: list[int]
    text: str | None
    finish_reason: str
    stats: Stats
    prompt_ids: list[int]


class _Timer:
    """Adds wall time to stats.timings[key]; synchronizes CUDA so async kernels are counted."""

    def __init__(self, stats: "Stats | list[Stats]", device: torch.device):
        self.stats = stats if isinstance(stats, list) else [stats]  # a batch's pass counts for each row
        self.cuda = device.type == "cuda"
        self.elapsed: dict[str, float] = {}  # seconds under each key through this timer

    def __call__(self, key: str):
        self.key = key
        return self

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self.t0
        self.elapsed[self.key] = self.elapsed.get(self.key, 0.0) + elapsed
        for stats in self.stats:
            stats.timings[self.key] += elapsed


# ----------------------------------------------------------------------------- input checks


def check_sampling(temperature, top_k, top_p) -> SamplingParams:
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not math.isfinite(temperature):
        raise TypeError(f"temperature must be a finite number, got {temperature!r}")
    if temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    return SamplingParams(float(temperature), top_k, None if top_p is None else float(top_p))


def check_max_tokens(max_tokens) -> int:
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise TypeError(f"max_tokens must be an integer, got {type(max_tokens).__name__}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    return max_tokens


def encode_prompt(prompt, tokenizer, model: LanguageModel, chat: bool) -> list[int]:
    """Token ids of the prompt: a string (optionally wrapped in the chat template) or ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        if tokenizer is None:
            raise ValueError("a string prompt needs a tokenizer (or pass token ids)")
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("chat=True but the tokenizer has no chat template")
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                 tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, (Sequence, torch.Tensor)):
        if chat:
            raise ValueError("chat=True needs a string prompt, not token ids")
        ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise TypeError("prompt token ids must be integers")
    else:
        raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    bad = [t for t in ids if not 0 <= t < model.vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {model.vocab_size})")
    return ids


def check_context(limit: int | None, who: str, n_prompt: int, max_tokens: int) -> None:
    # Drafts are capped so that no pass of either model runs past prompt + max_tokens positions.
    if limit is not None and n_prompt + max_tokens > limit:
        raise ValueError(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds "
                         f"{who}'s context of {limit} tokens")


def check_same_vocab(target: LanguageModel, drafter: Drafter, tokenizer) -> None:
    t_tok = target.tokenizer or tokenizer
    d_tok = drafter.tokenizer
    if t_tok is not None and d_tok is not None and t_tok is not d_tok:
        if vocab_fingerprint(t_tok) != vocab_fingerprint(d_tok):
            raise ValueError("the draft's tokenizer differs from the target's: speculative decoding "
                             "needs a shared vocabulary")
    if drafter.vocab_size is not None and drafter.vocab_size != target.vocab_size:
        raise ValueError(f"the draft's vocabulary ({drafter.vocab_size}) differs from the "
                         f"target's ({target.vocab_size})")


def check_seed(seed) -> None:
    if seed is None:
        return
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an integer, got {type(seed).__name__}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")


def _finish(tokens: list[int], new: list[int], eos: tuple[int, ...], max_tokens: int) -> str | None:
    """Append `new` to `tokens`, cutting at the first EOS or at max_tokens; the reason, if it ended."""
    for t in new:
        tokens.append(t)
        if t in eos:
            return "eos"
        if len(tokens) >= max_tokens:
            return "length"
    return None


def _decode(tokenizer, ids) -> str | None:
    return None if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)


def _check_request(model, tokenizer, prompt, max_tokens, temperature, top_k, top_p, seed, chat):
    """Every check shared by both loops, before any compute; the sampling params and prompt ids."""
    params = check_sampling(temperature, top_k, top_p)
    check_max_tokens(max_tokens)
    check_seed(seed)
    prompt_ids = encode_prompt(prompt, tokenizer, model, chat)
    check_context(model.max_context, model.name, len(prompt_ids), max_tokens)
    return params, prompt_ids


def as_batch(prompt) -> tuple[list, bool]:
    """(prompts, is_batch): a list of strings or of token-id lists is a batch; one string or one
    flat id list (or a 1-D tensor) is a single prompt."""
    if isinstance(prompt, (list, tuple)) and prompt and all(
            isinstance(p, str) or (isinstance(p, (Sequence, torch.Tensor)) and not isinstance(p, (int, bool)))
            for p in prompt):
        return list(prompt), True
    if isinstance(prompt, (list, tuple)) and not prompt:
        raise ValueError("prompt is empty")
    return [prompt], False


def row_seeds(seed, batch: int) -> list:
    """Per-row seeds: a list gives each row its own; an int s gives row i the seed s + i (so a
    batch's row i samples as a single run with seed s + i would); None leaves each row unseeded."""
    if isinstance(seed, (list, tuple)):
        if len(seed) != batch:
            raise ValueError(f"{len(seed)} seeds for {batch} prompts")
        for s in seed:
            check_seed(s)
        return list(seed)
    check_seed(seed)
    if seed is not None and seed + batch - 1 >= 2**63:
        raise ValueError(f"seed must leave room for {batch} rows below 2**63, got {seed}")
    return [None if seed is None else seed + i for i in range(batch)]


# ----------------------------------------------------------------------------- the loops


class _Run:
    """One call's rows, checked before any compute: their prompt ids, outputs, stop reasons,
    noise (sampling.Noise) and stats, and the target's cache as that many sequences."""

    def __init__(self, model: LanguageModel, tokenizer, prompt, max_tokens, temperature, top_k, top_p, seed, chat,
                 stream):
        prompts, self.batched = as_batch(prompt)
        seeds = row_seeds(seed, len(prompts))
        self.rows = Rows(model, len(prompts))
        requests = [_check_request(model, tokenizer, p, max_tokens, temperature, top_k, top_p, s, chat)
                    for p, s in zip(prompts, seeds)]
        self.params = requests[0][0]
        self.prompt_ids = [ids for _, ids in requests]
        self.size = len(prompts)
        self.stats = [Stats() for _ in prompts]
        self.outs: list[list[int]] = [[] for _ in prompts]
        self.reasons: list[str | None] = [None if max_tokens else "length" for _ in prompts]
        self.noises = [Noise(s, model.device) for s in seeds]
        self.model, self.tokenizer, self.max_tokens, self.stream = model, tokenizer, max_tokens, stream
        self.watcher = None  # a drafter that reads side outputs of the target's passes (its side_rows)

    def live(self) -> list[int]:
        return [b for b, r in enumerate(self.reasons) if r is None]

    def timer(self, rows) -> _Timer:
        return _Timer([self.stats[b] for b in rows], self.model.device)

    def prefill(self, spare: int = 0) -> list[int]:
        """Empty the cache (with `spare` slots past the last position, where a tree's other
        branches sit until the kept path moves into place) and run every prompt; each row's
        first new token."""
        self.capacity = max(len(ids) for ids in self.prompt_ids) + self.max_tokens
        self.rows.reset(self.capacity + spare)
        with self.timer(range(self.size))("prefill"):
            logits = self.forward(self.prompt_ids, last_only=True)
            return [choose(x[-1], self.params, noise, len(ids))
                    for x, noise, ids in zip(logits, self.noises, self.prompt_ids)]

    def forward(self, blocks: list[list[int]], last_only: bool = False) -> list[torch.Tensor]:
        """The target's pass over each row's block; the logits. With a watcher, the pass also
        scores its side rows, whose outputs go to it by row and position, not to the loop."""
        if self.watcher is None:
            return self.rows.forward(blocks, last_only=last_only)
        out = self.rows.forward(blocks, last_only=last_only, side=self.watcher.side_rows)
        V, ends = self.model.vocab_size, self.rows.lengths
        for b, x in enumerate(out):
            if x.shape[0]:  # rows of the last positions of the block: it ends at the cache's length
                self.watcher.observe(b, ends[b] - x.shape[0], x[:, :V], x[:, V:])
        return [x[:, :V] for x in out]

    def add(self, b: int, new: list[int]) -> list[int]:
        """Row b's step yielded `new`: keep it up to an EOS or max_tokens; the ids kept."""
        self.stats[b].target_calls += 1
        before = len(self.outs[b])
        self.reasons[b] = _finish(self.outs[b], new, self.model.eos_token_ids, self.max_tokens)
        return self.outs[b][before:]

    def emit(self, b: int, ids: list[int]) -> None:
        if self.stream:
            self.stream(*((b, ids) if self.batched else (ids,)))

    def results(self, drafter: Drafter | None = None) -> Generation | list[Generation]:
        gens = []
        for b in range(self.size):
            if drafter is not None:
                self.stats[b].draft_calls, self.stats[b].drafter = drafter.calls, drafter.counters(b)
            self.stats[b].generated = len(self.outs[b])
            gens.append(Generation(self.outs[b], _decode(self.tokenizer, self.outs[b]), self.reasons[b],
                                   self.stats[b], self.prompt_ids[b]))
        return gens if self.batched else gens[0]


def generate(model, tokenizer, prompt, max_tokens: int, *, temperature=0.0, top_k=None, top_p=None,
             seed=None, chat=False, stream: Callable | None = None) -> Generation | list[Generation]:
    """Plain decoding: one prefill pass picks the first token from the last prompt position;
    each later token is one pass over only the newest token, reusing the cache.

    prompt: a string or token ids, or a list of them: a batch, decoded together on engines
    that batch (one pass a step for all rows; a row that has finished costs nothing more),
    returning one Generation per row, each exactly the row's own single run. seed: an int
    (row i uses seed + i) or one seed per row. stream gets the new ids, or (row, new ids)."""
    model = as_language_model(model, tokenizer)
    run = _Run(model, tokenizer, prompt, max_tokens, temperature, top_k, top_p, seed, chat, stream)
    live = run.live()
    if live:
        tokens = run.prefill()
    while live:
        for b in live:
            run.emit(b, run.add(b, [tokens[b]]))
        live = run.live()
        if not live:
            break
        with run.timer(live)("verify"):
            logits = run.rows.forward([[tokens[b]] if b in live else [] for b in range(run.size)])
            for b in live:
                position = len(run.prompt_ids[b]) + len(run.outs[b])
                tokens[b] = choose(logits[b][-1], run.params, run.noises[b], position)
    return run.results()


def auto_k_max(model, rows: int = 1) -> int:
    """The most drafts a step `auto` takes on `model`. One row's blocks stay within the engine's
    tile of rows, if it has one: a block of one more costs a second round of products, which the
    schedule's line of verify costs does not see (on the AMX VM, capped at 15 the default made
    1.74x and 1.76x plain decoding in two runs, against 1.70x and 1.72x at 16:
    scripts/probes/schedule_kmax.py)."""
    tile = getattr(model, "pass_tile", None)
    return min(AdaptiveK.K_MAX, tile - 1) if tile and rows == 1 else AdaptiveK.K_MAX


def speculative_generate(model, draft, tokenizer, prompt, max_tokens: int, *, num_draft_tokens="auto",
                         temperature=0.0, top_k=None, top_p=None, seed=None, chat=False,
                         stream: Callable | None = None) -> Generation | list[Generation]:
    """Speculative decoding: the drafter proposes k tokens, the target scores
    [pending, d1..dk] in one pass, and the acceptance rule keeps a prefix plus one
    target token. Every token is the target's choice at its position (sampling.verify), so
    greedy output equals `generate`'s and seeded sampled output `generate`'s with that seed, on
    engines whose block rows are one-token passes (the bf16 kernel); elsewhere up to rounding
    ties, and identical calls give identical output (docs/design.md, "Guarantees").

    num_draft_tokens: "auto" (the default) chooses k (0 included) each step from the measured
    acceptance and costs (see `specdec.schedule.AdaptiveK`); an `AdaptiveK` does the same
    starting from what it learned in earlier calls (and goes on learning); an integer k
    drafts k tokens a step.

    prompt: one prompt, or a list of them (a batch; the engines and a model draft must batch),
    as in `generate`: one Generation per row, each exactly the row's own single run. Each row
    accepts its own number of drafts a step (ragged acceptance); one verify pass a step scores
    every live row's block; a finished row drops out of the passes. With "auto" the schedule
    chooses one k a step for the whole batch, for the most tokens per second over all rows.

    A draft model's own context limits only the draft: past it, a step drafts nothing (a
    plain decoding step, counted in `stats.plain_steps`) and the output is unchanged."""
    model = as_language_model(model, tokenizer)
    run = _Run(model, tokenizer, prompt, max_tokens, temperature, top_k, top_p, seed, chat, stream)
    drafter = bridged(as_drafter(draft, tokenizer), model, tokenizer)  # another tokenizer: through text
    k = num_draft_tokens
    schedule = None
    if isinstance(k, AdaptiveK):
        schedule = k
    elif k == "auto":
        schedule = AdaptiveK(k_max=auto_k_max(model, run.size))
    elif not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"num_draft_tokens must be an integer >= 1, 'auto' or an AdaptiveK, got {k!r}")
    # Where the target's rows round differently with a block's size, clocks must not choose the
    # blocks (schedule.py): the same inputs then give the same output.
    fixed = None if model.row_invariant else FixedCosts(*model.block_cost)
    check_same_vocab(model, drafter, tokenizer)
    drafter.check_prompts(run.prompt_ids)
    if drafter.side_rows is not None:  # it reads the target's own passes (a hidden-state head)
        if not model.side_outputs:
            raise ValueError(f"the drafter ({drafter!r}) reads side outputs of the target's passes, which "
                             f"{type(model).__name__} does not give (the native engine does)")
        run.watcher = drafter
    if run.size > 1 and not drafter.batches:
        raise ValueError(f"the draft ({drafter!r}) runs one prompt at a time; batches need a draft on an engine "
                         "that batches (the native engine)")
    params, noises, rows, prompt_ids, outs = run.params, run.noises, run.rows, run.prompt_ids, run.outs
    # A drafter that grows trees, on an engine that verifies them, for one prompt: each step
    # verifies the chosen source's chain and the other continuations hung on it in one pass.
    trees = drafter.tree_size > 0 and model.trees and run.size == 1
    live = run.live()
    if live:
        tokens = run.prefill(spare=drafter.tree_size if trees else 0)
        drafter.begin(run.capacity, run.size)
        with run.timer(range(run.size))("draft"):
            drafter.prefill(prompt_ids)
        for b in live:
            run.emit(b, run.add(b, [tokens[b]]))
        live = run.live()
    while live:
        ids = {b: prompt_ids[b] + outs[b] for b in live}
        # No source (no lookup match, a draft model past its context): a plain step. A fixed
        # k takes the drafter's preferred source.
        sources = [drafter.sources(ids[b], b) for b in live]
        plan = (schedule.choose_batch(sources) if schedule else
                [(s[0], k) if s else (None, 0) for s in sources])
        # Drafts past max_tokens - 1 could never be kept: the step always adds one target token.
        asks = {b: (ids[b], min(n, max_tokens - len(outs[b]) - 1), src) for b, (src, n) in zip(live, plan)}
        asks = {b: ask for b, ask in asks.items() if ask[1] > 0}
        step = run.timer(live)
        proposals, setup = {}, drafter.setup_seconds
        if asks:
            with step("draft"):
                if trees:  # (tokens, parents, how many lead as the source's chain)
                    size = {b: schedule.tree_size(n, src, drafter.tree_size) if schedule else drafter.tree_size
                            for b, (_, n, src) in asks.items()}
                    proposals = {b: drafter.propose_tree(*ask, row=b, size=size[b],
                                                         depth=max_tokens - len(outs[b]) - 1)
                                 for b, ask in asks.items()}
                else:
                    proposals = drafter.propose_rows(asks, params, noises)
        setup = drafter.setup_seconds - setup  # a draft reading a prompt: not a cost of drafting
        drafted = {b: proposals.get(b, ([], None))[0] for b in live}
        chain = {b: len(drafted[b]) for b in live}  # the source's own drafts, which the schedule learns from
        parents = None  # a tree's, where it branches (a tree that does not is a chain, verified as one)
        if trees and asks:
            _, parents, chain[0] = proposals.pop(0)  # (its q is one-hot: no q)
            parents = parents if len(drafted[0]) > chain[0] else None
        with step("verify"):
            verdicts = {}  # per row: the accepted drafts (their indices), the target's token, the chain's share
            if parents is not None:
                nodes = drafted[0]
                logits = model.forward_tree([ids[0][-1]] + nodes, [-1] + [p + 1 for p in parents])
                path, token = tree_accept(nodes, parents, logits, params, noises[0], len(ids[0]))
                n_acc = next((i for i, node in enumerate(path) if node != i or i == chain[0]), len(path))
                if n_acc < len(path):  # it left the chain: lay the path out in order, as a chain
                    model.keep_path(len(ids[0]) - 1, [0] + [i + 1 for i in path])
                verdicts[0] = path, token, n_acc
            else:
                logits = run.forward([[ids[b][-1]] + drafted[b] if b in ids else [] for b in range(run.size)])
                for b in live:
                    n_acc, token = verify(drafted[b], logits[b], params, noises[b], len(ids[b]))
                    verdicts[b] = list(range(n_acc)), token, n_acc
        outcomes, new = [], {}
        for b, (src, _) in zip(live, plan):
            path, token, n_acc = verdicts[b]
            new[b] = run.add(b, [drafted[b][i] for i in path] + [token])
            # An EOS among the accepted drafts ends the block: the drafts after it were neither
            # accepted nor rejected, just discarded, so they are not counted at all.
            kept = min(len(path), len(new[b]))
            run.stats[b].record_step(kept if kept < len(path) else len(drafted[b]), kept)
            outcomes.append((src, chain[b], n_acc))
        if schedule:
            size = 1 + len(drafted[0]) if parents is not None else None
            costs = (fixed.step(outcomes, size) if fixed else
                     (step.elapsed.get("draft", 0.0) - setup, step.elapsed["verify"]))
            schedule.update_batch(outcomes, *costs, rows=size)
            if parents is not None:
                schedule.update_tree(len(drafted[0]) - chain[0], len(verdicts[0][0]) - verdicts[0][2])
        # Roll back rejected drafts (and anything after an EOS): each row's cache keeps its
        # accepted sequence minus its pending last token.
        lengths = rows.lengths
        for b in live:
            lengths[b] = len(prompt_ids[b]) + len(outs[b]) - 1
            drafter.commit(prompt_ids[b] + outs[b], b)
        rows.rollback(lengths)
        for b in live:  # after the rollback: a stream sees the caches the step left
            run.emit(b, new[b])
        live = run.live()
    return run.results(drafter)
