#!/usr/bin/env bash
# Before the first call to a lent GPU machine, here: the wheels that machine lacks and the independent GPU checks
# from ../shared/gpu_checks (which does not travel), in folders git ignores locally. Each device call then carries
# them: run(command="bash benchmarks/gpu_session/run.sh checks", carry=[".whl", ".gpu_checks"]) (run.sh says more).
#
# The machine is offline with Python 3.12, torch 2.11.0+cu130 and transformers 5.17 (with tokenizers 0.23.2,
# huggingface_hub 1.33, accelerate, safetensors, scipy, pandas, absl-py, pytest). Carried, installed there with
# --no-deps so that its torch stays: OR-Tools (the CP-SAT planner) with immutabledict and the protobuf it pins,
# Liger-Kernel (a contender), and the transformers, tokenizers and PEFT versions installed here, so the GPU runs what
# CI tests (transformers 5.24 needs huggingface_hub >= 1.31 and tokenizers < 0.24, which the machine meets). No torch
# wheel: the machine's own is used. flash-attn has no wheel on PyPI; it is used only if that machine has it.
# The wheels with the working tree must stay within the 64 MiB a call carries: the total is checked at the end.
# .gpu_checks/memo_truth/ (about 16 KiB) holds what run.sh checks' memo_truth step compares the GPU with: the
# fake-tensor predictions of one memo step per policy kind (4 Llama-3-8B layers, 65,536 tokens), profiled here by
# memo_truth.py predict (30 s to 2.5 min a policy kind on 2 shared CPUs, 2 to 10 min in all); kept from an earlier
# run while hf_memo's sources and the torch and Transformers versions are the same.
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude="$(git rev-parse --git-common-dir)/info/exclude"
for path in /.whl/ /.gpu_checks/; do
    grep -qsxF "$path" "$exclude" || echo "$path" >>"$exclude"
done
same_as_here() { python3 -c "import importlib.metadata as m; print('$1==' + m.version('$1'))"; }
kept=$(mktemp -d)
[[ -d .gpu_checks/memo_truth ]] && mv .gpu_checks/memo_truth "$kept/"
rm -rf .whl .gpu_checks
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    "$(same_as_here ortools)" "$(same_as_here immutabledict)" "$(same_as_here protobuf)" \
    "$(same_as_here transformers)" "$(same_as_here tokenizers)" "$(same_as_here peft)" liger-kernel==0.8.5
cp -r ../shared/gpu_checks .gpu_checks
[[ -d $kept/memo_truth ]] && mv "$kept/memo_truth" .gpu_checks/
rm -rf "$kept"
python3 benchmarks/gpu_session/memo_truth.py predict --reuse --out .gpu_checks/memo_truth/predictions.json ||
    echo "prepare.sh: memo_truth predict failed; run.sh's memo_truth step will measure without predictions" >&2
if compgen -G ".whl/torch-*.whl" >/dev/null; then
    echo "prepare.sh: a torch wheel in .whl; the machine's torch must stay" >&2
    exit 1
fi
du -sh .whl .gpu_checks
tree=$({ git ls-files -z; git ls-files -z --others --exclude-standard; } | du -cb --files0-from=- | tail -n 1 | cut -f1)
carried=$(du -cb .whl .gpu_checks | tail -n 1 | cut -f1)
echo "travels: working tree $((tree / 1024)) KiB + carried $((carried / 1024)) KiB = $(((tree + carried) / 1048576)) MiB of 64"
if ((tree + carried > 64 * 1048576)); then
    echo "prepare.sh: more than the 64 MiB a call carries" >&2
    exit 1
fi
