"""Side-by-side GPU benchmark suite: hf_memo against Hugging Face, Liger-Kernel and DeepSpeed's tiled ops.

    python -m benchmarks.suite list                          # suites, workloads, contenders and availability
    python -m benchmarks.suite run h200                      # run (or resume) a named suite on the GPU
    python -m benchmarks.suite run h200 --dry-run            # every contender at tiny size on CPU
    python -m benchmarks.suite report benchmarks/results/<date>-<gpu>   # redraw the table and plots

Every configuration (workload, contender, sequence length) runs in its own subprocess
(:mod:`benchmarks.suite.worker`) with a timeout; its row is appended to ``<suite>.json`` as soon as
it ends, so an interrupted suite resumes where it stopped. On a machine lent for short sessions,
give every call the same ``--out`` folder and a ``--budget`` in seconds: a call stops between
configurations when its budget runs out, and the next call picks up from the recorded rows.
"""
