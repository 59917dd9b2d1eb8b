"""Choosing how many tokens to draft each step (`num_draft_tokens="auto"`).

With per-token acceptance probability a, k drafts yield (1 - a^(k+1)) / (1 - a) tokens
per step (Leviathan et al. 2023) and cost k * t_draft + t_verify(k) seconds. AdaptiveK
picks the k in 0..k_max with the most expected tokens per second, from estimates it
keeps as the loop runs: a as an exponentially weighted maximum-likelihood estimate
(accepted / (accepted + rejections)), t_draft per drafted token and t_verify per k.

k = 0 is plain decoding: it wins when the draft is too slow or too often wrong. A
schedule stuck at 0 would never learn that the draft got better (prompt lookup finds
matches once the output starts quoting the input), so every `probe_every` plain steps
it drafts one token to measure again.

Choosing k from past steps only does not change the output: greedy output is the
target's for any k, and the sampling rule is exact for any k.
"""
from __future__ import annotations



def expected_tokens_per_step(alpha: float, k: int) -> float:
    """E[tokens per target pass] with i.i.d. acceptance alpha and k drafts: (1 - a^(k+1)) / (1 - a)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


class AdaptiveK:
    def __init__(self, k_max: int = 8, decay: float = 0.9, probe_every: int = 8):
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        self.k_max, self.decay, self.probe_every = k_max, decay, probe_every
        self.accepted, self.rejected = 1.0, 1.0  # a weak prior: alpha = 0.5
        self.t_draft: float | None = None  # seconds per drafted token
        self.t_verify: dict[int, float] = {}  # tokens drafted -> seconds of the verify pass
        self.plain_steps = 0

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def _verify_time(self, k: int) -> float:
        # Not yet measured: assume the nearest measured k's cost (verification is close
        # to flat in k where decoding is memory-bound; a wrong guess is corrected once tried).
        nearest = min(self.t_verify, key=lambda m: (abs(m - k), m))
        return self.t_verify[nearest]

    def expected_rate(self, k: int) -> float:
        """Expected tokens per second with k drafts."""
        cost = k * (self.t_draft or 0.0) + self._verify_time(k)
        return expected_tokens_per_step(self.alpha, k) / cost if k else 1.0 / self._verify_time(0)

    def choose(self) -> int:
        if self.t_draft is None or not self.t_verify:
            return min(2, self.k_max)  # nothing measured yet: start modestly
        best = max(range(self.k_max + 1), key=self.expected_rate)
        if best == 0:
            self.plain_steps += 1
            if self.plain_steps % self.probe_every == 0:
                return 1
        return best

    def update(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        d = self.decay
        if drafted:
            self.accepted = d * self.accepted + accepted
            self.rejected = d * self.rejected + (accepted < drafted)
            per_token = draft_seconds / drafted
            self.t_draft = per_token if self.t_draft is None else d * self.t_draft + (1 - d) * per_token
        old = self.t_verify.get(drafted)
        self.t_verify[drafted] = verify_seconds if old is None else d * old + (1 - d) * verify_seconds
