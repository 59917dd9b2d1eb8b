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
fitted to the verify passes measured so far.

Statistics are kept per *source*: prompt lookup (free, right in runs, and the more
often the longer the matched n-gram) and a model draft (costly, right ~1/3 of the time)
differ too much for one blended estimate to fit either. Where a composite drafter has
both a match and its model, the schedule takes whichever promises more.

k = 0 is plain decoding: it wins when the draft is too slow or too often wrong. A
schedule stuck at 0 would never learn that the draft got better, so after `probe_every`
plain steps it drafts one token to measure again; each probe that fails doubles that
interval (up to `max_probe_every`), so a useless draft costs ever less, and a probe that
succeeds resets it.

Choosing k from past steps only does not change the output: greedy output is the
target's for any k, and the sampling rule is exact for any k.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """E[tokens per target pass] with i.i.d. acceptance alpha and k drafts: (1 - a^(k+1)) / (1 - a)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


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
    PRIOR = 0.5  # p_1 before any observation
    PRIOR_WEIGHT = 2.0  # pseudo-observations behind the prior (p_{i-1} for p_i); they decay like real ones

    def __init__(self, k_max: int = 16, decay: float = 0.95, probe_every: int = 8, max_probe_every: int = 128):
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        self.k_max, self.decay = k_max, decay
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.sources: dict[str, SourceStats] = {}
        # Verify passes by tokens drafted: decayed count, and decayed sum of seconds.
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

    def verify_time(self, k: int) -> float:
        """Seconds of a verify pass over 1 + k tokens: a + b k, fitted to the measured passes.

        A line, not a table: single passes are noisy (tens of percent on a busy machine),
        and a table would let one lucky k=2 pass look cheaper than k=1. With one measured
        k the line is flat (where decoding is memory-bound verification nearly is); it
        tilts once passes of other lengths come in."""
        if self._verify_fit is None:
            ks = list(self.verify_n)
            w = [self.verify_n[k] for k in ks]
            y = [self.verify_s[k] / self.verify_n[k] for k in ks]
            W = sum(w)
            mk = sum(wi * k for wi, k in zip(w, ks)) / W
            my = sum(wi * yi for wi, yi in zip(w, y)) / W
            var = sum(wi * (k - mk) ** 2 for wi, k in zip(w, ks))
            slope = max(0.0, sum(wi * (k - mk) * (yi - my) for wi, k, yi in zip(w, ks, y)) / var) if var else 0.0
            self._verify_fit = (my - slope * mk, slope)
        a, b = self._verify_fit
        return max(a + b * k, 1e-9)

    def expected_rates(self, source: str = "model") -> list[float]:
        """Expected tokens per second for k = 0..k_max drafts from `source`."""
        t_draft = self._source(source).t_draft or 0.0
        rates, tokens, run = [], 1.0, 1.0
        for k, p in enumerate([None] + self.acceptance(source)):
            if k:
                run *= p
                tokens += run
            rates.append(tokens / (k * t_draft + self.verify_time(k)))
        return rates

    def choose(self, sources=("model",)) -> tuple[str, int]:
        """The source (among those that can propose here) and k with the most expected
        tokens per second; k = 0 is a plain step."""
        for name in sources:
            s = self._source(name)
            s.probing = False
            if s.t_draft is None or not self.verify_n:
                return name, min(2, self.k_max)  # nothing measured yet: start modestly
        best_rate, best = 0.0, (sources[0], 0)
        for name in sources:
            rates = self.expected_rates(name)
            k = max(range(len(rates)), key=rates.__getitem__)
            if rates[k] > best_rate:
                best_rate, best = rates[k], (name, k)
        if best[1] == 0:  # plain decoding: count towards each source's next probe
            for name in sources:
                s = self.sources[name]
                s.plain_steps += 1
                if s.plain_steps >= s.probe_every:
                    s.plain_steps, s.probing = 0, True
                    return name, 1
        return best

    def update(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float,
               source: str = "model") -> None:
        """One step's outcome: `drafted` proposals from `source`, the first `accepted` kept."""
        d = self.decay
        if drafted:
            s = self._source(source)
            reached = min(accepted + 1, drafted)  # positions whose outcome this step observed
            while len(s.tries) < reached:
                s.hits.append(0.0)
                s.tries.append(0.0)
                s.prior.append(self.PRIOR_WEIGHT)
            for i in range(reached):
                s.prior[i] *= d
                s.tries[i] = d * s.tries[i] + 1
                s.hits[i] = d * s.hits[i] + (i < accepted)
            per_token = draft_seconds / drafted
            s.t_draft = per_token if s.t_draft is None else d * s.t_draft + (1 - d) * per_token
            if s.probing:  # back off while probes fail; come back at once when one succeeds
                s.probe_every = self.probe_every if accepted else min(2 * s.probe_every, self.max_probe_every)
        for k in self.verify_n:
            self.verify_n[k] *= d
            self.verify_s[k] *= d
        self.verify_n[drafted] = self.verify_n.get(drafted, 0.0) + 1
        self.verify_s[drafted] = self.verify_s.get(drafted, 0.0) + verify_seconds
        self._verify_fit = None
