#!/usr/bin/env bash
# Install from scratch (idempotent) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
export TRITON_INTERPRET=1
python -m pytest -q -ra "$@"
