"""The memo estimate against a direct profile of the policy it chose, at its answer and one length bucket above.

For each single-GPU question, ``hf_memo.estimate`` (memo mode) gives the longest sequence and, there, its policy and
peak device and host bytes. The whole model (every layer) is then profiled on fake tensors, in a fresh process,
with the runtime told to run exactly that policy (``MemoRuntime.assume_policy``), at the answer's length bucket
(must fit) and at the next bucket (must not: the estimate finds no policy there, and the chosen one needs more
than the GPU).

    python benchmarks/policy_exactness.py      # writes benchmarks/results/<date>-cpu/policy_exactness.*
"""

from __future__ import annotations

import argparse
import json
import time

from hf_memo.integrations.estimate import estimate
from hf_memo.runtime.buckets import bucket_length

from common import add_out_option, fresh_process_json, results_folder

GiB = 2**30
QUESTIONS = {
    "80GiB full, 128 GiB host": {"gpu_memory": "80GiB", "host_memory": "128GiB", "trainable": "full"},
    "139GiB LoRA, 128 GiB host": {"gpu_memory": "139GiB", "host_memory": "128GiB", "trainable": "lora"},
}
DIRECT = """
import json, sys, torch
from hf_memo.integrations.setups import memo_with_policy, with_lora
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from hf_memo.profiler.analysis import peak
from hf_memo.profiler.footprint import StepProfiler
from hf_memo.profiler.shapes import builtin_config
trainable, seq_len, layers = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
policy = MemoryPolicy(tuple(LayerPolicy(**layer) for layer in layers))
def prepare(model, session):
    model = with_lora(model, session) if trainable == "lora" else model
    memo_with_policy(policy)(model)
    return model
trace = StepProfiler(builtin_config("llama-3-8b"), prepare, torch.bfloat16, fresh=True).trace(seq_len)
print(json.dumps({"device": peak(trace, "device").total, "host": peak(trace, "host").total}))
"""


def layers_of(summary: str) -> list[dict]:
    """Every layer's policy, bottom first, from a summary such as ``"30 X/host, 2 X+attn/device (alpha 0.25)"``."""
    layers = []
    for part in summary.split(", "):
        count, kind, *alpha = part.replace("(alpha ", "").rstrip(")").split()
        keep, where = kind.split("/")
        layer = {
            "keep_attention": keep == "X+attn",
            "on_host": where == "host",
            "alpha": float(alpha[0]) if alpha else 0.0,
        }
        layers += [layer] * int(count)
    return layers


def direct(trainable: str, seq_len: int, layers: list[dict]) -> dict:
    return fresh_process_json(DIRECT, trainable, str(seq_len), json.dumps(layers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_option(parser)
    args = parser.parse_args()
    rows = []
    for question, kwargs in QUESTIONS.items():
        started = time.perf_counter()
        searched = estimate("llama-3-8b", 65536, modes=["memo"], progress=False, **kwargs).modes["memo"]
        answer = searched.longest_seq_len
        at = estimate("llama-3-8b", answer, modes=["memo"], search=False, progress=False, **kwargs)
        memo = at.modes["memo"]
        layers = layers_of(memo.policy)
        above = bucket_length(bucket_length(answer) + 1)
        past = estimate("llama-3-8b", above, modes=["memo"], search=False, progress=False, **kwargs).modes["memo"]
        fits, next_bucket = (
            direct(kwargs["trainable"], bucket_length(answer), layers),
            direct(kwargs["trainable"], above, layers),
        )
        budget = at.gpu_memory
        rows.append(
            {
                "question": question,
                "answer": answer,
                "policy": memo.policy,
                "estimate_device": memo.footprint.device.total,
                "direct_device": fits["device"],
                "estimate_host": memo.footprint.host.total,
                "direct_host": fits["host"],
                "device_error": memo.footprint.device.total / fits["device"] - 1,
                "host_error": memo.footprint.host.total / max(fits["host"], 1) - 1,
                "direct_fits": fits["device"] <= budget,
                "next_bucket": above,
                "estimate_fits_next": past.fits,
                "direct_device_next": next_bucket["device"],
                "direct_fits_next": next_bucket["device"] <= budget,
                "seconds": time.perf_counter() - started,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    _, folder = results_folder(args.out)
    (folder / "policy_exactness.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "| question | answer | policy | device est. | device direct | error | host est. | host direct | error | "
        "next bucket fits (est. / direct) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['question']} | {r['answer']:,} | {r['policy']} | {r['estimate_device'] / GiB:.2f} GiB | "
            f"{r['direct_device'] / GiB:.2f} GiB | {r['device_error']:+.3%} | {r['estimate_host'] / GiB:.2f} GiB | "
            f"{r['direct_host'] / GiB:.2f} GiB | {r['host_error']:+.3%} | {r['estimate_fits_next']} / "
            f"{r['direct_fits_next']} ({r['direct_device_next'] / GiB:.2f} GiB at {r['next_bucket']:,}) |"
        )
    (folder / "policy_exactness.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
