"""How much of the perfect schedule does `auto` take, and would another schedule take more?
A replay of the default drafter (prompt lookup + the shipped datastore) against the target's
greedy output, with no target passes: at each position the sources the drafter offers (their
names, as `auto` keys its statistics) and how many of each one's proposals the target accepts
are known, so a schedule's choices can be played out and charged the pass costs a bench run
measured on its engine (`costs.pass_cost` of REPORT, its plain decoding's time and prefill per
prompt for the end-to-end figures, as its "With a perfect schedule" table). Seconds, not a bench:
a schedule change can be tried on either engine's costs before it is timed.

    python3 scripts/probes/schedule_replay.py bench-runs/oracle-native/report.json [--k-max 15]
        [--split 0.5 0.8] [--lookup-max 32] [--head /tmp/hs/head.safetensors --head-cut 0.1 0.2
        --calibration /tmp/hs/suite-rows.json]

The options add schedules that tell `auto` more at each step (docs/benchmark.md, "Route: the
target's hidden state as a judge"): each source split by the target's probability of the bonus
token (--split), prompt lookup matching up to --lookup-max tokens in bands of match length,
each source split by what the hidden-state head of hidden_scorer.py gives its first proposal
(--head-cut), and p_1 told each step by that head, calibrated by logistic regression on
another prompt set (--calibration, from `hidden_scorer.py replay --dump`).

The target's output is the native engine's (on llama.cpp it parts from it at ties only).
"""
from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict

import numpy as np
import torch

import specdec
from specdec import CompositeDrafter, NgramDrafter
from specdec.bench.ceiling import fewest_units, offers, over_plain, replay
from specdec.bench.stats import geomean
from specdec.bench.suite import load_suite, render
from specdec.schedule import AdaptiveK, SourceStats

from hidden_scorer import Head, hidden_states, load_weights


def chosen_probability(target, prompt_ids, output) -> list[float]:
    """The target's probability of each output token where it chose it (greedy: its top one),
    which the loop holds after the pass that chose it at no cost."""
    seq = list(prompt_ids) + list(output)
    target.reset(len(seq))
    logits = target.forward(seq)[len(prompt_ids) - 1: -1]
    return torch.softmax(logits.float(), -1).gather(1, torch.tensor(output)[:, None])[:, 0].tolist()


def split(steps, sure: list[float], cuts) -> list:
    """The same offers, each source split by the target's probability of the step's last
    token (the bonus token the drafts follow): one source per bucket between `cuts`."""
    return [[(f"{name}@{sum(sure[t - 1] >= c for c in cuts)}", n, acc) for name, n, acc, _ in here] if t else here
            for t, here in enumerate(steps)]


def head_scores(target, head, prompt_ids, output) -> torch.Tensor:
    """log p of every token at each step t >= 1, by the hidden-state head (hidden_scorer.py) from
    the target's last hidden state before the bonus token output[t-1] and that token."""
    seq = list(prompt_ids) + list(output)
    h, _ = hidden_states(target.module, seq, logits=False)
    at = torch.arange(len(prompt_ids) - 1, len(seq) - 1)  # the row before each output token
    with torch.no_grad():
        return torch.log_softmax(head(h[at], torch.tensor(output)), -1)  # row t-1: step t's first draft


def split_by_head(steps, scores, cut: float) -> list:
    """The same offers, each source split by whether the head gives its first proposal at
    least `cut` probability ("+") or not ("-")."""
    return [[(f"{name}{'+' if first is not None and scores[t - 1, first].exp() >= cut else '-'}", n, acc, first)
             for name, n, acc, first in here] if t else here for t, here in enumerate(steps)]


def play(schedule: AdaptiveK, steps, cost, kinds: Counter | None = None) -> float:
    """One call's time in one-token passes when `schedule` chooses, learning as it goes
    (`specdec.bench.ceiling.replay`); `kinds` (if given) sums each kind of step's count, extra
    cost over a plain step and tokens left on the table (what the best offered source would have
    had accepted beyond what was). A Hinted schedule is told each step's hints before it chooses."""
    n, units = len(steps), 0.0
    if isinstance(schedule, Hinted):
        schedule.hint = steps.hints[1]
    for t, offered, source, drafted, accepted in replay(schedule, steps, cost):
        units += cost[drafted + 1]
        if kinds is not None:
            best = max((min(acc, schedule.k_max, n - t - 1) for _, acc in offered.values()), default=0)
            kind = ("plain, nothing right" if not drafted and not best else "plain, a source right" if not drafted
                    else "drafted, none accepted" if not accepted else "drafted, all accepted, more right"
                    if accepted == drafted and offered[source][1] > accepted else "drafted, another source better"
                    if best > accepted else "drafted, the best here")
            kinds[kind, "steps"] += 1
            kinds[kind, "extra"] += cost[drafted + 1] - 1
            kinds[kind, "left"] += best - accepted
        if isinstance(schedule, Hinted) and t + accepted + 1 < n:
            schedule.hint = steps.hints[t + accepted + 1]
    return units


def lookup_only(steps) -> list:
    """The offers of prompt lookup alone (the default without its datastore)."""
    return [[o for o in here if o[0].startswith("lookup")] for here in steps]


class LongLookup(NgramDrafter):
    """Prompt lookup matching up to `max_ngram` tokens, its sources the match length up to 3,
    then bands of longer ones: a copy that has run long is a better bet than a 3-token match."""
    BANDS = (4, 8, 16)

    def sources(self, ids, row=0):
        match = self._match(ids, row)
        if not match:
            return ()
        n = match[1]
        return (f"lookup{n}" if n < self.BANDS[0] else f"lookup{max(b for b in self.BANDS if b <= n)}+",)


def features(family: str, n: int, head_logp: float) -> np.ndarray:
    return np.array([1.0, head_logp, family == "store", n, (family == "store") * head_logp])


def fit_calibration(path) -> np.ndarray:
    """Logistic weights for P(first proposal right | source, match length, the head's log p of
    it), fitted by Newton's method to hidden_scorer.py's --dump of another prompt set."""
    rows = json.loads(open(path).read())
    X = np.stack([features(r["src"], r["n"], r["head"]) for r in rows])
    y = np.array([r["first"] for r in rows], float)
    w = np.zeros(X.shape[1])
    for _ in range(25):
        p = 1 / (1 + np.exp(-X @ w))
        g = X.T @ (p - y)
        H = X.T @ (X * (p * (1 - p))[:, None]) + 1e-6 * np.eye(len(w))
        w -= np.linalg.solve(H, g)
    return w


class Hinted(AdaptiveK):
    """auto, with the first draft's acceptance for this step told by the calibrated head
    instead of the source's learned p_1 (later positions as learned)."""
    hint: dict = {}

    def acceptance(self, source="model"):
        p = super().acceptance(source)
        if source in self.hint:
            p = [self.hint[source]] + p[1:]
        return p


def hints(steps, scores, w) -> list[dict]:
    out = [{}]
    for t, here in enumerate(steps[1:], 1):
        h = {}
        for name, n, acc, first in here:
            if first is not None:
                family = name.rstrip("0123456789")
                h[name] = float(1 / (1 + np.exp(-features(family, int(name[len(family):] or 0),
                                                           float(scores[t - 1, first])) @ w)))
        out.append(h)
    return out


class Offers(list):
    """A call's offers, knowing its prompt."""
    prompt = None


class FirstTry(AdaptiveK):
    """auto, but a source's first try drafts K0 tokens (2 on any engine, as shipped before),
    not the k its prior makes the most of at the costs measured so far (AdaptiveK.first_try)."""
    K0 = 4

    def first_try(self):
        return min(self.K0, self.k_max)


class FirstTryTwo(FirstTry):
    K0 = 2


class FamilyPrior(AdaptiveK):
    """auto, but a new source (a match length not seen yet) starts from its nearest measured
    sibling's per-position acceptance (2 pseudo-observations each) and draft cost."""

    def _source(self, name):
        if name not in self.sources:
            family = name.rstrip("0123456789")
            length = lambda n: int(n[len(family):] or 0)  # noqa: E731
            siblings = [n for n, s in self.sources.items()
                        if n.rstrip("0123456789") == family and s.t_draft is not None and s.tries]
            s = self.sources[name] = SourceStats(probe_every=self.probe_every)
            if siblings:
                sibling = min(siblings, key=lambda n: (abs(length(n) - length(name)), length(n)))
                p = self.acceptance(sibling)
                s.hits, s.tries, s.prior = [x * self.PRIOR_WEIGHT for x in p], [self.PRIOR_WEIGHT] * len(p), [0.0] * len(p)
                s.t_draft = self.sources[sibling].t_draft
        return self.sources[name]


def carried(previous: AdaptiveK | None, k_max: int, costs_only: bool) -> AdaptiveK:
    """A fresh schedule that starts from what `previous` (the last call's) measured: its verify
    costs and draft costs, and unless costs_only its acceptance too."""
    s = AdaptiveK(k_max)
    if previous is not None:
        s.verify_n, s.verify_s = dict(previous.verify_n), dict(previous.verify_s)
        for name, old in previous.sources.items():
            new = s._source(name)
            new.t_draft = old.t_draft
            if not costs_only:
                new.hits, new.tries, new.prior = list(old.hits), list(old.tries), list(old.prior)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report")
    ap.add_argument("--k-max", type=int, default=16, help="auto's most drafts a step (15 on the AMX kernel)")
    ap.add_argument("--split", nargs="*", default=[], metavar="CUTS",
                    help="also auto with each source split by the target's p(b) at these cuts, e.g. 0.5 0.5,0.9")
    ap.add_argument("--lookup-max", type=int, default=0,
                    help="also auto with prompt lookup matching up to this many tokens (LongLookup)")
    ap.add_argument("--head", help="the hidden-state head hidden_scorer.py trained (head.safetensors): split sources by it")
    ap.add_argument("--head-cut", nargs="*", type=float, default=[0.1, 0.2, 0.3])
    ap.add_argument("--calibration", help="hidden_scorer.py replay --dump of another prompt set: p_1 from the head")
    args = ap.parse_args()
    torch.set_num_threads(2)
    report = json.loads(open(args.report).read())
    cost = {int(n): v for n, v in report["costs"]["pass_cost"].items()}
    plain = defaultdict(list)
    for r in report["records"]:
        if r["method"] == "normal":
            plain[r["prompt"]].append((r["seconds"], r["prefill_seconds"]))
    plain = {p: (float(np.median([s for s, _ in v])), float(np.median([f for _, f in v]))) for p, v in plain.items()}
    target = specdec.load_model("smollm2-135m-instruct")
    store = specdec.load_datastore("smollm2-135m-instruct")
    prompts = load_suite(report["config"]["prompts"])
    render(prompts, target, target.tokenizer)
    calls, sure, long_offers, scored = [], {}, {}, {}
    if args.head:
        head = Head(target.module)
        load_weights(head, args.head)
    for p in prompts:
        out = specdec.generate(target, None, p.ids, report["config"]["max_tokens"]).token_ids
        calls.append((p, offers(CompositeDrafter(lookup=NgramDrafter(), datastore=store), p.ids, out, args.k_max)))
        if args.split:
            sure[p.id] = chosen_probability(target, p.ids, out)
        if args.head:
            scored[p.id] = head_scores(target, head, p.ids, out)
        if args.lookup_max:
            long_offers[p.id] = offers(CompositeDrafter(lookup=LongLookup(args.lookup_max), datastore=store),
                                       p.ids, out, args.k_max)

    def perfect(steps):
        runs = defaultdict(lambda: [0] * len(steps))
        for t, here in enumerate(steps):
            for name, _, acc, *_ in here:
                family = name.rstrip("0123456789")
                runs[family][t] = max(runs[family][t], min(acc, args.k_max))
        return fewest_units(dict(runs) or {"none": [0] * len(steps)}, cost, defaultdict(float))

    last = {}  # the carried schedules' previous call

    def chained(key, costs_only):
        def run(steps):
            last[key] = carried(last.get(key), args.k_max, costs_only)
            return play(last[key], steps, cost)
        return run

    kinds = Counter()
    schedules = {
        "auto (fresh each call, shipped)": lambda steps: play(AdaptiveK(args.k_max), steps, cost, kinds),
        "auto, its costs carried": chained("costs", True),
        "auto, everything carried": chained("all", False),
        "auto, first tries at k = 4": lambda steps: play(FirstTry(args.k_max), steps, cost),
        "auto, first tries at 2 (as before)": lambda steps: play(FirstTryTwo(args.k_max), steps, cost),
        "auto, a sibling's prior": lambda steps: play(FamilyPrior(args.k_max), steps, cost),
        "perfect": perfect,
        "lookup alone, auto": lambda steps: play(AdaptiveK(args.k_max), lookup_only(steps), cost),
        "lookup alone, perfect": lambda steps: perfect(lookup_only(steps)),
    }
    for cuts in args.split:
        schedules[f"auto, split at p(b) {cuts}"] = lambda steps, cuts=tuple(map(float, cuts.split(","))): play(
            AdaptiveK(args.k_max), split(steps, sure[steps.prompt], cuts), cost)
    if args.lookup_max:
        schedules[f"auto, lookup up to {args.lookup_max} tokens, banded"] = lambda steps: play(
            AdaptiveK(args.k_max), long_offers[steps.prompt], cost)
    for cut in args.head_cut if args.head else []:
        schedules[f"auto, split by the head at {cut}"] = lambda steps, cut=cut: play(
            AdaptiveK(args.k_max), split_by_head(steps, scored[steps.prompt], cut), cost)
    if args.calibration:
        w = fit_calibration(args.calibration)
        print("calibration weights (1, head log p, store, n, store x head log p):", np.round(w, 3))
        schedules["auto, p_1 from the calibrated head"] = lambda steps: play(Hinted(args.k_max), steps, cost)
    ratios = defaultdict(list)
    for p, steps in calls:  # in the suite's order: what a carried schedule learned comes from earlier prompts
        seconds, prefill = plain[p.id]
        steps = Offers(steps)
        steps.prompt = p.id
        if args.calibration:
            steps.hints = hints(steps, scored[p.id], w)
        for name, units_of in schedules.items():
            ratio = over_plain(len(steps), units_of(steps), (seconds, prefill))
            ratios[name, p.category].append(ratio)
            ratios[name, "all"].append(ratio)
    cats = sorted({p.category for p in prompts}) + ["all"]
    print(f"replayed over plain decoding, end to end, at the pass costs of {args.report} "
          f"(a 2 / 5 / 9-token pass {cost[2]:.2f} / {cost[5]:.2f} / {cost[9]:.2f}):")
    print(f"  {'':32s}" + "".join(f"{c[:10]:>11s}" for c in cats))
    for name in schedules:
        print(f"  {name:32s}" + "".join(f"{geomean(ratios[name, c]):10.2f}x" for c in cats))
    print("the shipped schedule's steps, by kind (extra cost over plain steps, in one-token passes; tokens "
          "the best offered source had right beyond those accepted):")
    for kind in sorted({k for k, _ in kinds}):
        print(f"  {kind:34s} {kinds[kind, 'steps']:5.0f} steps, extra cost {kinds[kind, 'extra']:6.1f}, "
              f"left {kinds[kind, 'left']:4.0f} tokens")


if __name__ == "__main__":
    main()
