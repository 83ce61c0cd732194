"""The memo executor's device working set: bytes beyond the model states and the device stashes, at every moment.

A fake-tensor profile of one training step (4 layers shaped like Llama-3-8B, bf16, AdamW, batch 1) whose runtime
runs a fixed policy: layers 0 and 1 keep their tensors on the host, layers 2 and 3 on the device, every layer
keeping its input only ("X only") or its input and attention output ("X + attention"), alpha 0. At each allocation
event it counts the device bytes beyond

* the model states (parameters, buffers, gradients, optimizer state), and
* the stashes of the device layers, from the end of a layer's forward to the end of its backward (its input, plus
  its attention output and softmax statistics when it keeps attention),

in units ``U`` of one hidden state (``2 * hidden`` bytes per token). The worst moment is reported with the
tensors alive then (the op that made each, its phase, its size in U). Two kernel targets: the CPU (what the runtime
itself allocates) and an H100 with flash-attn (the CUDA kernels' workspace added, modelled by
:mod:`hf_memo.profiler.kernel_workspace`): what the kernels add at the worst moment is the difference of the two,
and the largest workspace the kernels hold at once, anywhere in the step, is reported beside it.

With ``--sequence-parallel K`` the profile is of rank 0 of ``K`` (hf_memo's Ulysses code under a fake process
group), ``--seq-len`` being the rank's positions and U the rank's hidden state.

    python benchmarks/memo_working_set.py                      # 262,144 tokens, writes benchmarks/results/<date>-cpu/
    python benchmarks/memo_working_set.py --sequence-parallel 8   # rank 0 of 8, 262,144 positions per rank
    python benchmarks/memo_working_set.py --tiny --out /tmp/x  # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch

from hf_memo.estimator.setups import memo_with_policy
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from hf_memo.profiler.footprint import StepProfiler
from hf_memo.profiler.shapes import builtin_config
from hf_memo.profiler.trace import AllocationTrace

from common import add_out_option, results_folder, tiny_llama

STATES = ("parameter", "buffer", "gradient", "optimizer")
LAYERS = 4
HOST_LAYERS = 2  # the bottom layers go to the host, the others stay on the device


def policy(keep_attention: bool) -> MemoryPolicy:
    layers = tuple(LayerPolicy(keep_attention, index < HOST_LAYERS, 0.0) for index in range(LAYERS))
    return MemoryPolicy(layers, bound="given")


def stash_bytes(config, seq_len: int, keep_attention: bool) -> int:
    """Bytes a device layer's stash holds: its input, and its attention output and fp32 lse when it keeps them."""
    hidden = config.hidden_size * 2 * seq_len
    if not keep_attention:
        return hidden
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return hidden + config.num_attention_heads * head_dim * 2 * seq_len + config.num_attention_heads * 4 * seq_len


def working_set(trace: AllocationTrace, stash: int, unit: int) -> dict:
    """The worst moment of device bytes beyond the states and the live device stashes, and what is alive then."""
    device_layers = range(HOST_LAYERS, LAYERS)
    forward_done = {i: None for i in device_layers}
    backward_done = {i: None for i in device_layers}
    phases = [event.phase for event in trace.events]
    for i in device_layers:  # a stash is alive from the first event after its forward to the end of its backward
        after_forward = [j for j, p in enumerate(phases) if p == f"layer {i} forward"]
        in_backward = [j for j, p in enumerate(phases) if p == f"layer {i} backward"]
        forward_done[i], backward_done[i] = after_forward[-1] + 1, in_backward[-1]
    live, states, alive, workspace, most_workspace = 0, 0, {}, 0, 0
    worst = {"beyond": -1}
    for index, event in enumerate(trace.events):
        if event.location != "device":
            continue
        sign = 1 if event.op == "malloc" else -1
        live += sign * event.size
        if event.category in STATES:
            states += sign * event.size
        if event.op == "malloc":
            alive[event.tensor_id] = event
        else:
            event = alive.pop(event.tensor_id, event)
        if " workspace " in (event.source or ""):  # what a CUDA kernel allocates inside its call (modelled)
            workspace += sign * event.size
            most_workspace = max(most_workspace, workspace)
        stashes = sum(stash for i in device_layers if forward_done[i] <= index <= backward_done[i])
        beyond = live - states - stashes
        if beyond > worst["beyond"]:
            held = Counter()
            for e in alive.values():
                if e.category not in STATES:
                    held[(e.source or e.name or "?", e.phase)] += e.size
            worst = {
                "beyond": beyond,
                "phase": event.phase,
                "event": index,
                "alive": [
                    {"op": op, "phase": phase, "U": round(size / unit, 3)}
                    for (op, phase), size in held.most_common()
                    if size >= unit / 16
                ],
            }
    worst["beyond_U"] = round(worst.pop("beyond") / unit, 3)
    worst["kernel_workspace_U"] = round(most_workspace / unit, 3)
    return worst


def profile(config, seq_len: int, keep_attention: bool, kernels: str, sequence_parallel: int = 1) -> dict:
    profiler = StepProfiler(
        config,
        lambda model, session: (
            memo_with_policy(policy(keep_attention), sequence_parallel=sequence_parallel)(model),
            model,
        )[1],
        torch.bfloat16,
        optimizer="adamw",
        fresh=True,
        kernels=kernels,
        sequence_parallel=sequence_parallel,
    )
    trace = profiler.trace(seq_len)
    unit = 2 * config.hidden_size * seq_len
    return working_set(trace, stash_bytes(config, seq_len, keep_attention), unit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny Llama, for a smoke run")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens (default 262144; tiny: 2048)")
    parser.add_argument("--sequence-parallel", type=int, default=1, help="profile rank 0 of this many (default 1)")
    add_out_option(parser)
    args = parser.parse_args()
    _, out = results_folder(args.out)
    config = tiny_llama(LAYERS) if args.tiny else builtin_config("llama-3-8b")
    config.num_hidden_layers = LAYERS
    seq_len = args.seq_len or (2048 if args.tiny else 262144)
    rows = {}
    for keep_attention in (False, True):
        name = "X + attention" if keep_attention else "X only"
        rows[name] = {
            kernels: profile(config, seq_len, keep_attention, kernels, args.sequence_parallel)
            for kernels in ("cpu", "cuda")
        }
    sp = args.sequence_parallel
    where = f"rank 0 of {sp} (sequence parallel), {seq_len} positions per rank" if sp > 1 else f"{seq_len} tokens"
    lines = [
        f"# Memo's device working set: {LAYERS} Llama-3-8B-shaped layers (2 on the host, 2 on the device), "
        f"{where}, bf16, AdamW",
        "",
        "U = one hidden state (2 x hidden bytes per token). Beyond the model states and the live device stashes.",
        "",
        "| policy | CPU profile: worst | at | H100 (flash-attn workspace modelled): worst | at | kernels' extra at the "
        "worst | largest kernel workspace |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        cpu, cuda = row["cpu"], row["cuda"]
        extra = round(cuda["beyond_U"] - cpu["beyond_U"], 3)
        lines.append(
            f"| {name} | {cpu['beyond_U']} U | {cpu['phase']} | {cuda['beyond_U']} U | {cuda['phase']} | {extra} U "
            f"| {cuda['kernel_workspace_U']} U |"
        )
    for name, row in rows.items():
        for kernels, worst in row.items():
            lines += ["", f"## {name}, {kernels}: alive at the worst moment ({worst['phase']})", ""]
            lines += [f"- {a['U']} U: {a['op']} ({a['phase']})" for a in worst["alive"]]
    stem = "memo_working_set" if sp == 1 else f"memo_working_set_sp{sp}"
    record = {"seq_len": seq_len, "sequence_parallel": sp, "rows": rows}
    (out / f"{stem}.json").write_text(json.dumps(record, indent=2))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
