"""What an estimate answers and how it is printed: one :class:`ModeEstimate` per mode in an :class:`Estimate`,
its side-by-side table (``hf-memo estimate``) and its JSON record (``--json``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from hf_memo.estimator.cluster import Cluster, GiB
from hf_memo.estimator.model_states import RankStates
from hf_memo.estimator.question import SEARCH_LIMIT
from hf_memo.estimator.setups import Lora
from hf_memo.estimator.time_model import DEFAULT_GPU, GPUS
from hf_memo.profiler.footprint import Footprint
from hf_memo.profiler.trace import AllocationTrace
from hf_memo.units import format_bytes

# Where Estimate.host_memory came from: an argument of estimate(), the command line's flag, or this machine's RAM
# (the command line's default).
HOST_FROM_ARGUMENT, HOST_FROM_FLAG, HOST_FROM_THIS_MACHINE = "the host_memory argument", "--host-memory", "this machine"


@dataclass(frozen=True)
class ModeEstimate:
    """One mode's result: one rank's footprint at the requested length and the longest length that fits."""

    mode: str
    description: str
    footprint: Footprint
    fits: bool
    longest_seq_len: int | None
    longest_is_search_limit: bool = False
    policy: str | None = None  # memo: the memory policy at the requested length (layers per kind, where)
    step_seconds: float | None = None  # a lower bound: FLOPs at the GPU's peak plus exposed copies (None: no fit)
    mfu: float | None = None  # an upper bound: model FLOPs / (step time bound x peak)
    binding: str | None = None  # what stops a longer sequence: "device", "host" or "pinned"

    @property
    def bound_by(self) -> str | None:
        """What stops a longer sequence: ``"search cap"`` when the search stopped before anything else did, else
        :attr:`binding`."""
        return "search cap" if self.longest_is_search_limit else self.binding

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["binding"] = self.bound_by
        record["footprint"]["device"].pop("index")
        record["footprint"]["host"].pop("index")
        return record


@dataclass
class Estimate:
    """Per-mode memory estimates of one training setup (see :func:`estimate`)."""

    model: str
    layers: int
    seq_len: int
    batch_size: int
    dtype: str
    trainable: str
    optimizer: str
    gpu_memory: int
    host_memory: int | None
    modes: dict[str, ModeEstimate]
    gpu: str = DEFAULT_GPU
    cluster: Cluster = field(default_factory=Cluster)
    pinned_memory: int | None = None
    reserve: int = 0  # bytes of each GPU the step may not use
    host_reserve: int = 0  # bytes of each node's host memory the ranks may not use
    states: RankStates | None = None  # one rank's DeepSpeed model states (None without ZeRO)
    host_per_rank: float | None = None  # host bytes one rank may use (its share, less the reserve)
    host_memory_limit: int | None = None  # MemoConfig.host_memory_limit every rank must set
    host_memory_source: str = HOST_FROM_ARGUMENT  # where host_memory came from (HOST_FROM_*)
    lora: Lora | None = None  # what LoRA trains (trainable "lora"), its default targets filled in
    parameters: int = 0  # of the whole trained model (LoRA: base weights, adapters and trainable copies)
    trainable_parameters: int = 0
    search_limit: int = SEARCH_LIMIT  # the longest sequence searched for
    traces: dict[str, AllocationTrace] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        record = {k: v for k, v in asdict(self).items() if k not in ("modes", "traces")}
        record["modes"] = {name: result.to_dict() for name, result in self.modes.items()}
        return record

    def _methods(self) -> list[str]:
        """One "Method:" line, or one per mode when modes were profiled differently."""
        methods = {name: result.footprint.method for name, result in self.modes.items()}
        if len(set(methods.values())) == 1:
            return [f"Method: {next(iter(methods.values()))}."]
        return [f"Method ({name}): {method}." for name, method in methods.items()]

    def table(self) -> str:
        """The side-by-side text table the command line prints."""
        names = list(self.modes)
        per_rank = self.cluster.num_gpus > 1
        rows: list[tuple[str, list[str]]] = []
        for category in ("parameter", "gradient", "optimizer", "activation", "temporary", "buffer"):
            label = {"optimizer": "optimizer state", "temporary": "temporaries"}.get(category, category + "s")
            rows.append(
                (f"  {label}", [format_bytes(self.modes[n].footprint.device.by_category[category]) for n in names])
            )
        rank = " per GPU" if per_rank else ""
        rows.append((f"peak device memory{rank}", [format_bytes(self.modes[n].footprint.device.total) for n in names]))
        rows.append(("  reached in", [self.modes[n].footprint.device.phase for n in names]))
        rows.append((f"peak host memory{rank}", [format_bytes(self.modes[n].footprint.host.total) for n in names]))
        budget = format_bytes(self.gpu_memory) + (
            f" + {format_bytes(self.host_memory)} host" if self.host_memory is not None else ""
        )
        rows.append((f"fits {budget}", ["yes" if self.modes[n].fits else "no" for n in names]))
        if any(self.modes[n].longest_seq_len is not None for n in names):
            rows.append(("longest sequence", [_longest(self.modes[n]) for n in names]))
            rows.append(("  bound by", [self.modes[n].bound_by or "-" for n in names]))
        rows.append(("step time ≥ (bound)", [_seconds(self.modes[n].step_seconds) for n in names]))
        rows.append(
            ("MFU ≤ (bound)", ["-" if self.modes[n].mfu is None else f"{self.modes[n].mfu:.0%}" for n in names])
        )
        label_width = max(len(label) for label, _ in rows) + 2
        width = 2 + max(len(cell) for cell in names + [v for _, values in rows for v in values])
        host = f", host memory {format_bytes(self.host_memory)}" if self.host_memory is not None else ""
        if per_rank and self.host_memory is not None:
            host += f" per node ({self.cluster.ranks_per_node} GPUs)"
        if self.pinned_memory is not None:
            host += f", of which {format_bytes(self.pinned_memory)} may be pinned"
        lines = [
            *self._host_source(),
            f"{self.model}: {self.layers} layers, {self.dtype}, batch {self.batch_size} x {self.seq_len:,} tokens, "
            f"{self._training()}, optimizer {self._optimizer()}",
            f"{self.cluster.describe()}; GPU memory {format_bytes(self.gpu_memory)}{host}",
            *self._memory_lines(),
            *self._methods(),
            "",
            " " * label_width + "".join(n.rjust(width) for n in names),
        ]
        lines += [label.ljust(label_width) + "".join(v.rjust(width) for v in values) for label, values in rows]
        lines.append("")
        lines += [f"{n}: {self.modes[n].description}" for n in names]
        if any(self.modes[n].longest_is_search_limit for n in names):
            lines.append(self._search_cap())
        gpu = GPUS[self.gpu]
        lines.append(
            f"Step time and MFU are bounds, not measurements: FLOPs at the {gpu.name}'s bf16 dense peak "
            f"({gpu.peak_flops / 1e12:.0f} TFLOP/s, assumed) plus host copies at {gpu.host_bandwidth / 1e9:.0f} GB/s "
            "(assumed) that compute cannot hide; no kernel reaches the peak, and communication is not counted. "
            "Left out where the step does not fit."
        )
        if per_rank:
            lines.append(
                "Per GPU: one rank's activations at S / K tokens with its Ulysses all-to-all buffers (memo: profiled "
                "on one rank under a fake process group; other modes: an upper bound added at the peak), its ZeRO "
                "share of parameters, gradients and optimizer state; host memory is the node's, shared by its GPUs."
            )
        lines += [f"memo policy: {self.modes[n].policy}" for n in names if self.modes[n].policy]
        return "\n".join(lines)

    def _host_source(self) -> list[str]:
        """The host memory assumed and where it came from; loud when it is this machine's RAM (the command line's
        default), which need not be the training machine's."""
        if self.host_memory is None:
            return ["Host memory: no limit (host_memory=None): host bytes are shown, none is refused."]
        amount = f"{format_bytes(self.host_memory)} per node"
        if self.host_memory_source != HOST_FROM_THIS_MACHINE:
            return [f"Host memory: {amount}, from {self.host_memory_source}."]
        return [f"WARNING: {line}" for line in this_machine_warning(self.host_memory)]

    def _training(self) -> str:
        """Full fine-tuning or what LoRA trains, and how many parameters are trained."""
        what = "full fine-tuning" if self.trainable == "full" else (self.lora or Lora()).describe()
        if not self.parameters:
            return what
        return f"{what} ({_count(self.trainable_parameters)} of {_count(self.parameters)} parameters trained)"

    def _search_cap(self) -> str:
        """What "≥" and a "search cap" bound mean."""
        why = "the estimator's limit" if self.search_limit >= SEARCH_LIMIT else "the model's learned positions"
        return (
            f"search cap: the search for the longest sequence stops at {self.search_limit:,} tokens ({why}); "
            '"≥ N" reached it, so longer sequences may fit too.'
        )

    def _optimizer(self) -> str:
        """The optimizer and the precision of its states."""
        if self.optimizer != "adamw":
            return "none"
        if self.states is None:
            return "AdamW (fused, states in the parameter dtype)"
        if self.cluster.deepspeed.pure_bf16:
            return "AdamW under DeepSpeed, bf16 master weights, gradients and moments"
        return "AdamW under DeepSpeed's bf16 mixed precision (fp32 master weights, gradients and moments)"

    def _memory_lines(self) -> list[str]:
        """What the budgets leave out (reserves), DeepSpeed's model states, and the host limit memo needs."""
        lines = []
        if self.reserve or self.host_reserve:
            lines.append(
                f"Reserved: {format_bytes(self.reserve)} of each GPU (CUDA context and cuBLAS workspace, NCCL "
                f"buffers, fragmentation) and {format_bytes(self.host_reserve)} of each node's host memory (OS "
                "and processes): the step's budgets are what is left."
            )
        if self.states is not None:
            s = self.states
            lines.append(
                f"DeepSpeed model states per GPU ({self.cluster.deepspeed.describe()}): device "
                f"{format_bytes(s.device(True))} in backward (parameters {format_bytes(s.parameters)}, "
                f"{format_bytes(s.gathered)} of them gathered; gradients {format_bytes(s.gradients)}, "
                f"{format_bytes(s.buckets)} of them reduce buckets; optimizer {format_bytes(s.optimizer)}), "
                f"{format_bytes(s.step_total)} at the optimizer step; host {format_bytes(s.host)} "
                f"({format_bytes(s.host_pinned)} pinned)."
            )
        if self.host_per_rank is not None:
            lines.append(f"Host memory assumed per GPU: {format_bytes(self.host_per_rank)}" + self._host_use())
        return lines

    def _host_use(self) -> str:
        """Who takes the host memory of a rank, and the ``MemoConfig.host_memory_limit`` memo needs."""
        text = "" if self.states is None else f", {format_bytes(self.states.host)} of it DeepSpeed's"
        if "memo" not in self.modes or self.host_memory_limit is None:
            return text + "."
        ranks = self.cluster.ranks_per_node
        default = "half the RAM available when each process starts" + (
            f", which {ranks} ranks of a node would over-commit" if ranks > 1 else ""
        )
        return (
            f"{text}; memo's stashes may take {format_bytes(self.host_memory_limit)}: set "
            f'MemoConfig(host_memory_limit="{self.host_memory_limit // GiB}GiB") in every rank (the default, '
            f'"auto", is {default}).'
        )


def this_machine_warning(host_memory: int) -> list[str]:
    """What to say when the host memory assumed is this machine's RAM (``host_memory`` bytes)."""
    return [
        f"host memory {format_bytes(host_memory)} per node is THIS machine's RAM (no --host-memory given), not "
        "necessarily the training machine's.",
        "memo's stashes and DeepSpeed's offloaded states live there: pass --host-memory with the training node's "
        "memory, e.g. --host-memory 1TiB.",
    ]


def _seconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def _count(n: int) -> str:
    """``8030261248 -> '8.03B'``, ``3407872 -> '3.41M'``."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def _longest(result: ModeEstimate) -> str:
    if result.longest_seq_len is None:
        return "-"
    return ("≥ " if result.longest_is_search_limit else "") + f"{result.longest_seq_len:,}"
