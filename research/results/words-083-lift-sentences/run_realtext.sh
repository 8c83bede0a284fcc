#!/usr/bin/env bash
# The whole 130-task set (60 digit needles, 40 multi-fact, 30 continuations): the 0.083 default
# against the lift by sentences-gap, two shards, one core each, stores that already hold the contexts.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=research/results/words-083-lift-sentences
DEADLINE=${DEADLINE:-06:02}
lift="--budget 0.083 --option lift=sentences-gap --option lift_share=0.3 --option lift_level=2 --option lift_role=keys"
common=(--no-default-recipes --per-task --interleave --threads 1
        --recipe "--budget 0.083" --recipe "$lift" --deadline "$DEADLINE")
for i in 0 1; do
  nice -n 5 python bench/quality.py "${common[@]}" --shard $i/2 --store "${STORE:-/tmp/qstore}$i" \
    --out $D/realtext$i.json > $D/realtext$i.txt 2> $D/realtext$i.log &
done
wait
python bench/quality.py --merge $D/realtext0.json $D/realtext1.json --out $D/realtext.json > $D/realtext.txt
