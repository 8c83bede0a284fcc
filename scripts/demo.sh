#!/usr/bin/env bash
# The main job: ingest the example corpus with the default model and compress it with the shipped
# default recipe (kdnctl run: stored K/V at 25% of the fp16 bytes, every token kept, attention-weighted
# entropy-coded steps), then answer a question from the stored KV, compared with a full prefill.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
export KDN_STORE="${KDN_STORE:-.kdn}"
kdnctl run recipes/size-0.25.toml examples/corpus
kdnctl ls
Q="How long does it take to charge the Zephyr X200 battery to 80 %?"
kdnctl ask zephyr-x200-manual.md "$Q" --compare
kdnctl ask zephyr-x200-manual.md "$Q" --version b0.25
