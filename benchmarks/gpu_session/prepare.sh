#!/usr/bin/env bash
# Before the first call to a lent GPU machine, here: the wheels that machine lacks and the independent GPU checks
# from ../shared/gpu_checks (which does not travel), in folders git ignores locally. Each device call then carries
# them: run(command="bash benchmarks/gpu_session/run.sh checks", carry=[".whl", ".gpu_checks"]).
#
# The machine is offline with Python 3.12 and its own torch. Carried: OR-Tools (the CP-SAT planner) with the
# protobuf it pins, Liger-Kernel (a contender), and the transformers, tokenizers and PEFT versions installed here,
# so the GPU runs what CI tests. flash-attn has no wheel on PyPI; it is used only if that machine has it.
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude="$(git rev-parse --git-common-dir)/info/exclude"
for path in /.whl/ /.gpu_checks/; do
    grep -qsxF "$path" "$exclude" || echo "$path" >>"$exclude"
done
same_as_here() { python3 -c "import importlib.metadata as m; print('$1==' + m.version('$1'))"; }
rm -rf .whl .gpu_checks
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    "$(same_as_here ortools)" "$(same_as_here immutabledict)" "$(same_as_here protobuf)" \
    "$(same_as_here transformers)" "$(same_as_here tokenizers)" "$(same_as_here peft)" liger-kernel==0.8.5
cp -r ../shared/gpu_checks .gpu_checks
du -sh .whl .gpu_checks
