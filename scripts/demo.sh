#!/usr/bin/env bash
# The main job: install kdnctl and the default model, ingest the example corpus and compress it
# with the default recipe (stored K/V at 25% of the fp16 bytes, every token kept), then answer a
# question from the stored KV, compared with a full prefill.
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
