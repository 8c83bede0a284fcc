#!/usr/bin/env bash
# The 0.083 default (half of the tokens kept) against the same recipe keeping three quarters of
# the tokens at coarser steps, on the tune half of the word-answer set: two shards of three (40 of
# the 60 tune tasks), one core each with their own stores, then one merged table.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=research/results/words-083-keep-probe
DEADLINE=${DEADLINE:-20:50}
common=(--tasks realtext-words --split tune --no-default-recipes --per-task --interleave --threads 1
        --recipe "--budget 0.083" --recipe "--recipe $D/keep075.toml" --deadline "$DEADLINE")
for i in 0 1; do
  nice -n 5 python bench/quality.py "${common[@]}" --shard $i/3 --store "${STORE:-/tmp/qwordstune}$i" \
    --out $D/shard$i.json > $D/shard$i.txt 2> $D/shard$i.log &
done
wait
python bench/quality.py --merge $D/shard0.json $D/shard1.json --out $D/quality.json > $D/quality.txt
