#!/bin/bash
# One same-start A/B of the whole test suite: both halves start together on this machine (same
# load), each logs every test phase's duration as it finishes (bench/suite_timing.py).
#   A = an older tree run the pre-#11 way: every CLI test in its own process (KDNCTL_TEST_CLI=subprocess);
#   B = a tree run as it is (in-process CLI, its own conftest settings).
# usage: bench/suite_ab.sh A_TREE B_TREE OUT_DIR   (then: python bench/suite_ab_cmp.py OUT/timing-A.jsonl OUT/timing-B.jsonl)
# Long and CPU-heavy: both halves run under nice -n 10. pytest's temp dirs go to OUT/pt-*.
set -u
A=$(realpath "$1"); B=$(realpath "$2"); OUT=$(realpath -m "$3")
BENCH=$(dirname "$(realpath "$0")")
mkdir -p "$OUT"
export TRITON_INTERPRET=1
run() {  # name tree extra-env
  rm -f "$OUT/timing-$1.jsonl"; rm -rf "$OUT/pt-$1"
  cd "$2" && env PYTHONPATH="$2:$BENCH" SUITE_TIMING_OUT="$OUT/timing-$1.jsonl" $3 \
    /usr/bin/time -f "$1 wall %e s user %U s sys %S s" nice -n 10 \
    python -m pytest -q -ra -p no:cacheprovider -p suite_timing --basetemp="$OUT/pt-$1" > "$OUT/suite-$1.txt" 2>&1
}
echo "start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) A=$(git -C "$A" log --oneline -1) B=$(git -C "$B" log --oneline -1)"
run A "$A" KDNCTL_TEST_CLI=subprocess &
run B "$B" KDNCTL_NOOP=1 &
wait
echo "end $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
for h in A B; do tail -n 2 "$OUT/suite-$h.txt"; done
python "$BENCH/suite_ab_cmp.py" "$OUT/timing-A.jsonl" "$OUT/timing-B.jsonl"
