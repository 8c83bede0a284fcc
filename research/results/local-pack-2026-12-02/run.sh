#!/usr/bin/env bash
# The 0.083 default with packed local-surprisal rows (LOCAL_PACK = 64) against the full cache: the
# word set's report half, then the 130-task acceptance set; two shards, one core each, own stores,
# from a worktree of COMMIT; then one merged table per set.
#   COMMIT=<sha> DEADLINE=HH:MM bash research/results/local-pack-2026-12-02/run.sh
set -euo pipefail
R=$(cd "$(dirname "$0")" && pwd)
MAIN=$(cd "$R/../../.." && pwd)
COMMIT=${COMMIT:?set COMMIT}
WT=/tmp/wt-localpack-$COMMIT
[ -d "$WT" ] || git -C "$MAIN" worktree add -q --detach "$WT" "$COMMIT"
ln -sfn "$MAIN/.venv" "$WT/.venv"
cd "$WT"
common=(--no-default-recipes --recipe "--budget 0.083" --per-task --interleave --threads 1)
[ -n "${DEADLINE:-}" ] && common+=(--deadline "$DEADLINE")
for i in 0 1; do
  (
    PYTHONPATH=$WT .venv/bin/python bench/quality.py "${common[@]}" --tasks realtext-words --split report \
        --shard $i/2 --store /tmp/qlp-words-$i --out "$R/words-shard$i.json" > "$R/words-shard$i.txt" 2> "$R/words-shard$i.log"
    PYTHONPATH=$WT .venv/bin/python bench/quality.py "${common[@]}" --shard $i/2 --store /tmp/qlp-acc-$i \
        --out "$R/acceptance-shard$i.json" > "$R/acceptance-shard$i.txt" 2> "$R/acceptance-shard$i.log"
  ) &
done
wait
cd "$MAIN"
.venv/bin/python bench/quality.py --merge "$R"/words-shard*.json --out "$R/words.json" > "$R/words-merge.txt"
.venv/bin/python bench/quality.py --merge "$R"/acceptance-shard*.json --out "$R/acceptance.json" > "$R/acceptance-merge.txt"
