#!/usr/bin/env bash
# Prepare, on this (CPU) machine, what bench/gpu.sh needs on a lent GPU machine that has
# PyTorch and Triton but no network: the wheels of kdnctl's other dependencies (.whl/) and the
# default model split in two halves (.gguf/a, .gguf/b), because one device call carries at most
# 64 MiB. Both folders are ignored by git (.git/info/exclude). Then, as two device calls on the
# same warm machine:
#   carry [.whl, .gguf/a]:  bash bench/gpu.sh setup kernels kbench
#   carry [.gguf/b]:        GGUF_SHA=<printed below> bash bench/gpu.sh model e2e ttft
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
for p in /.whl/ /.gguf/; do grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
# the versions installed here, for the GPU machine's Python 3.12
pkgs=$($PY -m pip list --format=freeze 2>/dev/null | grep -iE '^(gguf|lmdb|starlette|uvicorn|blake3|zstandard|isal)==')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pkgs
gguf=$($PY -c "from kdnctl.models.load import default_gguf_path; print(default_gguf_path())")
mkdir -p .gguf
half=$((44 * 1048576))  # tree (~10 MiB) + wheels (~7 MiB) + this half stays under 64 MiB
head -c "$half" "$gguf" > .gguf/a
tail -c +$((half + 1)) "$gguf" > .gguf/b
echo "GGUF_SHA=$(sha256sum "$gguf" | cut -d' ' -f1)"
du -sh .whl .gguf/a .gguf/b
