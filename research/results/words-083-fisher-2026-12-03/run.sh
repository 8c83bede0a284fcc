#!/usr/bin/env bash
# The 0.083 default against two ways of spending its bytes differently, all at the same cap:
#   b0.083-fisher  steps per layer and role scaled by the model's Fisher profile (as the 0.25
#                  default does where every token is kept; the 0.083 default uses even steps)
#   b0.083-kw0.5   a key error counted half as costly as a value error (key_weight=0.5; default 1)
# Two shards, one core each, then one merged table:
#   bash run.sh tune      the word set's tune half (choosing)  -> tune0/1.json, tune.json
#   bash run.sh report    the word set's report half            -> report0/1.json, report.json
#   bash run.sh realtext  the 130-task set                      -> realtext0/1.json, realtext.json
# VARIANTS overrides the recipes after the default (e.g. only the chosen one for report/realtext).
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=research/results/words-083-fisher-2026-12-03
case "${1:-tune}" in
  tune) set_=(--tasks realtext-words --split tune) ;;
  report) set_=(--tasks realtext-words --split report) ;;
  realtext) set_=() ;;
  *) echo "usage: run.sh tune|report|realtext" >&2; exit 2 ;;
esac
out=$1
variants=("--budget 0.083 --option layers=fisher --label b0.083-fisher"
          "--budget 0.083 --option key_weight=0.5 --label b0.083-kw0.5")
[ -n "${VARIANTS:-}" ] && IFS='|' read -r -a variants <<< "$VARIANTS"
common=("${set_[@]}" --no-default-recipes --per-task --interleave --threads 1 --recipe "--budget 0.083")
for v in "${variants[@]}"; do common+=(--recipe "$v"); done
[ -n "${DEADLINE:-}" ] && common+=(--deadline "$DEADLINE")
for i in 0 1; do
  python bench/quality.py "${common[@]}" --shard $i/2 --store "${STORE:-/tmp/qf083$out}$i" \
    --out $D/$out$i.json > $D/$out$i.txt 2> $D/$out$i.log &
done
wait
python bench/quality.py --merge $D/${out}0.json $D/${out}1.json --out $D/$out.json > $D/$out.txt
