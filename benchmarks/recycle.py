"""Token Recycling measured: the default (lookup + datastore) beside the same with recycling, and
recycling alone, paired. python benchmarks/recycle.py PROMPTS.jsonl OUT_DIR TRIALS"""
import sys
from pathlib import Path
from specdec.bench import runner, methods as M
from specdec.bench.report import write_report, print_summary
from specdec.drafters import CompositeDrafter, RecyclingDrafter
orig = runner.build_methods

def build(cfg, target, draft_model, hf, hf_draft, llama_gguf=None, n_ctx=None, store=None):
    ms = orig(cfg, target, draft_model, hf, hf_draft, llama_gguf, n_ctx, store)
    sp = dict(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=0)
    for k in cfg.ks:
        ms.append(M.Speculative(target, RecyclingDrafter(), "recycle", k, sp))
        ms.append(M.Speculative(target, CompositeDrafter(datastore=store, recycle=True), "store-recycle", k, sp))
    return ms

runner.build_methods = build
cfg = runner.BenchConfig(datastore="smollm2-135m-instruct", prompts=sys.argv[1], max_tokens=96, trials=int(sys.argv[3]),
                         peers=False, llama_cpp_peers=False, threads=2, draft=None)
rep = runner.run_benchmark(cfg, log=lambda m: print(m, file=sys.stderr))
write_report(rep, Path(sys.argv[2]))
print_summary(rep)
