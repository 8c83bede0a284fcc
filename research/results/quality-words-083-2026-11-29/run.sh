#!/usr/bin/env bash
# The 0.083 default against the full cache on the report half of the word-answer set (60 tasks),
# two shards on one core each (their own stores), then one merged table.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=research/results/quality-words-083-2026-11-29
DEADLINE=${DEADLINE:-17:45}
common=(--tasks realtext-words --split report --no-default-recipes --per-task --interleave --threads 1
        --recipe "--budget 0.083" --deadline "$DEADLINE")
for i in 0 1; do
  nice -n 5 python bench/quality.py "${common[@]}" --shard $i/2 --store "${STORE:-/tmp/qwords}$i" \
    --out $D/shard$i.json > $D/shard$i.txt 2> $D/shard$i.log &
done
wait
python bench/quality.py --merge $D/shard0.json $D/shard1.json --out $D/quality.json > $D/quality.txt
