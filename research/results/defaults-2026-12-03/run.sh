#!/usr/bin/env bash
# Today's size-budgeted defaults against the full cache on the report half of the word-answer
# set (60 tasks), in one run: two shards with one core each, then one merged table. The 130-task
# rows of the same defaults are ../octave-bins-2026-12-02/ (same code).
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=research/results/defaults-2026-12-03
common=(--tasks realtext-words --split report --no-default-recipes --per-task --interleave --threads 1
        --recipe "--budget 0.25" --recipe "--budget 0.083")
[ -n "${DEADLINE:-}" ] && common+=(--deadline "$DEADLINE")
for i in 0 1; do
  python bench/quality.py "${common[@]}" --shard $i/2 --store "${STORE:-/tmp/qdefw}$i" \
    --out $D/words$i.json > $D/words$i.txt 2> $D/words$i.log &
done
wait
python bench/quality.py --merge $D/words0.json $D/words1.json --out $D/words.json > $D/words.txt
