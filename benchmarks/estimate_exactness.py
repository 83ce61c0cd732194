"""The fast estimator against direct fake-tensor profiles of the same setup, each in a fresh process.

For each question and mode: the closed form's peak device and host memory at 16K, 64K, 64K + 1 (just past a
length bucket's boundary, where memo's host buffers are 3.1% longer than the step) and 256K tokens and at the
mode's answer (the longest sequence the estimator finds; one rank's tokens for multi-GPU questions), beside a
direct profile at exactly that length (two depths, extrapolated linearly in layers; the runtime's own chunk
counts) run in a new Python process. Memo is profiled with its smallest MEMO policy (alpha 0), what its closed
form models.

    python benchmarks/estimate_exactness.py          # writes benchmarks/results/<date>-cpu/estimate_exactness.*
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hf_memo.estimator.cluster import Cluster
from hf_memo.estimator.estimate import estimate
from hf_memo.estimator.fitted import FittedFootprint
from hf_memo.estimator.setups import MODES, memo_with_offload, with_lora
from hf_memo.profiler.footprint import StepProfiler
from hf_memo.profiler.shapes import builtin_config

from common import add_out_option, fresh_process_json, results_folder

QUESTIONS = {
    "80GiB full, 128 GiB host": ({"gpu_memory": "80GiB", "host_memory": "128GiB", "trainable": "full"}, Cluster()),
    "139GiB LoRA, 128 GiB host": ({"gpu_memory": "139GiB", "host_memory": "128GiB", "trainable": "lora"}, Cluster()),
    "8 GPUs SP 8 ZeRO-3 offload, 1 TiB host": (
        {"gpu_memory": "80GiB", "host_memory": "1TiB", "trainable": "full"},
        Cluster(8, 8, 3, True),
    ),
}
LENGTHS = (16384, 65536, 65537, 262144)
DIRECT = """
import json, sys, torch
from hf_memo.estimator.setups import MODES, memo_with_offload, with_lora
from hf_memo.profiler.footprint import StepProfiler
from hf_memo.profiler.shapes import builtin_config
mode, trainable, seq_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
configure = memo_with_offload(0.0) if mode == "memo" else (lambda m: MODES[mode].configure(m, None))
def prepare(model, session):
    model = with_lora(model, session) if trainable == "lora" else model
    configure(model)
    return model
profiler = StepProfiler(builtin_config("llama-3-8b"), prepare, torch.bfloat16,
                        profile_layers=MODES[mode].profile_layers, fresh=True)
f = profiler.footprint(seq_len)
print(json.dumps({"device": f.device.total, "host": f.host.total}))
"""


def direct(mode: str, trainable: str, seq_len: int) -> dict:
    return fresh_process_json(DIRECT, mode, trainable, str(seq_len))


def closed_form(mode: str, trainable: str) -> FittedFootprint:
    """The estimator's closed form of ``mode`` (memo: its smallest MEMO policy, alpha 0)."""
    spec = MODES[mode]

    def profiler_for(chunks):
        if mode == "memo":
            configure = memo_with_offload(0.0, chunks)
        elif spec.configure_chunked is not None:
            configure = lambda model: spec.configure_chunked(model, None, chunks)  # noqa: E731
        else:
            configure = lambda model: spec.configure(model, None)  # noqa: E731

        def prepare(model, session):
            model = with_lora(model, session) if trainable == "lora" else model
            configure(model)
            return model

        config = builtin_config("llama-3-8b")
        return StepProfiler(config, prepare, torch.bfloat16, profile_layers=spec.profile_layers, fresh=True)

    return FittedFootprint(profiler_for, spec.chunking)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="hf,hf-checkpointing,full,memo")
    add_out_option(parser)
    args = parser.parse_args()
    _, out = results_folder(args.out)
    modes = args.modes.split(",")
    rows = []
    forms: dict[tuple[str, str], FittedFootprint] = {}
    for question, (ask, cluster) in QUESTIONS.items():
        answer = estimate("llama-3-8b", 32768, modes=modes, cluster=cluster, progress=False, **ask)
        for mode in modes:
            key = (mode, ask["trainable"])
            if key not in forms:
                forms[key] = closed_form(*key)
            longest = answer.modes[mode].longest_seq_len
            rank_answer = cluster.rank_seq_len(longest) if longest else None
            lengths = [rank_answer] if rank_answer else []
            if cluster.num_gpus == 1:
                lengths = list(LENGTHS) + lengths
            for seq_len in lengths:
                fast = forms[key].footprint(seq_len)
                start = time.perf_counter()
                measured = direct(mode, ask["trainable"], seq_len)
                rows.append(
                    {
                        "question": question,
                        "mode": mode,
                        "seq_len": seq_len,
                        "is_answer": seq_len == rank_answer,
                        "answer": longest,
                        "binding": answer.modes[mode].binding,
                        "fast_device": fast.device.total,
                        "direct_device": measured["device"],
                        "fast_host": fast.host.total,
                        "direct_host": measured["host"],
                        "device_error": fast.device.total / measured["device"] - 1,
                        "host_error": (fast.host.total / measured["host"] - 1) if measured["host"] else 0.0,
                        "direct_seconds": time.perf_counter() - start,
                    }
                )
                print(rows[-1], flush=True)
                (out / "estimate_exactness.json").write_text(json.dumps(rows, indent=2))
    lines = [
        "The fast estimator (closed form) against direct fake-tensor profiles in a fresh process, Llama-3-8B, "
        "bf16, batch 1. Multi-GPU: one rank's tokens (S / 8), its single-GPU profile before the ZeRO share. Memo: "
        "its smallest MEMO policy (alpha 0), what its closed form models.",
        "",
        "| question | mode | tokens profiled | fast device | direct device | error | fast host | direct host | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tag = f"{r['seq_len']:,}" + (f" (answer {r['answer']:,}, {r['binding']})" if r["is_answer"] else "")
        lines.append(
            f"| {r['question']} | {r['mode']} | {tag} | {r['fast_device'] / 2**30:.3f} GiB | "
            f"{r['direct_device'] / 2**30:.3f} GiB | {r['device_error']:+.3%} | {r['fast_host'] / 2**30:.3f} GiB | "
            f"{r['direct_host'] / 2**30:.3f} GiB | {r['host_error']:+.3%} |"
        )
    worst = max(abs(r["device_error"]) for r in rows)
    worst_host = max(abs(r["host_error"]) for r in rows)
    lines += ["", f"Largest error: device {worst:.3%}, host {worst_host:.3%}, over {len(rows)} comparisons."]
    (out / "estimate_exactness.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
