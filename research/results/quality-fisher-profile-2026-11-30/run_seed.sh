#!/usr/bin/env bash
# The estimator's own noise, for scale: the 0.25 default as it was before the profile (each
# document's own Fisher estimate; commit 2f57cb0) with only the seed of the estimate's draw
# changed (seed 1, labelled b0.25s1), on the 130-task acceptance set, in the same stores.
#   DEADLINE=HH:MM bash research/results/quality-fisher-profile-2026-11-30/run_seed.sh
set -euo pipefail
R=$(cd "$(dirname "$0")" && pwd)
MAIN=$(cd "$R/../../.." && pwd)
COMMIT=2f57cb0
DEADLINE=${DEADLINE:?set DEADLINE}
WT=/tmp/wt-quality-$COMMIT
[ -d "$WT" ] || git -C "$MAIN" worktree add -q --detach "$WT" "$COMMIT"
ln -sfn "$MAIN/.venv" "$WT/.venv"
cd "$WT"
common=(--no-default-recipes --recipe "--budget 0.25 --option seed=1 --label b0.25s1" --per-task --interleave --threads 1
        --deadline "$DEADLINE")
for i in 0 1; do
  PYTHONPATH=$WT .venv/bin/python bench/quality.py "${common[@]}" --shard $i/2 --store /tmp/qstore-fg-$i \
      --out "$R/seed1-shard$i.json" > "$R/seed1-shard$i.txt" 2> "$R/seed1-shard$i.log" &
done
wait
cd "$MAIN"
.venv/bin/python bench/quality.py --merge "$R"/seed1-shard*.json --out "$R/seed1.json" > "$R/seed1-merge.txt"
