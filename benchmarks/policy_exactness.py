"""The memo estimate against a direct profile of the policy it chose, at its answer and one length bucket above.

For each question the README documents (the command line's own flags and defaults: reserves, pinnable host
memory), ``hf_memo.estimate`` (memo mode) gives the longest sequence and, there, its policy and one rank's peak
device and host bytes. The whole model (every layer) is then profiled on fake tensors, in a fresh process, with the
runtime told to run exactly that policy (``MemoRuntime.assume_policy``), with the CUDA kernels' workspace, at the
answer's length bucket (must fit) and at the next bucket (must not). With sequence parallelism the profile is rank
0's of the real Ulysses code under a fake process group of ``K`` ranks (its all-to-all buffers included); with
ZeRO, the profile's parameter, gradient and optimizer bytes are replaced by DeepSpeed's
(:func:`~hf_memo.estimator.cluster.rank_peak`, no all-to-all added: it is in the profile).

    python benchmarks/policy_exactness.py                 # writes benchmarks/results/<date>-cpu/policy_exactness.*
    python benchmarks/policy_exactness.py --only "8 GPUs"  # reruns the questions whose name starts so; keeps the rest
"""

from __future__ import annotations

import argparse
import json
import time

from hf_memo.estimator.estimate import estimate
from hf_memo.integrations.cli import build_parser
from hf_memo.integrations.estimate import cluster_of, memory_of
from hf_memo.runtime.buckets import bucket_length

from common import add_out_option, fresh_process_json, results_folder

GiB = 2**30
QUESTIONS = {
    "80 GiB, full, 128 GiB host": "--gpu-memory 80GiB --host-memory 128GiB",
    "139 GiB, LoRA, 128 GiB host": "--gpu-memory 139GiB --host-memory 128GiB --trainable lora",
    "1 GPU, ZeRO-2, optimizer offload, 1 TiB host": (
        "--gpu-memory 80GiB --host-memory 1TiB --zero 2 --offload-optimizer"
    ),
    "8 GPUs, SP 8, ZeRO-3, optimizer offload, 1 TiB host": (
        "--gpu-memory 80GiB --host-memory 1TiB --num-gpus 8 --sequence-parallel 8 --zero 3 --offload-optimizer"
    ),
}
DIRECT = """
import json, sys, torch
from hf_memo.estimator.cluster import Cluster
from hf_memo.estimator.model_states import model_states, rank_peak, rank_state_bytes
from hf_memo.estimator.setups import memo_with_policy, with_lora
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from hf_memo.profiler.analysis import peak
from hf_memo.profiler.footprint import StepProfiler
from hf_memo.profiler.shapes import builtin_config
trainable, rank_len, layers, cluster = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
cluster = Cluster(**cluster)
policy = MemoryPolicy(tuple(LayerPolicy(**layer) for layer in layers))
sp = cluster.sequence_parallel
def prepare(model, session):
    model = with_lora(model, session) if trainable == "lora" else model
    memo_with_policy(policy, sequence_parallel=sp)(model)
    return model
config = builtin_config("llama-3-8b")
trace = StepProfiler(config, prepare, torch.bfloat16, fresh=True, sequence_parallel=sp).trace(rank_len)
states = model_states(config, torch.bfloat16, trainable, "adamw", cluster)
device = peak(trace, "device", restate=lambda values: rank_state_bytes(values, states, cluster))
host = peak(trace, "host").total
device, state_host = rank_peak(device, states, cluster, restated=True)
print(json.dumps({"device": device.total, "host": host + state_host}))
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


def question(flags: str) -> tuple[dict, dict]:
    """``estimate``'s keyword arguments for a command line's flags (its defaults filled in), and its cluster as a
    dict for the direct profile's process."""
    args = build_parser("estimate").parse_args(["estimate", "--model", "llama-3-8b", *flags.split()])
    cluster = cluster_of(args)
    kwargs = {"cluster": cluster, "trainable": args.trainable, **memory_of(args, cluster)}
    fields = ("num_gpus", "sequence_parallel", "zero", "offload_optimizer", "gpus_per_node")
    return kwargs, {name: getattr(cluster, name) for name in fields}


def direct(trainable: str, rank_len: int, layers: list[dict], cluster: dict) -> dict:
    """One rank's direct profile at ``rank_len`` positions (of ``K`` times as many), in a fresh process."""
    return fresh_process_json(DIRECT, trainable, str(rank_len), json.dumps(layers), json.dumps(cluster))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="rerun only the questions whose name starts with this")
    add_out_option(parser)
    args = parser.parse_args()
    _, folder = results_folder(args.out)
    path = folder / "policy_exactness.json"
    kept = json.loads(path.read_text()) if args.only and path.exists() else []
    kept = {row["question"]: row for row in kept if row["question"] in QUESTIONS}
    for name, flags in QUESTIONS.items():
        if not name.startswith(args.only):
            continue
        started = time.perf_counter()
        kwargs, cluster = question(flags)
        k = cluster["sequence_parallel"]

        def memo_at(seq_len: int, search: bool = False, kwargs: dict = kwargs):
            return estimate("llama-3-8b", seq_len, modes=["memo"], search=search, progress=False, **kwargs)

        answer = memo_at(65536, search=True).modes["memo"].longest_seq_len
        at = memo_at(answer)
        memo = at.modes["memo"]
        layers = layers_of(memo.policy)
        rank_bucket = bucket_length(-(-answer // k))  # the runtime sizes a step for its bucket's longest length
        fits_len, above = k * rank_bucket, k * bucket_length(rank_bucket + 1)
        past = memo_at(above).modes["memo"]
        fits = direct(kwargs["trainable"], rank_bucket, layers, cluster)
        next_bucket = direct(kwargs["trainable"], above // k, layers, cluster)
        device_budget = at.gpu_memory - at.reserve
        kept[name] = {
            "question": name,
            "command": f"hf-memo estimate --model llama-3-8b {flags}",
            "answer": answer,
            "profiled_at": fits_len,
            "policy": memo.policy,
            "device_budget": device_budget,
            "host_budget_per_rank": at.host_per_rank,
            "estimate_device": memo.footprint.device.total,
            "direct_device": fits["device"],
            "estimate_host": memo.footprint.host.total,
            "direct_host": fits["host"],
            "device_error": memo.footprint.device.total / fits["device"] - 1,
            "host_error": memo.footprint.host.total / max(fits["host"], 1) - 1,
            "direct_fits": fits["device"] <= device_budget,
            "next_bucket": above,
            "estimate_fits_next": past.fits,
            "direct_device_next": next_bucket["device"],
            "direct_fits_next": next_bucket["device"] <= device_budget,
            "seconds": time.perf_counter() - started,
        }
        print(json.dumps(kept[name]), flush=True)
    rows = [kept[name] for name in QUESTIONS if name in kept]
    path.write_text(json.dumps(rows, indent=1) + "\n")
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
    lines += ["", "Device budget: the GPU's memory less the command line's reserve. Commands:", ""]
    lines += [f"- {r['question']}: `{r['command']}`" for r in rows]
    (folder / "policy_exactness.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
