#!/usr/bin/env bash
# The 0.083 default against the same recipe with a ten times stronger ridge on the value refit
# (refit 0.1: the kept values move less towards the document's own queries), on the tune half of
# the word-answer set: two shards, one core each with their own stores, then one merged table.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=research/results/words-083-refit-ridge
DEADLINE=${DEADLINE:-02:58}
ridge="--budget 0.083 --option refit=0.1 --option refit_hold=true --option refit_decoded=true --option refit_feedback=true"
common=(--tasks realtext-words --split tune --no-default-recipes --per-task --interleave --threads 1
        --recipe "--budget 0.083" --recipe "$ridge" --deadline "$DEADLINE")
for i in 0 1; do
  nice -n 5 python bench/quality.py "${common[@]}" --shard $i/2 --store "${STORE:-/tmp/qwordstune}$i" \
    --out $D/shard$i.json > $D/shard$i.txt 2> $D/shard$i.log &
done
wait
python bench/quality.py --merge $D/shard0.json $D/shard1.json --out $D/quality.json > $D/quality.txt
