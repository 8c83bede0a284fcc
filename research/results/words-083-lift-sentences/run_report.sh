#!/usr/bin/env bash
# The report half of the word-answer set (60 tasks, unseen by the choice): the 0.083 default against
# the same recipe with its precision lift (and the refit's held values) by sentences-gap,
# two shards, one core each, stores that already hold the contexts and the default.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=research/results/words-083-lift-sentences
DEADLINE=${DEADLINE:-06:50}
lift="--budget 0.083 --option lift=sentences-gap --option lift_share=0.3 --option lift_level=2 --option lift_role=keys"
common=(--tasks realtext-words --split report --no-default-recipes --per-task --interleave --threads 1
        --recipe "--budget 0.083" --recipe "$lift" --deadline "$DEADLINE")
for i in 0 1; do
  nice -n 5 python bench/quality.py "${common[@]}" --shard $i/2 --store "${STORE:-/tmp/qwords}$i" \
    --out $D/report$i.json > $D/report$i.txt 2> $D/report$i.log &
done
wait
python bench/quality.py --merge $D/report0.json $D/report1.json --out $D/report.json > $D/report.txt
