"""Memory timeline plots: bytes alive on the device over one training step, one panel per setup."""

from __future__ import annotations

from pathlib import Path

from hf_memo.profiler.analysis import live_bytes
from hf_memo.profiler.trace import AllocationTrace

GiB = 2**30
_MARKS = (("layer 0 forward", "forward"), ("head", "head + loss"), ("optimizer", "optimizer"))


def _first_index(trace: AllocationTrace, phase: str) -> int | None:
    return next((i for i, e in enumerate(trace.events) if e.phase == phase), None)


def plot_timelines(traces: dict[str, AllocationTrace], path: str | Path, title: str, limit: int | None = None) -> None:
    """Write a PNG with one panel per trace: device GiB alive after each allocation event.

    Args:
        traces: label -> trace of one step (e.g. ``{"vanilla": ..., "minseq": ...}``).
        path: the PNG to write.
        title: figure title.
        limit: bytes drawn as a dashed line (the GPU memory), if given.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 2.6 * len(traces)), sharey=True, squeeze=False)
    for ax, (label, trace) in zip(axes[:, 0], traces.items()):
        # The step starts once what exists before it (weights, optimizer state, inputs) is counted.
        start = next((i for i, e in enumerate(trace.events) if e.phase != "other"), 0)
        curve = [b / GiB for b in live_bytes(trace, "device")][max(start - 1, 0) :]
        steps = range(len(curve))
        ax.plot(steps, curve, linewidth=1.0)
        ax.fill_between(steps, curve, alpha=0.25)
        backward = _first_index(trace, f"layer {int(trace.meta.get('layers', 1)) - 1} backward")
        marks = [(_first_index(trace, p), n) for p, n in _MARKS] + [(backward, "backward")]
        for height, (index, name) in enumerate(sorted((i, n) for i, n in marks if i is not None)):
            x = index - max(start - 1, 0)
            ax.axvline(x, color="grey", linewidth=0.6, linestyle=":")
            ax.text(x, 0.04 + 0.1 * (height % 2), f" {name}", transform=ax.get_xaxis_transform(), fontsize=7)
        if limit is not None:
            ax.axhline(limit / GiB, color="red", linewidth=0.8, linestyle="--", label=f"{limit / GiB:.0f} GiB")
            ax.legend(loc="upper left", fontsize=7)
        ax.set_title(f"{label}: peak {max(curve, default=0):.2f} GiB", fontsize=9)
        ax.set_ylabel("device GiB alive")
    axes[-1, 0].set_xlabel("allocation event of the step (malloc/free requests in order)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
