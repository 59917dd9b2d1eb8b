"""Batched requests: how batching changes speculation's latency-versus-throughput benefit.

`specdec bench --batch-sizes 1,2,4,8,16` runs this study instead of the single-prompt trials.
The same prompts (a fixed shuffle of the suite, so that batches mix categories; cut to a
multiple of the largest B) are split into batches of B for each B, and every method decodes
every batch: plain `generate` and each speculative method, all through the batched API.
Methods interleave per batch in balanced orders, as in the single-prompt trials.

Per (method, B):
- throughput: new tokens of all rows / wall time of the batch call; its ratio to plain
  decoding is paired per batch and averaged geometrically, with a bootstrap CI over batches;
- per-request latency: each row's time from the call's start to its last token, per token
  (rows finish at different steps), median and p90 over rows;
- acceptance, and the mean drafts per row per step (what `auto` picked);
and per (B, k) the verify pass cost: B rows of k + 1 tokens each vs one row of one token.

Why the gain shrinks: one decode pass over a few rows is memory-bound (the weights are read
once for all rows), so verifying k drafts costs little more than one token. As B * (k + 1)
grows the pass becomes compute-bound, its cost grows with its rows, and accepted drafts no
longer come nearly for free. The crossover is the batch size from which no speculative
method beats plain batched decoding on this machine.
"""
from __future__ import annotations

import random
import statistics
import time

import numpy as np

from ..decoding import generate, speculative_generate
from ..drafters import CompositeDrafter, ModelDrafter, NgramDrafter
from ..models.base import Rows
from .methods import _stats_dict, _sync
from .stats import interleaved_order, summarize_ratios

VERIFY_KS = (0, 1, 2, 4, 8)


class BatchMethod:
    """plain (drafter None) or speculative decoding of a batch, timed per row through `stream`."""

    def __init__(self, name, target, sampling, make_drafter=None, k=None, drafter=None):
        self.name, self.target, self.sampling = name, target, sampling
        self.make_drafter, self.k, self.drafter = make_drafter, k, drafter

    def run(self, batch: list[list[int]], max_tokens: int) -> dict:
        finished = [0.0] * len(batch)
        _sync(self.target.device)
        t0 = time.perf_counter()

        def stream(row, ids):
            finished[row] = time.perf_counter() - t0

        if self.make_drafter is None:
            gens = generate(self.target, None, batch, max_tokens, stream=stream, **self.sampling)
        else:
            gens = speculative_generate(self.target, self.make_drafter(), None, batch, max_tokens,
                                        num_draft_tokens=self.k, stream=stream, **self.sampling)
        _sync(self.target.device)
        return {"seconds": time.perf_counter() - t0, "row_seconds": finished,
                "tokens": [g.token_ids for g in gens], "stats": [_stats_dict(g.stats) for g in gens]}


def batch_methods(target, draft_model, ks, sampling, store=None) -> list[BatchMethod]:
    drafters = {"ngram": NgramDrafter}
    if store is not None:
        drafters["store"] = lambda: CompositeDrafter(datastore=store)
    if draft_model is not None:
        drafters.update(draft=lambda: ModelDrafter(draft_model),
                        composite=lambda: CompositeDrafter(draft_model, datastore=store))
    return [BatchMethod("normal", target, sampling)] + [
        BatchMethod(f"spec-{name}-k{k}", target, sampling, make, k, name) for name, make in drafters.items() for k in ks]


def batch_forward_ms(model, batch: int, sizes, context: int = 256, rounds: int = 3, reps: int = 3) -> dict:
    """Median time of one pass of `batch` rows, n tokens each, after `context` cached tokens
    per row, for each n in `sizes`; in rounds over the sizes, as `runner.forward_ms`."""
    rows = Rows(model, batch)
    rows.reset(context + max(sizes))
    rows.forward([list(range(1, context + 1))] * batch, last_only=True)
    times = {n: [] for n in sizes}
    for r in range(rounds + 1):
        for n in sizes:
            for _ in range(reps):
                _sync(model.device)
                t0 = time.perf_counter()
                rows.forward([list(range(1, n + 1))] * batch)
                _sync(model.device)
                if r:  # the first round warms up
                    times[n].append(time.perf_counter() - t0)
                rows.rollback([context] * batch)
    return {n: statistics.median(t) * 1000 for n, t in times.items()}


def verify_costs(target, batch_sizes, ks=VERIFY_KS) -> dict:
    """ms of a pass of B rows x (k + 1) tokens, and its ratio to one row's one-token pass."""
    ms = {b: batch_forward_ms(target, b, [k + 1 for k in ks]) for b in batch_sizes}
    one = batch_forward_ms(target, 1, [1])[1]
    return {"one_token_ms": one,
            "ms": {str(b): {str(k): ms[b][k + 1] for k in ks} for b in batch_sizes},
            "ratio": {str(b): {str(k): ms[b][k + 1] / one for k in ks} for b in batch_sizes}}


def batches_of(prompts, batch_sizes) -> tuple[list, dict[int, list[list]]]:
    """The study's prompts (a fixed shuffle, cut to a multiple of the largest B) and, per B,
    their split into consecutive batches of B."""
    top = max(batch_sizes)
    if len(prompts) < top:
        raise ValueError(f"--batch-sizes up to {top} needs at least {top} prompts; the selection has {len(prompts)}")
    order = list(prompts)
    random.Random(0).shuffle(order)
    order = order[: len(order) // top * top]
    return order, {b: [order[i: i + b] for i in range(0, len(order), b)] for b in batch_sizes}


def run_batch_study(cfg, prompts, target, draft_model, progress=True, log=print, store=None) -> dict:
    from tqdm.auto import tqdm

    sampling = dict(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=0)
    methods = batch_methods(target, draft_model, cfg.ks, sampling, store)
    chosen, split = batches_of(prompts, cfg.batch_sizes)
    log(f"batched study: {len(chosen)} prompts in batches of {cfg.batch_sizes}, {len(methods)} methods ...")
    log("measuring verify pass costs per (B, k) ...")
    costs = verify_costs(target, cfg.batch_sizes)
    for m in methods:  # warm up (the kernel build, the first passes): outside the trials
        m.run([p.ids for p in split[cfg.batch_sizes[0]][0]], min(cfg.max_tokens, 8))
    records = []
    total = cfg.trials * sum(len(groups) for groups in split.values()) * len(methods)
    bar = tqdm(total=total, desc="bench (batched)", unit="batch", disable=not progress)
    for trial in range(cfg.trials):
        for b in cfg.batch_sizes:
            for gi, group in enumerate(split[b]):
                for m in interleaved_order(methods, trial * len(split[b]) + gi):
                    r = m.run([p.ids for p in group], cfg.max_tokens)
                    records.append({"method": m.name, "batch": b, "group": gi, "trial": trial,
                                    "prompts": [p.id for p in group]} | r)
                    bar.update()
    bar.close()
    return aggregate_batches(cfg, methods, records, costs, greedy=cfg.temperature == 0) | {
        "prompts": [p.id for p in chosen]}


def _group_runs(records, method, b):
    """group -> its runs (all trials) for one method and B."""
    out = {}
    for r in records:
        if r["method"] == method and r["batch"] == b:
            out.setdefault(r["group"], []).append(r)
    return out


def aggregate_batches(cfg, methods, records, costs, greedy: bool) -> dict:
    by_b = {}
    for b in cfg.batch_sizes:
        base = _group_runs(records, "normal", b)
        # Per batch: the median over trials of its throughput.
        base_tps = {g: statistics.median(sum(map(len, r["tokens"])) / r["seconds"] for r in runs)
                    for g, runs in base.items()}
        entries = {}
        for m in methods:
            runs = _group_runs(records, m.name, b)
            tps = {g: statistics.median(sum(map(len, r["tokens"])) / r["seconds"] for r in rs) for g, rs in runs.items()}
            flat = [r for rs in runs.values() for r in rs]
            per_token = [s / max(len(t), 1) * 1000 for r in flat for s, t in zip(r["row_seconds"], r["tokens"])]
            stats = [s for r in flat if r["trial"] == 0 for s in r["stats"]]
            drafted, accepted = sum(s["drafted"] for s in stats), sum(s["accepted"] for s in stats)
            steps = sum(s["target_calls"] - 1 for s in stats)
            entry = {
                "tokens_per_s": sum(sum(map(len, r["tokens"])) for r in flat) / sum(r["seconds"] for r in flat),
                "throughput_ratio": summarize_ratios([tps[g] / base_tps[g] for g in tps]),
                "latency_ms_per_token": {"median": float(np.median(per_token)),
                                         "p90": float(np.percentile(per_token, 90))},
                "acceptance_rate": accepted / drafted if drafted else None,
                "mean_drafted_per_step": drafted / steps if steps else None,
            }
            if greedy and m.name != "normal":  # every row must be plain decoding's row
                entry["row_mismatches"] = sum(
                    mine != ref for g, rs in runs.items() for r in rs if r["trial"] == 0
                    for mine, ref in zip(r["tokens"], next(x for x in base[g] if x["trial"] == 0)["tokens"]))
            entries[m.name] = entry
        by_b[str(b)] = entries
    return {"batch_sizes": list(cfg.batch_sizes), "methods": [m.name for m in methods], "by_batch": by_b,
            "verify_costs": costs, "crossover": crossover(cfg.batch_sizes, by_b),
            "records": [{k: v for k, v in r.items() if k != "tokens"} | {"n_tokens": [len(t) for t in r["tokens"]]}
                        for r in records]}


def crossover(batch_sizes, by_b) -> dict:
    """The best speculative method per B (by throughput ratio to plain), and the first B from
    which none beats plain decoding (None: speculation paid at every B measured)."""
    best = {}
    for b in batch_sizes:
        spec = {name: e["throughput_ratio"]["geomean"] for name, e in by_b[str(b)].items() if name != "normal"}
        if spec:
            name = max(spec, key=spec.get)
            best[str(b)] = {"method": name, "ratio": spec[name]}
    stops = next((b for b in batch_sizes if str(b) in best and best[str(b)]["ratio"] <= 1.0), None)
    pays = [b for b in batch_sizes if str(b) in best and best[str(b)]["ratio"] > 1.0 and (stops is None or b < stops)]
    return {"best": best, "stops_paying_at": stops, "pays_up_to": max(pays) if pays else None}
