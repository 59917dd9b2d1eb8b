"""Choosing how many tokens to draft each step (`num_draft_tokens="auto"`).

k drafts cost k * t_draft + t_verify(k) seconds and yield 1 + sum_{j<=k} p_1 ... p_j
tokens, where p_i is the probability that draft i is accepted given that drafts
1..i-1 were. With one constant p this is Leviathan et al.'s (1 - a^(k+1)) / (1 - a);
AdaptiveK keeps one estimate per position instead, because acceptance comes in runs:
once prompt lookup has matched a quoted span, the next tokens of the span are almost
sure to match too, so p_2.. is far above p_1 and long blocks pay. It picks the k in
0..k_max with the most expected tokens per second, from estimates it keeps as the loop
runs: each p_i as an exponentially weighted hit rate (shrunk towards p_{i-1} while
position i has few observations), t_draft per drafted token, and t_verify(k) as a line
fitted to the verify passes measured so far (with a step at each tile of rows where the
engine computes a pass's rows a tile at a time). In a batch each row gets its own k.

Statistics are kept per *source*: prompt lookup (free, right in runs, and the more
often the longer the matched n-gram) and a model draft (costly, right ~1/3 of the time)
differ too much for one blended estimate to fit either. Where a composite drafter has
both a match and its model, the schedule takes whichever promises more. A source it has not
measured yet is tried at once (at the k its prior makes the most of at the costs measured:
`first_try`), unless a measured one the drafter prefers to it already beats
a plain step (a model draft beside a lookup that keeps paying is never run, nor its prompt
read), or the verify costs measured are so steep that even its prior would not pay (then
only probes, below, measure it).

k = 0 is plain decoding: it wins when the draft is too slow or too often wrong. A
schedule stuck at 0 would never learn that the draft got better, so after `probe_every`
plain steps it drafts one token to measure again (in a batch, on one row only: that is
enough to measure, and the pass stays small); each probe that fails doubles that
interval (up to `max_probe_every`), so a useless draft costs ever less, and a probe that
succeeds resets it. Where a 2-token pass costs more than PROBE_COST of a plain one, the
interval stretches in proportion, so that probing takes the same share of the time whatever
a probe costs (on llama.cpp on a Zen 4 CPU a probe costs 0.6-0.8 of a pass, and probes of
every match length of every source made two thirds of what the default lost there).

Choosing k from past steps only does not change the output where the engine's rows are
invariant (the bf16 kernel): every token is the target's choice at its position whatever k
was (sampling.verify). Elsewhere (torch, llama.cpp) a block's rows round differently from a
one-token pass, so at a near tie the output can depend on the blocks; there the loop charges
the schedule fixed costs (`FixedCosts`) instead of clock time, and the same inputs make the
same choices, so the same output, however the machine's timings vary.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """E[tokens per target pass] with i.i.d. acceptance alpha and k drafts: (1 - a^(k+1)) / (1 - a)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass(frozen=True)
class FixedCosts:
    """A step's costs fixed before the call, in one-token target passes, charged instead of
    clock time where the output could follow the timings (module docstring).

    block, per_token: a verify pass of n >= 2 tokens costs block + per_token * (n - 2)
    (the engine's `block_cost`); draft_step: a model draft's step (the shipped draft's, in
    the loop: 0.20, docs/results.md); a lookup's costs nothing."""

    block: float
    per_token: float
    draft_step: float = 0.2

    def verify(self, tokens: int) -> float:
        return 1.0 if tokens == 1 else self.block + self.per_token * (tokens - 2)

    def step(self, outcomes: list[tuple[str | None, int, int]]) -> tuple[float, float]:
        """(draft, verify) cost of a step, as `AdaptiveK.update_batch` takes them."""
        draft_steps = max((n for src, n, _ in outcomes if src == "model"), default=0)
        return self.draft_step * draft_steps, self.verify(sum(n + 1 for _, n, _ in outcomes))


@dataclass
class SourceStats:
    """What one proposer has done: per-position hit/try counts (decayed) and its cost."""

    hits: list[float] = field(default_factory=list)  # hits[i]: draft i+1 accepted
    tries: list[float] = field(default_factory=list)  # tries[i]: draft i+1 proposed, drafts 1..i accepted
    prior: list[float] = field(default_factory=list)  # prior[i]: weight of p_i's prior, decaying as tries come
    t_draft: float | None = None  # seconds per drafted token
    plain_steps: int = 0  # plain steps since the last probe
    probe_every: int = 0
    probing: bool = False


class AdaptiveK:
    K_MAX = 16  # the most drafts a step, by default
    PRIOR = 0.5  # p_1 before any observation
    PRIOR_WEIGHT = 2.0  # pseudo-observations behind the prior (p_{i-1} for p_i); they decay like real ones
    PROBE_COST = 0.1  # a probe's extra cost, in plain passes, up to which probe_every holds as it is

    def __init__(self, k_max: int = K_MAX, decay: float = 0.95, probe_every: int = 8, max_probe_every: int = 128,
                 tile: int | None = None):
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        self.k_max, self.decay = k_max, decay
        self.tile = tile  # rows a pass computes at once (the engine's pass_tile), or None
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.sources: dict[str, SourceStats] = {}
        # Verify passes by their size in tokens: decayed count, and decayed sum of seconds.
        self.verify_n: dict[int, float] = {}
        self.verify_s: dict[int, float] = {}
        self._verify_fit: tuple[float, float] | None = None

    def _source(self, name: str) -> SourceStats:
        if name not in self.sources:
            self.sources[name] = SourceStats(probe_every=self.probe_every)
        return self.sources[name]

    def acceptance(self, source: str = "model") -> list[float]:
        """p_1..p_kmax: the chance draft i is accepted given drafts 1..i-1 were."""
        s = self._source(source)
        p, prev = [], self.PRIOR
        for i in range(self.k_max):
            if i < len(s.tries):
                prev = (s.hits[i] + s.prior[i] * prev) / (s.tries[i] + s.prior[i])
            # else: nothing seen at this position yet; assume the previous position's rate
            p.append(prev)
        return p

    def alpha(self, source: str = "model") -> float:
        """Acceptance of the first draft of a block (the i.i.d. model's alpha, if acceptance were i.i.d.)."""
        return self.acceptance(source)[0]

    def pass_time(self, tokens: int) -> float:
        """Seconds of a verify pass over `tokens` tokens in all (1 + k for one row; the sum of
        1 + k_b over the rows of a batch): a one-token pass as measured, and a + b * tokens,
        fitted to the measured blocks, for more.

        A line, not a table: single passes are noisy (tens of percent on a busy machine),
        and a table would let one lucky 3-token pass look cheaper than a 2-token one. But the
        one-token pass apart: an engine may take another path for it (llama.cpp's bf16 blocks
        on a Zen 4 CPU cost 1.6-1.8x a one-token pass at 2 tokens, then about 0.15x more a
        token), and a line through both would make short blocks look cheap. With one measured
        block size the line goes through it and the one-token pass (flat with nothing else:
        where decoding is memory-bound verification nearly is); it tilts once blocks of other
        sizes come in; no block is taken to cost less than a one-token pass. In a batch the
        slope is where speculation's gain goes: B rows drafting k each make a pass of B * (k + 1)."""
        one = self.verify_s[1] / self.verify_n[1] if 1 in self.verify_n else 0.0
        if tokens == 1 and one:
            return one
        if self._verify_fit is None:
            blocks = [n for n in self.verify_n if n > 1]
            ns = blocks if len(blocks) > 1 else list(self.verify_n)
            w = [self.verify_n[n] for n in ns]
            y = [self.verify_s[n] / self.verify_n[n] for n in ns]
            W = sum(w)
            mn = sum(wi * n for wi, n in zip(w, ns)) / W
            my = sum(wi * yi for wi, yi in zip(w, y)) / W
            var = sum(wi * (n - mn) ** 2 for wi, n in zip(w, ns))
            slope = max(0.0, sum(wi * (n - mn) * (yi - my) for wi, n, yi in zip(w, ns, y)) / var) if var else 0.0
            self._verify_fit = (my - slope * mn, slope, 0.0)
            rounds = {-(-n // self.tile) for n in ns} if self.tile else set()
            if len(rounds) > 1 and len(ns) > 2:  # passes of several rounds of rows: a step at each round
                self._verify_fit = self._fit_rounds(ns, w, y) or self._verify_fit
        a, b, per_round = self._verify_fit
        rounds = -(-tokens // self.tile) if self.tile else 0
        return max(a + b * tokens + per_round * rounds, one, 1e-9)  # no block costs less than one token

    def _fit_rounds(self, ns, w, y) -> tuple[float, float, float] | None:
        """(a, b, c) for a + b * tokens + c * rounds, by weighted least squares; None where a
        coefficient comes out negative. A batch's pass computes its rows a tile at a time
        (kernel.tile_rows), so its cost steps at each tile and grows little within one: on
        the AMX VM, 16 rows 22.6 ms, 17 rows 24.3, 24 rows 25.1, 37 rows 33.3 (SmolLM2-135M)."""
        x = np.array([[1.0, n, -(-n // self.tile)] for n in ns])
        sw = np.sqrt(np.array(w))
        coef = np.linalg.lstsq(x * sw[:, None], np.array(y) * sw, rcond=None)[0]
        return None if (coef[1:] < 0).any() else tuple(float(c) for c in coef)

    def verify_time(self, k: int) -> float:
        """Seconds of one row's verify pass over 1 + k tokens."""
        return self.pass_time(k + 1)

    def expected_tokens(self, source: str = "model") -> list[float]:
        """Expected tokens a step yields (accepted drafts + the target's own) for k = 0..k_max."""
        tokens, run = [1.0], 1.0
        for p in self.acceptance(source):
            run *= p
            tokens.append(tokens[-1] + run)
        return tokens

    def expected_rates(self, source: str = "model") -> list[float]:
        """Expected tokens per second for k = 0..k_max drafts from `source`, one row."""
        t_draft = self._source(source).t_draft or 0.0
        return [n / (k * t_draft + self.verify_time(k)) for k, n in enumerate(self.expected_tokens(source))]

    def choose(self, sources=("model",)) -> tuple[str, int]:
        """The source (among those that can propose here) and k with the most expected
        tokens per second; k = 0 is a plain step."""
        return self.choose_batch([tuple(sources)])[0]

    def choose_batch(self, rows: list[tuple[str, ...]]) -> list[tuple[str | None, int]]:
        """One (source, k) per row of a batch (rows[b]: the sources that can propose for row b;
        empty: a plain step), for the most expected tokens per second over the whole batch.

        A step costs the draft steps of the costliest source it uses (a model draft runs its
        rows together) plus one verify pass over the sum of 1 + k_b. Each row gets its own k,
        0 included: a row whose best source is a poor bet takes a plain step in the same pass
        while a row copying a long match drafts many (`_allocate`). Candidate caps on the draft
        cost decide which sources may draft at all. With one row this is the best (source, k)
        for that row."""
        for sources in rows:
            for name in sources:
                self._source(name).probing = False
        if not self.verify_n:  # nothing measured yet: start modestly
            return [(s[0], min(2, self.k_max)) if s else (None, 0) for s in rows]
        # Score what has been measured. A source not yet measured is tried at once unless a
        # measured source the drafter prefers to it (listed before it) beats a plain step:
        # beside a lookup that pays, learning what a model draft would do costs its reading of
        # the prompt and its draft steps, which the lookup's tokens never repay; a lookup of
        # another match length, listed first, is tried as soon as it comes. Nor is it tried
        # where even its prior (p = PRIOR a draft, drafting free) would not beat a plain step
        # at the verify costs measured: where a 2-token pass costs 1.6x a 1-token one (llama.cpp
        # on a Zen 4 CPU), each try costs more than it can teach; probes measure it instead.
        measured = [tuple(n for n in s if self.sources[n].t_draft is not None) for s in rows]
        cost = {n: self.sources[n].t_draft for s in measured for n in s}
        tokens = {n: self.expected_tokens(n) for n in cost}
        def pays(name):  # some k >= 1 beats a plain step (rates[0])
            rates = self.expected_rates(name)
            return max(rates[1:]) > rates[0]

        unmeasured = []
        for s in rows:
            first = next((i for i, n in enumerate(s) if self.sources[n].t_draft is None), None)
            unmeasured.append(None if first is None or any(map(pays, s[:first])) or not pays(s[first])
                              else s[first])
        groups = list(Counter(measured).items())  # rows with the same sources choose alike: score each kind once
        # Caps on the draft cost: the sources cheaper than a quarter of a one-token pass (lookups)
        # as one, then each costlier one (a model draft) with them.
        cheap = max((c for c in cost.values() if c <= self.pass_time(1) / 4), default=None)
        caps = sorted(({cheap} | {c for c in cost.values() if cheap is None or c > cheap}) - {None})
        best_rate, choice = 0.0, {}
        for cap in caps:
            allowed = [[n for n in s if cost[n] <= cap] for s, _ in groups]
            rate, ks = self._allocate([(names, w) for names, (_, w) in zip(allowed, groups)], tokens, cap)
            if rate > best_rate:
                best_rate = rate
                choice = {s: (max(names, key=lambda n: tokens[n][k]), k)
                          for (s, _), names, k in zip(groups, allowed, ks) if k}
        best = [choice.get(m) or (r[0] if r else None, 0) for m, r in zip(measured, rows)]
        if any(unmeasured):
            return [(u, self.first_try()) if u else plan for u, plan in zip(unmeasured, best)]
        if all(k == 0 for _, k in best):  # plain decoding: count towards each source's next probe
            probing = []
            stretch = max(1.0, (self.pass_time(2) / self.pass_time(1) - 1) / self.PROBE_COST)
            for name in dict.fromkeys(n for s in rows for n in s):
                s = self.sources[name]
                s.plain_steps += 1
                if s.plain_steps >= round(s.probe_every * stretch):
                    s.plain_steps, s.probing = 0, True
                    probing.append(name)
            if probing:  # one row per probing source measures it; in a batch the others stay plain
                plan = []
                for s in rows:
                    name = next((n for n in s if n in probing), None)
                    plan.append((name, 1) if name else (s[0] if s else None, 0))
                    if name:
                        probing.remove(name)
                return plan
        return best

    def _allocate(self, groups: list[tuple[list[str], int]], tokens: dict, cap: float) -> tuple[float, list[int]]:
        """(expected tokens per second, k per group): groups[g] = (sources allowed, rows), rows
        alike. One kind of row: the best k of all. Several: one more draft for a group adds its
        expected tokens more, per row; these are taken best first (a group's k-th before its
        (k+1)-th), and each prefix is a plan, scored with the step's time: the verify pass over
        all rows' tokens, which may step at a tile of rows, and the cap for each draft step of
        the deepest row. The best plan wins; the all-plain one competes too."""
        rows = sum(w for _, w in groups)
        curves = [[max(tokens[n][k] for n in names) for k in range(self.k_max + 1)] if names else [1.0]
                  for names, _ in groups]

        def rate_of(got, drafts, deepest):  # expected tokens, drafts in all, the deepest row's k
            return got / (deepest * cap + self.pass_time(rows + drafts))

        if len(groups) == 1:  # every k, the one-token pass's own cost included
            (_, w), curve = groups[0], curves[0]
            return max((rate_of(w * c, w * k, k), [k]) for k, c in enumerate(curve))
        more = sorted(((c[k + 1] - c[k], g, k) for g, c in enumerate(curves) for k in range(len(c) - 1)),
                      key=lambda m: -m[0])
        ks = [0] * len(groups)
        got, drafts, deepest = sum(w * c[0] for (_, w), c in zip(groups, curves)), 0, 0
        best_rate, best = rate_of(got, drafts, deepest), list(ks)
        for gain, g, k in more:  # each plan is the last one plus a draft for one group: kept as running sums
            if ks[g] != k or gain <= 0:
                continue
            ks[g] += 1
            w = groups[g][1]
            got, drafts, deepest = got + w * gain, drafts + w, max(deepest, ks[g])
            if (rate := rate_of(got, drafts, deepest)) > best_rate:
                best_rate, best = rate, list(ks)
        return best_rate, best

    def first_try(self) -> int:
        """k for a source's first try once some passes are measured: the k its prior (p = PRIOR
        a draft, drafting free) makes the most tokens a second of at the verify costs measured
        so far. Where blocks cost little more than a one-token pass (the native kernel) that is
        3-4, so a first try at a long copy is not cut at 2 tokens; where a 2-token pass costs
        1.3x (llama.cpp's bf16 blocks) it is 2, what first tries drafted on every engine
        before (`git show 3681d61:docs/benchmark.md`, "Later the same day on the Zen 5 VM"). Until passes of two
        sizes are measured the line is flat (`pass_time`), which would make every k look free:
        then 2, modestly."""
        if len(self.verify_n) < 2:
            return min(2, self.k_max)
        tokens = [expected_tokens_per_step(self.PRIOR, k) for k in range(self.k_max + 1)]
        return max(range(1, self.k_max + 1), key=lambda k: tokens[k] / self.pass_time(k + 1))

    def update(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float,
               source: str = "model") -> None:
        """One step's outcome: `drafted` proposals from `source`, the first `accepted` kept."""
        self.update_batch([(source, drafted, accepted)], draft_seconds, verify_seconds)

    def update_batch(self, outcomes: list[tuple[str | None, int, int]], draft_seconds: float,
                     verify_seconds: float) -> None:
        """One step of a batch: per row (source, drafted, accepted), then the step's draft and
        verify seconds. The draft time is charged to the costliest source the step used (a
        model draft's steps dwarf a lookup's microseconds), per draft step; a source measured
        for the first time is charged with it too."""
        d = self.decay
        used = [(self._source(src), n) for src, n, _ in outcomes if n]
        for src, drafted, accepted in outcomes:
            if not drafted:
                continue
            s = self._source(src)
            reached = min(accepted + 1, drafted)  # positions whose outcome this step observed
            while len(s.tries) < reached:
                s.hits.append(0.0)
                s.tries.append(0.0)
                s.prior.append(self.PRIOR_WEIGHT)
            for i in range(reached):
                s.prior[i] *= d
                s.tries[i] = d * s.tries[i] + 1
                s.hits[i] = d * s.hits[i] + (i < accepted)
            if s.probing:  # back off while probes fail; come back at once when one succeeds
                s.probe_every = self.probe_every if accepted else min(2 * s.probe_every, self.max_probe_every)
        if used:
            per_step = draft_seconds / max(n for _, n in used)
            costliest = max((s for s, _ in used), key=lambda s: math.inf if s.t_draft is None else s.t_draft)
            for s in {id(s): s for s, _ in used}.values():
                if s is costliest or s.t_draft is None:
                    s.t_draft = per_step if s.t_draft is None else d * s.t_draft + (1 - d) * per_step
        size = sum(n + 1 for _, n, _ in outcomes)
        for n in self.verify_n:
            self.verify_n[n] *= d
            self.verify_s[n] *= d
        self.verify_n[size] = self.verify_n.get(size, 0.0) + 1
        self.verify_s[size] = self.verify_s.get(size, 0.0) + verify_seconds
        self._verify_fit = None


class FixedK:
    """k drafts a step, from the drafter's preferred source: the schedule of an integer
    `num_draft_tokens`. It learns nothing, so the loop treats it as any schedule."""

    def __init__(self, k: int):
        self.k = k

    def choose_batch(self, rows: list[tuple[str, ...]]) -> list[tuple[str | None, int]]:
        return [(s[0], self.k) if s else (None, 0) for s in rows]

    def update_batch(self, outcomes, draft_seconds: float, verify_seconds: float) -> None:
        pass

    def __repr__(self) -> str:
        return f"FixedK({self.k})"


class LoadGate:
    """Whether a step of n rows consults the drafter at all, from whole steps measured: tokens
    a second with drafting (its lookups and the schedule's choice included) and without, per
    n. Asking every row's sources costs a few percent of a 16-row pass (50 us a row on the AMX
    VM, against 25 ms a pass), which a loaded batch can take back from what drafting gains.
    The faster mode runs; every so often the other runs for a few steps to measure it again,
    less often each time it loses (as the schedule's probes)."""

    RUN = 4  # steps of the other mode a check runs
    FIRST, LAST = 8, 256  # steps between checks, after a switch and at most

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self.rate: dict[tuple[int, bool], float] = {}  # (n, drafting) -> tokens a second, decayed
        self.best: dict[int, bool] = {}
        self.every: dict[int, int] = {}
        self.step: Counter = Counter()

    def drafting(self, n: int) -> bool:
        """Whether this step of n rows drafts."""
        if (n, True) not in self.rate:
            return True
        if (n, False) not in self.rate:
            return False
        best, every = self.best.setdefault(n, self.rate[n, True] >= self.rate[n, False]), self.every.get(n, self.FIRST)
        self.step[n] += 1
        if self.step[n] > every + self.RUN:  # a check ends: keep the faster mode
            self.step[n] = 1
            faster = self.rate[n, True] >= self.rate[n, False]
            self.every[n] = min(2 * every, self.LAST) if faster == best else self.FIRST
            self.best[n] = best = faster
        return best if self.step[n] <= self.every.get(n, self.FIRST) else not best

    def update(self, n: int, drafting: bool, tokens: int, seconds: float) -> None:
        key, rate = (n, drafting), tokens / max(seconds, 1e-9)
        self.rate[key] = rate if key not in self.rate else self.decay * self.rate[key] + (1 - self.decay) * rate


def as_schedule(num_draft_tokens, k_max: int = AdaptiveK.K_MAX, tile: int | None = None) -> "AdaptiveK | FixedK":
    """The schedule `num_draft_tokens` names: "auto" (a fresh AdaptiveK of up to k_max drafts),
    an AdaptiveK as it is (it goes on learning), or an integer k >= 1."""
    k = num_draft_tokens
    if isinstance(k, (AdaptiveK, FixedK)):
        return k
    if isinstance(k, str) and k == "auto":
        return AdaptiveK(k_max=k_max, tile=tile)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"num_draft_tokens must be an integer >= 1, 'auto' or an AdaptiveK, got {k!r}")
    return FixedK(k)
