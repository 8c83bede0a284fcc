#!/usr/bin/env bash
# Install from scratch (idempotent) with the engines and the test extras, and run the whole test
# suite, the engines' interop tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --engines --test
. .venv/bin/activate
export TRITON_INTERPRET=1
python -m pytest -q -ra "$@"
