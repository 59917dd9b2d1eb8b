"""The probes' shared timing loop: every method on every prompt, `trials` times, the order
rotated per prompt and trial so that a noisy spell of the shared machine hits each alike."""
from __future__ import annotations

import time
from collections import defaultdict


def interleaved(methods: dict, prompts, trials: int):
    """methods: name -> f(prompt ids) returning a Generation or a token list. Returns
    ({(name, prompt id): [seconds per token, a trial each]}, {name: [what f returned]})."""
    times, outputs = defaultdict(list), defaultdict(list)
    for trial in range(trials):
        for i, p in enumerate(prompts):
            names = list(methods)
            shift = (trial + i) % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.perf_counter()
                out = methods[name](p.ids)
                tokens = getattr(out, "token_ids", out)
                times[name, p.id].append((time.perf_counter() - start) / max(len(tokens), 1))
                outputs[name].append(out)
    return times, outputs
