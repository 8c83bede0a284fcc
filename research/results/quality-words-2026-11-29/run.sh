#!/usr/bin/env bash
# Today's size-budgeted defaults against the full cache on the report half of the word-answer
# set, one core: 0.25 on every report task first, then 0.083 on as many as fit before DEADLINE
# (same store: the contexts are ingested once; the full cache is evaluated in both passes and
# must agree task for task).
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=research/results/quality-words-2026-11-29
DEADLINE=${DEADLINE:-10:40}
STORE=${STORE:-.bench-quality-words}
common=(--tasks realtext-words --split report --no-default-recipes --per-task --interleave --threads 1 --store "$STORE")
nice -n 10 python bench/quality.py "${common[@]}" --recipe "--budget 0.25" --out $D/budget-0.25.json > $D/budget-0.25.txt 2> $D/budget-0.25.log
nice -n 10 python bench/quality.py "${common[@]}" --recipe "--budget 0.083" --deadline "$DEADLINE" --out $D/budget-0.083.json > $D/budget-0.083.txt 2> $D/budget-0.083.log
