#!/usr/bin/env bash
# The 0.25 default with its layer split from the model's Fisher profile (measured once per store,
# on its first four documents by id) against the full cache: the 130-task acceptance set and the
# report half of the word-answer set, two shards each (one core per shard), from a worktree of
# COMMIT. The stores are the previous run's (quality-fit-guess-2026-11-30), every context already
# ingested, so the profile is measured on the shard's documents as `kdnctl run` would; the new
# versions are labelled b0.25p beside that run's b0.25.
#   COMMIT=<sha> DEADLINE=HH:MM bash research/results/quality-fisher-profile-2026-11-30/run.sh
set -euo pipefail
R=$(cd "$(dirname "$0")" && pwd)
MAIN=$(cd "$R/../../.." && pwd)
COMMIT=${COMMIT:?set COMMIT}
DEADLINE=${DEADLINE:?set DEADLINE}
WT=/tmp/wt-quality-$COMMIT
[ -d "$WT" ] || git -C "$MAIN" worktree add -q --detach "$WT" "$COMMIT"
ln -sfn "$MAIN/.venv" "$WT/.venv"
cd "$WT"
common=(--no-default-recipes --recipe "--budget 0.25 --label b0.25p" --per-task --interleave --threads 1 --deadline "$DEADLINE")
for i in 0 1; do
  (
    PYTHONPATH=$WT .venv/bin/python bench/quality.py "${common[@]}" --shard $i/2 --store /tmp/qstore-fg-$i \
        --out "$R/acceptance-shard$i.json" > "$R/acceptance-shard$i.txt" 2> "$R/acceptance-shard$i.log"
    PYTHONPATH=$WT .venv/bin/python bench/quality.py "${common[@]}" --tasks realtext-words --split report --shard $i/2 \
        --store /tmp/qstore-fgw-$i --out "$R/words-shard$i.json" > "$R/words-shard$i.txt" 2> "$R/words-shard$i.log"
  ) &
done
wait
cd "$MAIN"
.venv/bin/python bench/quality.py --merge "$R"/acceptance-shard*.json --out "$R/acceptance.json" > "$R/acceptance-merge.txt"
.venv/bin/python bench/quality.py --merge "$R"/words-shard*.json --out "$R/words.json" > "$R/words-merge.txt"
