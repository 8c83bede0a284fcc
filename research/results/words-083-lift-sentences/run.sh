#!/usr/bin/env bash
# The 0.083 default against the same recipe with the precision lift (and so the refit's held
# values) chosen by the sentence scorer that selects the kept sentences (sentences-gap: the
# sentences least predictable where they stand, planted facts among them) instead of literals
# (digits and their sentences). Two shards, one core each with their own stores (which already
# hold the contexts and the default), then one merged table:
#   bash run.sh tune      the word set's tune half      -> shard0/1.json, quality.json
#   bash run.sh report    the word set's report half    -> report0/1.json, report.json
#   bash run.sh realtext  the 130-task set              -> realtext0/1.json, realtext.json
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=research/results/words-083-lift-sentences
lift="--budget 0.083 --option lift=sentences-gap --option lift_share=0.3 --option lift_level=2 --option lift_role=keys"
case "${1:-tune}" in
  tune) set_=(--tasks realtext-words --split tune); store=/tmp/qwordstune; out=shard; merged=quality; at=05:50 ;;
  report) set_=(--tasks realtext-words --split report); store=/tmp/qwords; out=report; merged=report; at=06:50 ;;
  realtext) set_=(); store=/tmp/qstore; out=realtext; merged=realtext; at=06:02 ;;
  *) echo "usage: run.sh tune|report|realtext" >&2; exit 2 ;;
esac
common=("${set_[@]}" --no-default-recipes --per-task --interleave --threads 1
        --recipe "--budget 0.083" --recipe "$lift" --deadline "${DEADLINE:-$at}")
for i in 0 1; do
  nice -n 5 python bench/quality.py "${common[@]}" --shard $i/2 --store "${STORE:-$store}$i" \
    --out $D/$out$i.json > $D/$out$i.txt 2> $D/$out$i.log &
done
wait
python bench/quality.py --merge $D/${out}0.json $D/${out}1.json --out $D/$merged.json > $D/$merged.txt
