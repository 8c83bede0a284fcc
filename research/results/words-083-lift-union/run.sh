#!/usr/bin/env bash
# The 0.083 default against two lifts of its keys (and so of the refit's held values): by the
# sentence scorer that selects the kept sentences (sentences-gap), and by the better rank of it and
# literals (digits and their sentences) per token (lift=literals+sentences-gap: the scorer's ranks
# are reused, no extra model pass). Two shards, one core each with their own stores (which already
# hold the contexts, the default and the sentences-gap lift; the 130-task set runs the default and
# the union alone), then one merged table:
#   bash run.sh tune      the word set's tune half      -> tune0/1.json, tune.json
#   bash run.sh report    the word set's report half    -> report0/1.json, report.json
#   bash run.sh realtext  the 130-task set              -> realtext0/1.json, realtext.json
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=research/results/words-083-lift-union
steps="--option lift_share=0.3 --option lift_level=2 --option lift_role=keys"
case "${1:-tune}" in
  tune) set_=(--tasks realtext-words --split tune); store=/tmp/qwordstune ;;
  report) set_=(--tasks realtext-words --split report); store=/tmp/qwords ;;
  realtext) set_=(); store=/tmp/qstore ;;
  *) echo "usage: run.sh tune|report|realtext" >&2; exit 2 ;;
esac
out=$1
gap=(--recipe "--budget 0.083 --option lift=sentences-gap $steps")
[ "$out" = realtext ] && gap=()  # the 130-task set: the default against the union alone
common=("${set_[@]}" --no-default-recipes --per-task --interleave --threads 1
        --recipe "--budget 0.083" "${gap[@]}"
        --recipe "--budget 0.083 --option lift=literals+sentences-gap $steps --label b0.083-lift-union")
[ -n "${DEADLINE:-}" ] && common+=(--deadline "$DEADLINE")
for i in 0 1; do
  nice -n 5 python bench/quality.py "${common[@]}" --shard $i/2 --store "${STORE:-$store}$i" \
    --out $D/$out$i.json > $D/$out$i.txt 2> $D/$out$i.log &
done
wait
python bench/quality.py --merge $D/${out}0.json $D/${out}1.json --out $D/$out.json > $D/$out.txt
