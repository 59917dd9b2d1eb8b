"""The probes' shared timing loop: every method on every prompt, `trials` times, in the bench's
balanced orders (`specdec.bench.stats.interleaved_order`; before commit 05bb456 one order,
rotated: docs/benchmark.md "Method"), so that a noisy spell of the shared machine, and what
one method leaves behind for the next, hits each alike."""
from __future__ import annotations

import time
from collections import defaultdict

from specdec.bench.stats import interleaved_order


def interleaved(methods: dict, prompts, trials: int):
    """methods: name -> f(prompt ids) returning a Generation or a token list. Returns
    ({(name, prompt id): [seconds per token, a trial each]}, {name: [what f returned]})."""
    times, outputs = defaultdict(list), defaultdict(list)
    for trial in range(trials):
        for i, p in enumerate(prompts):
            for name in interleaved_order(list(methods), trial * len(prompts) + i):
                start = time.perf_counter()
                out = methods[name](p.ids)
                tokens = getattr(out, "token_ids", out)
                times[name, p.id].append((time.perf_counter() - start) / max(len(tokens), 1))
                outputs[name].append(out)
    return times, outputs
