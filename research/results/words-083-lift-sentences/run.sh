#!/usr/bin/env bash
# The 0.083 default against the same recipe with the precision lift (and so the refit's held
# values) chosen by the sentence scorer that selects the kept sentences (sentences-gap: the
# sentences least predictable where they stand, planted facts among them) instead of literals
# (digits and their sentences), on the tune half of the word-answer set: two shards, one core
# each with their own stores, then one merged table.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=research/results/words-083-lift-sentences
DEADLINE=${DEADLINE:-05:50}
lift="--budget 0.083 --option lift=sentences-gap --option lift_share=0.3 --option lift_level=2 --option lift_role=keys"
common=(--tasks realtext-words --split tune --no-default-recipes --per-task --interleave --threads 1
        --recipe "--budget 0.083" --recipe "$lift" --deadline "$DEADLINE")
for i in 0 1; do
  nice -n 5 python bench/quality.py "${common[@]}" --shard $i/2 --store "${STORE:-/tmp/qwordstune}$i" \
    --out $D/shard$i.json > $D/shard$i.txt 2> $D/shard$i.log &
done
wait
python bench/quality.py --merge $D/shard0.json $D/shard1.json --out $D/quality.json > $D/quality.txt
