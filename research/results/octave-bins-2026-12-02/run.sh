#!/usr/bin/env bash
# The 130-task acceptance set: the size-budgeted defaults with spread bins one octave wide against
# half an octave (research/probes/quality_bins_ab.py), one run in two shards, one core each, then
# one merged table.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=research/results/octave-bins-2026-12-02
common=(--no-default-recipes --per-task --interleave --threads 1
        --recipe "--budget 0.25" --recipe "--budget 0.25 --label b0.25-half"
        --recipe "--budget 0.083" --recipe "--budget 0.083 --label b0.083-half")
[ -n "${DEADLINE:-}" ] && common+=(--deadline "$DEADLINE")
for i in 0 1; do
  python research/probes/quality_bins_ab.py "${common[@]}" --shard $i/2 --store "${STORE:-/tmp/qoct}$i" \
    --out $D/quality$i.json > $D/quality$i.txt 2> $D/quality$i.log &
done
wait
python bench/quality.py --merge $D/quality0.json $D/quality1.json --out $D/quality.json > $D/quality.txt
