#!/usr/bin/env bash
# The first GPU run, in two device calls (a task has 15 minutes of device time, the machine's start included), on the
# machine's own stack (Python 3.12, torch 2.11.0+cu130) with the wheels prepare.sh put in .whl:
#
#   run(command="bash benchmarks/gpu_session/run.sh checks", carry=[".whl", ".gpu_checks"], timeout_s=540)
#       call 1, at most 8 min with its install: versions, ../shared/gpu_checks (e2e and review as they are there;
#       attn_core and overlap from this folder, ported to today's runtime API: the shared ones fail at once),
#       tests/*_gpu.py, overlap, sanitizer, then memo_truth (its last 120 s are kept for it: the steps before stop
#       by budget - 120): one memo step of 4 Llama-3-8B layers at 65,536 tokens per policy kind against the
#       predictions prepare.sh profiled here (.gpu_checks/memo_truth/), and the GQA flash backward's workspace
#   run(command="bash benchmarks/gpu_session/run.sh truth", carry=[".whl", ".gpu_checks"], timeout_s=420)
#       call 2, at most 6 min: memory truth (the fake-tensor estimate beside max_memory_allocated, 4 Llama-3-8B
#       layers at 32K) and speed (suite "acceptance", side by side at 32K). The estimator's own prediction needs no
#       GPU (over a minute of fake tensors on 2 CPUs): run it here, not on device time:
#       python -m hf_memo estimate --model llama-3-8b --gpu-memory 139GiB --host-memory 128GiB --json
#   give_back() right after the last call.
#
# Every step has its own time limit, cut to what is left of the part's budget (counted from the script's start, so
# the install is in it: checks 450 s, truth 330 s; GPU_SESSION_BUDGET_S overrides); a failing step does not stop the
# next. What a part writes lands in /tmp/gpu_session/<date>-h200/<part>/ and is packed into $OUT/<part>.tar.gz, its
# log also into $OUT/<part>.log. Here, after the call, unpack into benchmarks/results/<date>-h200/<part>/ with
#
#   bash benchmarks/gpu_session/run.sh unpack FILES_AT     # FILES_AT: the folder the run tool's reply names
#
# --dry-run (here, on the CPU, from a venv like the machine's): the same install into a temporary folder, the steps
# on the CPU where they can run there, the GPU-only steps skipped with their reason, results in
# /tmp/gpu_session/<date>-h200-dry-run/ and $OUT (default /tmp/gpu_session_out).
#
#   bash benchmarks/gpu_session/run.sh checks --dry-run
#   bash benchmarks/gpu_session/run.sh truth --dry-run
#
# curves (loss curves, plain HF vs memo at offload 0, 0.5, 1) is not in the 15-minute plan: it needs `datasets`, which
# the machine lacks and prepare.sh does not carry.
set -uo pipefail
SECONDS=0
part=${1:?"usage: run.sh checks|truth|curves [--dry-run], or run.sh unpack FILES_AT"}
cd "$(dirname "$0")/../.."

if [[ $part == unpack ]]; then # here, after a call: the packed results into benchmarks/results/
    from=${2:?"usage: run.sh unpack FILES_AT"}
    for archive in "$from"/*.tar.gz; do
        tar -xzf "$archive" -C benchmarks/results && echo "unpacked $archive into benchmarks/results/"
    done
    exit 0
fi

dry_run=0
[[ ${2:-} == --dry-run ]] && dry_run=1
case $part in
checks) budget=${GPU_SESSION_BUDGET_S:-450} ;;
truth) budget=${GPU_SESSION_BUDGET_S:-330} ;;
curves) budget=${GPU_SESSION_BUDGET_S:-560} ;;
*)
    echo "run.sh: unknown part $part (checks, truth, curves or unpack)" >&2
    exit 2
    ;;
esac
stamp="$(date +%F)-h200"
site=/tmp/site
if ((dry_run)); then
    stamp+=-dry-run
    site=/tmp/gpu_session_site
    OUT=${OUT:-/tmp/gpu_session_out}
fi
: "${OUT:?"OUT is not set: run.sh runs on the device machine, or here with --dry-run"}"
results="/tmp/gpu_session/$stamp/$part"
log="$results.log"
rm -rf "$results" "$log"
mkdir -p "$results" "$OUT"

pack() { # whatever happened: the log and the results back through $OUT
    cp "$log" "$OUT/$part.log"
    tar -czf "$OUT/$part.tar.gz" -C /tmp/gpu_session "$stamp/$part" "$stamp/$part.log"
    echo "=== packed $OUT/$part.tar.gz ($(du -h "$OUT/$part.tar.gz" | cut -f1)) after $SECONDS s"
}
trap pack EXIT

# The carried wheels, without their dependencies (the machine has them) and never torch: the machine's own stays.
if compgen -G ".whl/torch-*.whl" >/dev/null; then
    echo "=== .whl holds a torch wheel: the machine's torch must stay; rerun prepare.sh" | tee -a "$log"
    exit 1
fi
rm -rf "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    >"$results/install.txt" 2>&1
rc=$?
echo "=== install of $(ls .whl | wc -l) wheels into $site: exit $rc after $SECONDS s" | tee -a "$log"
tail -n 5 "$results/install.txt" | tee -a "$log"
((rc == 0)) || exit 1
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    dev=cuda
elif ((dry_run)); then
    dev=cpu
else
    echo "=== no CUDA GPU: run.sh measures a GPU; --dry-run exercises it on the CPU" | tee -a "$log"
    exit 3
fi
echo "=== $part on $dev, budget $budget s from the start, results in $results" | tee -a "$log"
deadline=$budget
kept=0 # seconds at the end of the budget kept for later steps (the steps before them stop by deadline - kept)

step() { # step NAME LIMIT_S COMMAND...: run COMMAND into $results/NAME.txt, at most LIMIT_S (and the deadline)
    local name=$1 limit=$2
    shift 2
    local left=$((deadline - kept - SECONDS))
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

gpu_step() { # gpu_step NAME LIMIT_S COMMAND...: a step that means nothing without a GPU, skipped in a dry run
    if [[ $dev != cuda ]]; then
        echo "=== $1: skipped, needs a CUDA GPU" | tee -a "$log"
        return
    fi
    step "$@"
}

case $part in
checks)
    kept=120 # memo_truth's
    step environment 45 bash -c 'nvidia-smi || echo "no nvidia-smi"; python3 -c "
import importlib.metadata as m, os, sys, torch
print(\"python\", sys.version.split()[0], sys.executable)
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"cudnn\", torch.backends.cudnn.version())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(\"device\", p.name, p.total_memory, \"sm\", p.multi_processor_count, \"cc\", torch.cuda.get_device_capability())
for name in (\"PYTORCH_CUDA_ALLOC_CONF\", \"PYTORCH_ALLOC_CONF\", \"CUDA_VISIBLE_DEVICES\"):
    print(name, os.environ.get(name))
for name in (\"transformers\", \"tokenizers\", \"huggingface_hub\", \"accelerate\", \"safetensors\", \"peft\", \"ortools\",
             \"protobuf\", \"immutabledict\", \"liger_kernel\", \"flash_attn\", \"triton\", \"numpy\", \"scipy\", \"pytest\",
             \"deepspeed\"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, \"missing\")
import hf_memo, transformers, ortools, liger_kernel
print(\"hf_memo\", hf_memo.__version__, hf_memo.__file__, \"transformers imported\", transformers.__version__)
"'
    step attn_core 60 python3 benchmarks/gpu_session/attn_core_check.py "$dev"
    step e2e 90 python3 .gpu_checks/e2e_check.py "$dev"
    step gpu_tests 120 python3 -m pytest -q -p no:cacheprovider -p no:benchmark -rs tests/*_gpu.py
    step review 90 python3 .gpu_checks/review_check.py "$dev"
    gpu_step overlap 45 python3 benchmarks/gpu_session/overlap_check.py 32768 auto "$results"
    gpu_step sanitizer 60 env TORCH_CUDA_SANITIZER=1 python3 benchmarks/gpu_session/attn_core_check.py cuda
    kept=0
    truth_limit=$((deadline - SECONDS < 120 ? deadline - SECONDS : 120)) # what step will give it
    if [[ $dev == cuda ]]; then # no new policy starts within 15 s of its limit; its JSON is written as it goes
        step memo_truth 120 python3 benchmarks/gpu_session/memo_truth.py measure --workspace-first \
            --predictions .gpu_checks/memo_truth/predictions.json --out "$results/memo_truth" \
            --time-limit $((truth_limit - 5)) --reserve-s 15
    else
        step memo_truth 120 python3 benchmarks/gpu_session/memo_truth.py measure --dry-run --steps 1 \
            --out "$results/memo_truth" --time-limit $((truth_limit - 5)) --reserve-s 15
    fi
    ;;
truth)
    gpu_step estimate_vs_cuda_32768 90 python3 benchmarks/estimate_vs_cuda.py --seq-len 32768 \
        --out "$results/estimate_vs_cuda_32768"
    if [[ $dev == cuda ]]; then
        step suite 150 python3 -m benchmarks.suite run acceptance --seq-len 32768 --time-limit 60 \
            --out "$results/suite"
    else
        step suite 150 python3 -m benchmarks.suite run acceptance --dry-run --out "$results/suite"
    fi
    ;;
curves)
    if [[ $dev == cuda ]]; then
        step loss_curves 540 python3 benchmarks/loss_curves.py --out "$results"
    else
        step loss_curves 120 python3 benchmarks/loss_curves.py --tiny --out "$results"
    fi
    ;;
esac
