"""Make a cheap (and poor) draft from a target: its first N layers, its norm and its head.

Used by docs/benchmark.md to show what a low-acceptance draft does to the speedup.
    python scripts/truncated_draft.py --layers 2 --out drafts/smollm2-first2
"""
import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

import specdec


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=specdec.DEFAULT_MODEL)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    src, out = specdec.hf_checkpoint(args.target), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= args.layers < config["num_hidden_layers"]:
        raise SystemExit(f"--layers must be in [1, {config['num_hidden_layers']})")
    config["num_hidden_layers"] = args.layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    keep = {k: v for k, v in state.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < args.layers}
    save_file(keep, str(out / "model.safetensors"))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "generation_config", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    print(f"wrote {out} ({args.layers} of the target's layers)")


if __name__ == "__main__":
    main()
