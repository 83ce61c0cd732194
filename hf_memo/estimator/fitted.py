"""A mode's peak memory at any sequence length from six fresh fake-tensor profiles (four if it chunks nothing).

Profiling a step costs time in proportion to its operations, and mini-sequence chunk counts grow with the
sequence (the LM head of Llama-3-8B runs 64 chunks at 128K tokens, 423 at 883K), so profiling at the length asked
about is slow. The step's memory only depends on the layers ``n``, the tokens ``T`` and the rows of the largest
chunk of the MLP and of the LM head (see :mod:`hf_memo.profiler.closed_form`), so the mode is profiled at two
short lengths and two depths with two chunks each, plus once with three MLP chunks and once with three LM-head
chunks, and the peak at any length follows from the closed form with the chunk rows the runtime's own rule
(:func:`hf_memo.minseq.chunking.resolve_chunks`) gives there. The memo runtime sizes its host and copy buffers
for the longest step of the step's length bucket (:mod:`hf_memo.runtime.buckets`): their bytes are fitted apart
and scaled by how much longer that step is. Every profile builds a fresh model, so a fresh hf_memo runtime and
host pool: no profile depends on another.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from hf_memo.config import MemoConfig
from hf_memo.estimator.setups import AUTO_CHUNKS, Chunks
from hf_memo.minseq.chunking import resolve_chunks
from hf_memo.profiler.closed_form import ClosedForm, Restate, StepSize
from hf_memo.profiler.footprint import Footprint, StepProfiler
from hf_memo.profiler.trace import AllocationEvent, AllocationTrace
from hf_memo.runtime.buckets import stretch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

PROFILE_SEQ_LEN = 24576  # the longer of the two profiled lengths (the shorter is half); capped by learned positions
BASE_CHUNKS = (2, 2)  # chunk counts of the profiles: few (profiles are fast), more than one (the chunked code path)
MORE_CHUNKS = 3  # the two other profiles: 3 MLP chunks, then 3 LM-head chunks (24,576 = 3 x 8,192 rows)


@dataclass(frozen=True)
class ConfigFacts:
    """What a fitted closed form reads of its model's (text) config: the sizes that set chunk rows, attention's
    shapes and the layers. A fit holds these instead of the Transformers config, so a fit read back from the cache
    answers without importing Transformers or the model code; it answers ``get_text_config()`` with itself."""

    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None  # None: hidden_size / num_attention_heads
    mlp_width: int  # the MLP's inner width, as hf_memo's mini-sequence MLP finds it

    @classmethod
    def of(cls, config: PretrainedConfig | ConfigFacts) -> ConfigFacts:
        """The facts of ``config`` (a Transformers config, or facts already)."""
        if isinstance(config, ConfigFacts):
            return config
        from hf_memo.patches.structure import mlp_width

        text = config.get_text_config()
        heads = text.num_attention_heads
        return cls(
            config.model_type,
            text.num_hidden_layers,
            text.hidden_size,
            text.vocab_size,
            heads,
            getattr(text, "num_key_value_heads", None) or heads,
            getattr(text, "head_dim", None),
            mlp_width(text),
        )

    def get_text_config(self) -> ConfigFacts:
        return self


def chunk_rows(
    config: PretrainedConfig | ConfigFacts, chunking: str, batch_size: int, seq_len: int, chunks: Chunks = AUTO_CHUNKS
) -> tuple[int, int]:
    """Tokens in the largest MLP chunk and LM-head chunk of a ``(batch_size, seq_len)`` step, as the runtime cuts.

    ``chunking`` is ``"tokens"`` (the mini-sequence MLP: all ``B * S`` rows) or ``"memo"`` (the memo executor:
    each sequence's ``S`` positions, ``B`` rows per position); the LM head always cuts the ``B * S`` rows.
    """
    text = ConfigFacts.of(config)
    hidden, defaults = text.hidden_size, MemoConfig()
    width = text.mlp_width
    tokens = batch_size * seq_len
    min_tokens, max_elements = defaults.min_chunk_tokens, defaults.max_chunk_elements
    head = resolve_chunks(chunks[1], tokens, text.vocab_size, hidden, min_tokens, max_elements)
    head_rows = math.ceil(tokens / max(1, min(head, tokens)))
    if chunking == "tokens":
        mlp = resolve_chunks(chunks[0], tokens, width, hidden, min_tokens, max_elements)
        return math.ceil(tokens / max(1, min(mlp, tokens))), head_rows
    if chunking != "memo":
        raise ValueError(f"chunking must be 'tokens' or 'memo', got {chunking!r}")
    per_row_min, per_row_max = -(-min_tokens // batch_size), max(1, max_elements // batch_size)
    mlp = resolve_chunks(chunks[0], seq_len, width, hidden, per_row_min, per_row_max)
    return math.ceil(seq_len / max(1, min(mlp, seq_len))) * batch_size, head_rows


ProfilePoint = tuple[int, int, Chunks]  # (layers, seq_len, chunk settings) of one profile


@dataclass(frozen=True)
class ProfilePlan:
    """The profiles a mode's closed form is fitted to: its depths, its two lengths and every profile's point."""

    depths: tuple[int, ...]
    seq_lens: tuple[int, int]
    points: tuple[ProfilePoint, ...]

    @classmethod
    def of(cls, base: StepProfiler, chunking: str | None, max_seq_len: int = 1 << 24) -> ProfilePlan:
        """The plan for the mode ``base`` profiles (its layers and profile depths), chunked by ``chunking``."""
        shallow, deeper = base.profile_layers
        depths = (base.layers,) if base.layers <= deeper else (shallow, deeper)
        longer = min(PROFILE_SEQ_LEN, max_seq_len - max_seq_len % 2)
        points = [(d, s, BASE_CHUNKS) for s in (longer // 2, longer) for d in depths]
        if chunking is not None:
            points += [(depths[0], longer, (MORE_CHUNKS, 2)), (depths[0], longer, (2, MORE_CHUNKS))]
        return cls(depths, (longer // 2, longer), tuple(points))

    def jobs(self, profiler_for: Callable[[Chunks], StepProfiler]) -> list[Callable[[], AllocationTrace]]:
        """One job per point, tracing it with a profiler of the point's chunk settings (a fresh model each)."""
        return [partial(trace_at, profiler_for, point) for point in self.points]


def trace_at(profiler_for: Callable[[Chunks], StepProfiler], point: ProfilePoint) -> AllocationTrace:
    """The profile at ``point`` by a profiler of its chunk settings."""
    layers, seq_len, chunks = point
    return profiler_for(chunks).trace(seq_len, layers)


def sized_for_bucket(event: AllocationEvent) -> bool:
    """Whether a malloc of a memo profile is a buffer the runtime sizes for the longest step of the length bucket
    (:mod:`hf_memo.runtime.buckets`): a host buffer (device buffers are sized by the step's own need)."""
    return event.location == "host"


class FittedFootprint:
    """Peak device and host memory of one mode at any length, from its closed form.

    Args:
        profiler_for: ``profiler_for(chunks)`` -> a :class:`StepProfiler` of the mode with those chunk settings
            (ignored by modes that chunk nothing); its profiles must build a fresh model each (``fresh=True``).
        chunking: the mode's chunk rule (``"tokens"``, ``"memo"``) or ``None`` if it chunks nothing.
        max_seq_len: the longest length the model's positions allow (profiles stay within it).
        traces: the profiles of ``ProfilePlan.of(profiler_for(BASE_CHUNKS), chunking, max_seq_len)``, in its
            points' order, if they were run already (e.g. side by side with other modes'); by default they are run
            here, one after the other.
    """

    def __init__(
        self,
        profiler_for: Callable[[Chunks], StepProfiler],
        chunking: str | None,
        max_seq_len: int = 1 << 24,
        traces: Sequence[AllocationTrace] | None = None,
    ) -> None:
        base = profiler_for(BASE_CHUNKS)
        self.config, self.layers, self.batch_size = ConfigFacts.of(base.config), base.layers, base.batch_size
        self.chunking = chunking
        plan = ProfilePlan.of(base, chunking, max_seq_len)
        self.depths, self.seq_lens = plan.depths, plan.seq_lens
        if traces is None:
            traces = [job() for job in plan.jobs(profiler_for)]
        if len(traces) != len(plan.points):
            raise ValueError(f"the plan has {len(plan.points)} profiles, got {len(traces)} traces")
        self._traces = dict(zip(plan.points, traces))
        samples = [
            (self.size(seq_len, layers, chunks), self._traces[layers, seq_len, chunks])
            for layers, seq_len, chunks in plan.points
        ]
        self.profiles = len(samples)
        bucketed = sized_for_bucket if chunking == "memo" else None
        self._device = ClosedForm(samples, "device", bucketed)
        self._host = ClosedForm(samples, "host", bucketed)
        self.method = (
            f"closed form fitted to {self.profiles} fresh fake-tensor profiles ("
            + (f"{' and '.join(map(str, self.depths))} of {self.layers} layers, " if len(self.depths) > 1 else "")
            + f"{self.seq_lens[0]:,} and {self.seq_lens[1]:,} tokens"
            + (", chunk rows from the runtime's rule" if chunking else "")
            + ")"
        )

    def __getstate__(self) -> dict:
        """The closed form without the profiles it was fitted to (what the on-disk cache keeps: a few kilobytes
        instead of the traces' megabytes); :meth:`trace` then has none to give."""
        state = dict(self.__dict__)
        state["_traces"] = {}
        return state

    def trace(self, layers: int, seq_len: int, chunks: Chunks) -> AllocationTrace:
        """One of the profiles the closed form was fitted to (``KeyError`` for a closed form read from the cache)."""
        return self._traces[(layers, seq_len, chunks)]

    def size(self, seq_len: int, layers: int | None = None, chunks: Chunks = AUTO_CHUNKS) -> StepSize:
        """The closed form's sizes of a step of ``(batch_size, seq_len)`` with ``layers`` (default all)."""
        layers = self.layers if layers is None else layers
        layer_terms = len(self.depths) > 1  # one depth profiled (the whole model): no layer terms to fit
        tokens = self.batch_size * seq_len
        if self.chunking is None:
            return StepSize(layers, tokens, layer_terms=layer_terms)
        mlp_rows, head_rows = chunk_rows(self.config, self.chunking, self.batch_size, seq_len, chunks)
        longer = stretch(seq_len) if self.chunking == "memo" else 1.0
        return StepSize(layers, tokens, mlp_rows, head_rows, layer_terms, longer)

    def footprint(self, seq_len: int, layers: int | None = None, restate: Restate | None = None) -> Footprint:
        """Peak device and host bytes of a step of ``(batch_size, seq_len)`` with ``layers`` (default all); the
        device's moments ``restate``d before the highest is chosen (see :meth:`ClosedForm.peak`)."""
        size = self.size(seq_len, layers)
        layers = self.layers if layers is None else layers
        return Footprint(seq_len, self._device.peak(size, restate), self._host.peak(size), layers, self.method)
