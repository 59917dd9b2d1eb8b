"""The online datastore measured: the default (lookup + shipped datastore) against the same plus an online store of what the
target wrote in earlier calls (bounded, oldest out first). Each trial starts with an empty online store
and runs the prompts in a fixed order, so a prompt's call sees only earlier prompts' outputs.
Usage: python benchmarks/online_store.py PROMPTS.jsonl TRIALS MAX_TOKENS"""
import json, math, random, statistics, sys, time
import torch
from specdec import CompositeDrafter, Datastore, DatastoreDrafter, Drafter, load_datastore, load_model, speculative_generate
from specdec.bench.suite import load_suite, render

torch.set_num_threads(2)

class Online(DatastoreDrafter):
    """A datastore of the target's own recent outputs, rebuilt after each call."""
    def __init__(self, vocab, limit=200_000):
        Drafter.__init__(self); self._last = {}
        self.vocab_size, self.limit, self.history, self.store = vocab, limit, [], None
    def add(self, tokens):
        self.history.append(list(tokens))
        while sum(map(len, self.history)) > self.limit:
            self.history.pop(0)
        self.store = Datastore(self.history, self.vocab_size, "online")
    def _search(self, ids):
        return self.store.match(ids) if self.store is not None else None
    def sources(self, ids, row=0):
        found = self._match(ids, row)
        return (f"recent{found[0]}",) if found else ()

class Both(Drafter):
    def __init__(self, default, online):
        super().__init__(); self.default, self.online = default, online
        self.vocab_size = default.vocab_size
    def begin(self, c, b=1):
        super().begin(c, b); self.default.begin(c, b); self.online.begin(c, b)
    def sources(self, ids, row=0):
        return self.default.sources(ids, row) + self.online.sources(ids, row)
    def propose_rows(self, requests, params, noises):
        out = {}
        for row, (ids, k, src) in requests.items():
            part = self.online if src and src.startswith("recent") else self.default
            out[row] = part.propose(ids, k, params, noises[row], src, row)
        self.seconds = self.default.seconds + self.online.seconds
        return out

target = load_model(); tok = target.tokenizer
prompts = load_suite(sys.argv[1]); render(prompts, target, tok)
trials = int(sys.argv[2])
shipped = load_datastore(target.name)
times = {"default": {}, "online": {}}; tps = {"default": {}, "online": {}}
speculative_generate(target, CompositeDrafter(datastore=shipped), None, prompts[0].ids, 16)
for trial in range(trials):
    online = Online(target.vocab_size)
    for i, p in enumerate(prompts):
        order = ["default", "online"] if (i + trial) % 2 == 0 else ["online", "default"]
        for name in order:
            d = CompositeDrafter(datastore=shipped) if name == "default" else Both(CompositeDrafter(datastore=shipped), online)
            t0 = time.perf_counter()
            g = speculative_generate(target, d, None, p.ids, int(sys.argv[3]))
            dt = time.perf_counter() - t0
            times[name].setdefault(p.id, []).append(dt / len(g.token_ids))
            tps[name].setdefault(p.id, []).append(g.stats.tokens_per_target_call)
            if name == "online":
                out = g.token_ids
        online.add(out)  # what the target wrote
ratios = [statistics.median(times["default"][p]) / statistics.median(times["online"][p]) for p in times["default"]]
g = math.exp(statistics.fmean(map(math.log, ratios)))
rng = random.Random(0); b = sorted(math.exp(statistics.fmean(map(math.log, [rng.choice(ratios) for _ in ratios]))) for _ in range(10000))
print(json.dumps({"prompts": len(ratios), "online_over_default": round(g, 3), "ci95": [round(b[250], 3), round(b[9750], 3)],
                  "tokens_per_call": {k: round(statistics.fmean(statistics.median(v) for v in d.values()), 3) for k, d in tps.items()}}))
