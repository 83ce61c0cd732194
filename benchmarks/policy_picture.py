"""Kept memory over one training step per mode, device and host: the picture in the README's "Memory policy".

Llama-3-8B LoRA, bf16, batch 1, one H100-like 139 GiB GPU with 128 GiB host memory, at one sequence
length. Per mode, the bytes kept for backward as the step goes (forward through the layers, then
backward in reverse), on top of what the profile shows is always there (parameters, optimizer state,
workspace): mini-sequence + checkpointing keeps each layer's input on the device; memo keeps what its
solved policy says, where it says. A model of the step from the profiles, not a recorded trace.

    python benchmarks/policy_picture.py                        # writes benchmarks/results/<date>-cpu/
    python benchmarks/policy_picture.py --tiny --out /tmp/x    # seconds-long smoke run on a tiny Llama
"""

from __future__ import annotations

import argparse

import torch

from hf_memo.estimator.fitted import FittedFootprint
from hf_memo.estimator.memo_policy import MemoModel
from hf_memo.estimator.question import Budget
from hf_memo.estimator.setups import MODES, memo_with_offload, memo_with_policy, with_lora
from hf_memo.estimator.time_model import DEFAULT_GPU, gpu_of
from hf_memo.profiler.footprint import StepProfiler
from hf_memo.profiler.shapes import builtin_config

from common import add_out_option, results_folder, tiny_llama

GiB = 2**30


def curves(per_layer_device: list[float], per_layer_host: list[float], base: float, buffers: float):
    """Device and host GiB after each layer's forward (bottom up) and backward (top down)."""
    device, host, dev_curve, host_curve = base, 0.0, [], []
    for d, h in zip(per_layer_device, per_layer_host):
        device, host = device + d, host + h
        dev_curve.append(device + (buffers if host else 0.0))
        host_curve.append(host)
    for d, h in reversed(list(zip(per_layer_device, per_layer_host))):
        dev_curve.append(device + (buffers if host else 0.0))
        host_curve.append(host)
        device, host = device - d, host - h
    return [v / GiB for v in dev_curve], [v / GiB for v in host_curve]


def _profiler(config, configure, mode: str) -> StepProfiler:
    def prepare(model, session):
        model = with_lora(model, session)
        configure(model)
        return model

    return StepProfiler(config, prepare, torch.bfloat16, profile_layers=MODES[mode].profile_layers, fresh=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny Llama, for a smoke run")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens (default 262144; tiny: 4096)")
    add_out_option(parser)
    args = parser.parse_args()
    _, out = results_folder(args.out)
    config = tiny_llama(6) if args.tiny else builtin_config("llama-3-8b")
    unit = 2**20 if args.tiny else GiB
    gpu_bytes, host_bytes = 139 * unit, 128 * unit
    seq_len = args.seq_len or (4096 if args.tiny else 262144)
    minseq = FittedFootprint(
        lambda chunks: _profiler(config, lambda m: MODES["minseq"].configure_chunked(m, None, chunks), "minseq"),
        "tokens",
    )
    memo = MemoModel(
        lambda fraction, chunks: _profiler(config, memo_with_offload(fraction, chunks), "memo"),
        1,
        gpu_of(DEFAULT_GPU),
        policy_profiler_for=lambda policy, chunks: _profiler(config, memo_with_policy(policy, chunks), "memo"),
    )
    choice = memo.choose(seq_len, Budget(gpu_bytes, host_bytes))
    profile = memo.profile(seq_len)
    n, costs = memo.layers, profile.costs
    minseq_peak = minseq.footprint(seq_len).device.total
    minseq_kept = [costs.input_bytes] * n
    minseq_base = minseq_peak - sum(minseq_kept)
    stashes = [costs.stash_bytes(layer.keep_attention, layer.alpha) for layer in choice.policy.layers]
    on_host = [layer.on_host for layer in choice.policy.layers]
    buffers = 2 * max((s for s, h in zip(stashes, on_host) if h), default=0.0)
    panels = {
        "minseq + checkpointing": curves(minseq_kept, [0.0] * n, minseq_base, 0.0),
        f"memo: {choice.policy.summary()}": curves(
            [0.0 if h else s for s, h in zip(stashes, on_host)],
            [s if h else 0.0 for s, h in zip(stashes, on_host)],
            profile.base_bytes,
            buffers,
        ),
    }
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.0 * len(panels)), sharey=True)
    steps = list(range(2 * n))
    for ax, (label, (device, host)) in zip(axes, panels.items()):
        ax.plot(steps, device, label="device", color="tab:blue")
        ax.plot(steps, host, label="host", color="tab:orange")
        ax.axhline(gpu_bytes / GiB, color="tab:blue", linestyle="--", linewidth=0.8, label="GPU memory")
        ax.axhline(host_bytes / GiB, color="tab:orange", linestyle="--", linewidth=0.8, label="host memory")
        ax.axvline(n - 0.5, color="grey", linestyle=":", linewidth=0.8)
        ax.set_title(f"{label}  (peak device {max(device):.1f} GiB, host {max(host):.1f} GiB)", fontsize=9)
        ax.set_ylabel("GiB")
        ax.legend(loc="upper left", fontsize=7)
    axes[-1].set_xlabel(f"after each layer's forward (0..{n - 1}), then each layer's backward ({n - 1}..0)")
    fig.suptitle(
        f"Llama-3-8B LoRA, {seq_len:,} tokens: memory kept over one step (139 GiB GPU, 128 GiB host)", fontsize=10
    )
    fig.tight_layout()
    path = out / "policy_memory.png"
    fig.savefig(path, dpi=110)
    print(path, choice.policy.summary())


if __name__ == "__main__":
    main()
