#!/usr/bin/env bash
# The main job: ingest the example corpus with the default model, compress it with a shipped
# recipe, then answer a question from the stored KV and compare with a full prefill.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
export KDN_STORE="${KDN_STORE:-.kdn}"
kdnctl ingest examples/corpus
kdnctl ls
kdnctl ask zephyr-x200-manual.md "How long does it take to charge the Zephyr X200 battery to 80 %?" --compare
