#!/usr/bin/env bash
# The 30 continuations of the 130-task set: the 0.083 default against ridge 0.1 on its value
# refit (what the refit is for), two shards, one core each, stores that already hold the contexts.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=research/results/words-083-refit-ridge
DEADLINE=${DEADLINE:-03:53}
ridge="--budget 0.083 --option refit=0.1 --option refit_hold=true --option refit_decoded=true --option refit_feedback=true"
common=(--kinds continuation --no-default-recipes --per-task --interleave --threads 1
        --recipe "--budget 0.083" --recipe "$ridge" --deadline "$DEADLINE")
for i in 0 1; do
  nice -n 5 python bench/quality.py "${common[@]}" --shard $i/2 --store "${STORE:-/tmp/qstore}$i" \
    --out $D/cont$i.json > $D/cont$i.txt 2> $D/cont$i.log &
done
wait
python bench/quality.py --merge $D/cont0.json $D/cont1.json --out $D/continuation.json > $D/continuation.txt
