#!/usr/bin/env bash
# On a lent GPU machine, in the repository root: one part of the first GPU run, each part within one 10-minute
# device command. Every step has its own time limit, cut to what is left of the part's 560 s; a failing step
# does not stop the next. What a part writes is packed into $OUT/<part>.tar.gz, its log also into $OUT/<part>.log.
#
#   bash benchmarks/gpu_session/run.sh checks   # versions, shared GPU checks, the project's *_gpu tests, sanitizer
#   bash benchmarks/gpu_session/run.sh speed    # side by side (suite "acceptance"), estimator vs the GPU
#   bash benchmarks/gpu_session/run.sh curves   # loss curves: plain HF vs memo at offload 0, 0.5 and 1
#
# Prepare with benchmarks/gpu_session/prepare.sh and carry .whl and .gpu_checks.
set -uo pipefail
part=${1:?"usage: run.sh checks|speed|curves"}
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
results="/tmp/gpu_session/$part"
log="$results.log"
mkdir -p "$results"
deadline=$((SECONDS + 560))

step() { # step NAME LIMIT_S COMMAND...: run COMMAND into $results/NAME.txt, at most LIMIT_S (and the deadline)
    local name=$1 limit=$2
    shift 2
    local left=$((deadline - SECONDS))
    if ((left < 15)); then
        echo "=== $name: skipped, no time left" | tee -a "$log"
        return
    fi
    ((limit > left)) && limit=$left
    echo "=== $name (at most $limit s): $*" | tee -a "$log"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$results/$name.txt" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s; last lines:" | tee -a "$log"
    tail -n 15 "$results/$name.txt" | tee -a "$log"
}

case $part in
checks)
    step environment 60 bash -c 'nvidia-smi; python3 -c "
import os, torch, transformers
print(\"device\", torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"transformers\", transformers.__version__)
print(\"PYTORCH_CUDA_ALLOC_CONF\", os.environ.get(\"PYTORCH_CUDA_ALLOC_CONF\"))
for name in (\"flash_attn\", \"liger_kernel\", \"ortools\", \"peft\", \"deepspeed\"):
    try:
        module = __import__(name)
        print(name, getattr(module, \"__version__\", \"present\"))
    except Exception as error:
        print(name, \"missing:\", error)
"'
    step attn_core 90 python3 .gpu_checks/attn_core_check.py cuda
    step e2e 120 python3 .gpu_checks/e2e_check.py cuda
    step review 120 python3 .gpu_checks/review_check.py cuda
    step gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -p no:benchmark tests/*_gpu.py
    step overlap 60 python3 .gpu_checks/overlap_check.py 32768 auto "$results"
    step sanitizer 90 env TORCH_CUDA_SANITIZER=1 python3 .gpu_checks/attn_core_check.py cuda
    ;;
speed)
    step suite 420 python3 -m benchmarks.suite run acceptance --out "$results/suite"
    for seq_len in 16384 32768 65536; do
        step "estimate_vs_cuda_$seq_len" 60 python3 benchmarks/estimate_vs_cuda.py --seq-len "$seq_len" \
            --out "$results/estimate_vs_cuda_$seq_len"
    done
    ;;
curves)
    step loss_curves 540 python3 benchmarks/loss_curves.py --out "$results"
    ;;
*)
    echo "run.sh: unknown part $part (checks, speed or curves)" >&2
    exit 2
    ;;
esac
mkdir -p "$OUT"
cp "$log" "$OUT/$part.log"
tar -czf "$OUT/$part.tar.gz" -C /tmp/gpu_session "$part"
