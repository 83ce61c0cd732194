"""`MemoConfig`: every knob of hf_memo in one validated, immutable dataclass."""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass
from typing import Any

from hf_memo.units import parse_bytes

RECOMPUTE_MODES = ("none", "full", "selective", "memo")
PLANNERS = ("off", "greedy", "cpsat", "mip", "gurobi")
MIN_INT_SIZE = 2**20  # an int size below this (other than 0) is a size written without its unit ("64" for 64 GiB)
# Settings only recompute="memo" reads (the planner places the memo executor's own buffers).
_MEMO_ONLY = (
    "host_memory_limit",
    "device_memory_limit",
    "layer_time",
    "host_bandwidth",
    "planner",
    "planner_time_limit",
)
_BARE_NUMBER = re.compile(r"^\s*[0-9]+(?:\.[0-9]+)?\s*$")


class MemoConfigWarning(UserWarning):
    """A :class:`MemoConfig` setting does nothing with the other settings (e.g. a planner without memo)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bad(field: str, accepted: str, value: Any) -> ValueError:
    return ValueError(f"MemoConfig.{field} must be {accepted}, got {value!r}")


def _check_size(field: str, value: Any, example: str) -> None:
    """Raise ``ValueError`` unless ``value`` is ``"auto"``, a string with a unit, 0 or an int of at least 1 MiB."""
    if value == "auto":
        return
    if _is_int(value) and 0 < value < MIN_INT_SIZE:
        raise ValueError(
            f'MemoConfig.{field}={value} is {value} bytes; write "{value}GiB" (ints are byte counts, e.g. '
            f"{value} * 2**30; below 1 MiB they are refused as sizes missing their unit)"
        )
    if isinstance(value, str) and _BARE_NUMBER.match(value) and float(value) != 0:
        number = value.strip()
        raise ValueError(
            f'MemoConfig.{field}="{number}" has no unit: write "{number}GiB" (binary) or "{number}GB" (decimal)'
        )
    accepted = f'"auto", a byte count >= 0 or a size such as "{example}"'
    if not (_is_int(value) or isinstance(value, str)):
        raise _bad(field, accepted, value)
    try:
        parse_bytes(value)
    except ValueError:
        raise _bad(field, accepted, value) from None


@dataclass(frozen=True)
class MemoConfig:
    """Configuration of hf_memo. Every field is validated on construction.

    Attributes:
        mlp_chunks: mini-sequences the MLP runs over, an int >= 1 or ``"auto"`` (about
            ``intermediate_size / hidden_size`` chunks, one chunk for short sequences).
        lm_head_chunks: mini-sequences the LM head + cross-entropy runs over, an int >= 1 or
            ``"auto"`` (about ``vocab_size / hidden_size`` chunks, one for short sequences).
        min_chunk_tokens: ``"auto"`` never makes a chunk shorter than this many tokens, so short
            sequences keep one chunk and full-speed matmuls.
        max_chunk_elements: ``"auto"`` cuts long sequences into enough chunks that one chunk's
            intermediate (``(tokens, I)`` of the MLP, ``(tokens, V)`` logits of the LM head) has at most this
            many elements, however long the sequence (``min_chunk_tokens`` wins if both cannot hold).
        recompute: activation policy of the decoder layers: ``"none"`` (keep everything),
            ``"full"`` (keep each layer's input, recompute the layer), ``"selective"`` (keep matmul
            and attention outputs, recompute the cheap large parts) or ``"memo"`` (token-wise
            recompute and host offload, attention never recomputed).
        offload_fraction: fraction of tokens whose activations ``"memo"`` offloads to host memory
            (the rest is recomputed): a float in [0, 1] or ``"auto"`` (solved from layer time,
            host bandwidth and host memory).
        host_memory_limit: host bytes offloading may use: a size string with its unit such as ``"64GiB"``
            or ``"64GB"``, an int byte count (0, or at least 1 MiB: ``64 * 2**30``; a smaller int is refused as a
            size missing its unit), or ``"auto"`` (a safe fraction of the available RAM).
        device_memory_limit: device bytes a training step may use, for ``"memo"``'s memory policy: a size such
            as ``"70GiB"`` or an int byte count (as for ``host_memory_limit``), or ``"auto"`` (on CUDA, what
            ``torch.cuda.mem_get_info`` reports free plus what PyTorch's allocator holds, at the first step of a
            shape; no limit on CPU).
        layer_time: seconds one decoder layer's forward takes; ``None`` measures it.
        host_bandwidth: device<->host copy bandwidth in bytes/s; ``None`` measures it.
        planner: offline memory planner for buffers hf_memo owns: ``"off"``, ``"greedy"``,
            ``"cpsat"``, ``"mip"`` or ``"gurobi"``.
        planner_time_limit: seconds the planner's solver may take per problem.
        sequence_parallel_size: GPUs one sequence is split over (DeepSpeed-Ulysses); 1 disables. It must
            divide the world size and the model's query heads, and divide or be a multiple of its KV
            heads (checked when applied to a model and when training starts).
        self_check: on the first training step, compare the patched model with the unpatched one on a few rows of
            the step's batch (loss, every layer's output, one vector-Jacobian product) and refuse a model that
            differs beyond rounding (:mod:`hf_memo.patches.self_check`). ``False`` trains without that proof.

    Settings are checked together too. A setting that asks for what the others rule out is an error: an
    ``offload_fraction`` other than ``"auto"`` without ``recompute="memo"`` (nothing is offloaded). A setting
    that changes nothing beside the others gets a :class:`MemoConfigWarning` naming it and why, only when it
    differs from its default: ``host_memory_limit``, ``device_memory_limit``, ``layer_time``,
    ``host_bandwidth``, ``planner`` and ``planner_time_limit`` without ``recompute="memo"`` (the planner places
    the memo executor's buffers only); ``layer_time`` and ``host_bandwidth`` with a fixed ``offload_fraction``;
    ``planner_time_limit`` with ``planner="off"``; ``min_chunk_tokens`` and ``max_chunk_elements`` when neither
    chunk count is ``"auto"``.
    """

    mlp_chunks: int | str = "auto"
    lm_head_chunks: int | str = "auto"
    min_chunk_tokens: int = 1024
    max_chunk_elements: int = 2**26
    recompute: str = "none"
    offload_fraction: float | str = "auto"
    host_memory_limit: int | str = "auto"
    device_memory_limit: int | str = "auto"
    layer_time: float | None = None
    host_bandwidth: float | None = None
    planner: str = "off"
    planner_time_limit: float = 10.0
    sequence_parallel_size: int = 1
    self_check: bool = True

    def __post_init__(self) -> None:
        for name in ("mlp_chunks", "lm_head_chunks"):
            value = getattr(self, name)
            if value != "auto" and not (_is_int(value) and value >= 1):
                raise _bad(name, '"auto" or an int >= 1', value)
        for name in ("min_chunk_tokens", "max_chunk_elements"):
            if not (_is_int(getattr(self, name)) and getattr(self, name) >= 1):
                raise _bad(name, "an int >= 1", getattr(self, name))
        if self.recompute not in RECOMPUTE_MODES:
            raise _bad("recompute", "one of " + ", ".join(f'"{m}"' for m in RECOMPUTE_MODES), self.recompute)
        fraction = self.offload_fraction
        if fraction != "auto" and not (_is_number(fraction) and 0.0 <= fraction <= 1.0):
            raise _bad("offload_fraction", '"auto" or a float in [0, 1]', fraction)
        for name, example in (("host_memory_limit", "64GiB"), ("device_memory_limit", "70GiB")):
            _check_size(name, getattr(self, name), example)
        for name in ("layer_time", "host_bandwidth"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value > 0):
                raise _bad(name, "None or a number > 0", value)
        if self.planner not in PLANNERS:
            raise _bad("planner", "one of " + ", ".join(f'"{p}"' for p in PLANNERS), self.planner)
        if not (_is_number(self.planner_time_limit) and self.planner_time_limit > 0):
            raise _bad("planner_time_limit", "a number of seconds > 0", self.planner_time_limit)
        if not (_is_int(self.sequence_parallel_size) and self.sequence_parallel_size >= 1):
            raise _bad("sequence_parallel_size", "an int >= 1", self.sequence_parallel_size)
        if not isinstance(self.self_check, bool):
            raise _bad("self_check", "True or False", self.self_check)
        self._check_combination()

    def _check_combination(self) -> None:
        """Refuse settings that contradict each other; warn about settings that do nothing (see the class docs)."""
        memo = self.recompute == "memo"
        if not memo and self.offload_fraction != "auto":
            raise ValueError(
                f"MemoConfig.offload_fraction={self.offload_fraction!r} offloads tokens under recompute='memo' only; "
                f"recompute={self.recompute!r} offloads nothing. Set recompute='memo', or leave offload_fraction "
                "at 'auto'"
            )
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        inert = []
        if not memo:
            reason = f"recompute={self.recompute!r} (only recompute='memo' uses it)"
            inert += [(name, reason) for name in _MEMO_ONLY]
        else:
            if self.offload_fraction != "auto":
                reason = f"offload_fraction={self.offload_fraction!r} (only offload_fraction='auto' uses it)"
                inert += [(name, reason) for name in ("layer_time", "host_bandwidth")]
            if self.planner == "off":
                inert.append(("planner_time_limit", "planner='off'"))
        if "auto" not in (self.mlp_chunks, self.lm_head_chunks):
            reason = "fixed mlp_chunks and lm_head_chunks (only 'auto' chunk counts use it)"
            inert += [(name, reason) for name in ("min_chunk_tokens", "max_chunk_elements")]
        settings = [
            f"MemoConfig.{name}={getattr(self, name)!r} does nothing with {reason}"
            for name, reason in inert
            if getattr(self, name) != defaults[name]
        ]
        if settings:
            warnings.warn(
                "; ".join(settings),
                MemoConfigWarning,
                stacklevel=4,
            )

    @property
    def host_memory_limit_bytes(self) -> int | None:
        """The host limit in bytes, or ``None`` for ``"auto"``."""
        return None if self.host_memory_limit == "auto" else parse_bytes(self.host_memory_limit)

    @property
    def device_memory_limit_bytes(self) -> int | None:
        """The device limit in bytes, or ``None`` for ``"auto"``."""
        return None if self.device_memory_limit == "auto" else parse_bytes(self.device_memory_limit)

    def replace(self, **overrides: Any) -> MemoConfig:
        """A copy with some fields changed (validated). Unknown names raise ``ValueError``."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(
                f"unknown MemoConfig field(s) {', '.join(unknown)}; the fields are {', '.join(sorted(known))}"
            )
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-serialisable dict."""
        return dataclasses.asdict(self)
