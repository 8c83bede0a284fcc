#!/usr/bin/env bash
# What the 0.083 default's word answers lose to eviction alone, and to the base steps of the lifted
# tokens' values, on the tune half of the word set. Three versions beside the full cache:
#   b0.083              the default (half of the tokens kept, keys of the lifted 30% 4x finer, values refitted)
#   b0.083-lift-both    the same with the lifted tokens' values 4x finer too (lift_role unset: both roles)
#   keep05-fine         the same kept set (the same shared press, scorer and protected tail: `select`
#                       stage) at near-lossless steps: ec with a 0.5 cap on half of the tokens, no
#                       lift, no refit; what eviction alone costs the answers
# Two shards, one core each with their own stores, then one merged table:
#   bash run.sh            -> tune0/1.json, tune.json
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=research/results/words-083-kept-floor
common=(--tasks realtext-words --split tune --no-default-recipes --per-task --interleave --threads 1
        --recipe "--budget 0.083"
        --recipe "--budget 0.083 --option lift=literals+sentences-gap --option lift_share=0.3 --option lift_level=2 --label b0.083-lift-both"
        --recipe "--budget 0.5 --quant ec --keep 0.5 --scorer sentences-gap --option protect=32 --label keep05-fine")
[ -n "${DEADLINE:-}" ] && common+=(--deadline "$DEADLINE")
for i in 0 1; do
  nice -n 5 python bench/quality.py "${common[@]}" --shard $i/2 --store "${STORE:-/tmp/qwordstune}$i" \
    --out $D/tune$i.json > $D/tune$i.txt 2> $D/tune$i.log &
done
wait
python bench/quality.py --merge $D/tune0.json $D/tune1.json --out $D/tune.json > $D/tune.txt
