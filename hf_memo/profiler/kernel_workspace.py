"""What the CUDA attention kernels allocate and free inside one call, for a fake profile that runs the CPU kernel.

The fake-tensor profile runs PyTorch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and
its ``_backward``): hf_memo's attention core calls it on the CPU, and so does Transformers' sdpa attention. Its
outputs have the shapes the CUDA kernels' outputs have, but the CUDA kernels also allocate workspace inside the
call and free it before they return, which no op's outputs show. This module models that workspace from the
kernels' sources, as a function of the call's shapes and dtype, so that
:class:`~hf_memo.profiler.allocations.AllocationRecorder` can record it next to the CPU op's outputs.

Kernels (``KERNELS``), read at the sources (2026-11-25):

* ``"flash-attn"``: the flash-attn 2 package (Dao-AILab/flash-attention ``csrc/flash_attn/flash_api.cpp``,
  ``mha_fwd`` / ``mha_bwd``, the same from v2.7.0 to v2.8.3, the range hf_memo's ``gpu`` extra pins);
* ``"cuda-flash"``: PyTorch's vendored copy of it (pytorch ``aten/src/ATen/native/transformers/cuda/
  flash_attn/flash_api.cpp`` ``mha_fwd`` / ``mha_bwd``, called by ``_flash_attention_backward`` in
  ``aten/src/ATen/native/transformers/cuda/attention_backward.cu``);
* ``"cuda-efficient"``: PyTorch's memory-efficient kernel (``_efficient_attention_backward`` in
  ``attention_backward.cu``, ``mem_eff_attention/kernel_backward.h``, the kernel lists of
  ``mem_eff_attention/kernels/cutlassB.h`` / ``cutlassF.h`` for compute capability 8.0 to 9.x);
* ``"cpu"``: the kernel the profile runs: nothing to add.

Findings. Forward: the flash kernels allocate nothing beyond their outputs (``out``, ``softmax_lse`` and a few
bytes of RNG state), except when one call has too few query blocks to fill the GPU: then ``mha_fwd`` splits the
keys and keeps fp32 partial outputs for the call (:func:`flash_forward_splits`; for Llama-3-8B's 32 heads only
calls of 129 to 320 queries, never at training lengths). The memory-efficient forward keeps an fp32 copy of its
output only for head sizes over 128 (half precision). Backward: the flash kernels allocate an fp32 dQ
accumulator, ``softmax_d`` and, for grouped-query attention, dK/dV expanded to every query head; the
memory-efficient kernel an fp32 dQ accumulator (per tile), ``delta`` and, for head sizes over 128, dK/dV
accumulators. For Llama-3-8B (32 heads, 8 KV heads, head size 128, bf16) a flash backward holds 32,896 bytes
per token (``S_q = S_k``), about 4 hidden states (1.004 GiB at 32K tokens).

Not modelled: the deterministic flash backward (``torch.use_deterministic_algorithms``: one dQ accumulator per
split), the caching allocator's 512-byte rounding, the CUDA kernels' extra outputs of a few bytes (RNG seed and
offset), the memory-efficient forward's ``logsumexp`` padded to 32 queries, and the copies an attention mask
brings (a masked call is assumed to run the memory-efficient kernel).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

KERNELS = ("flash-attn", "cuda-flash", "cuda-efficient", "cpu")
HALF = (torch.float16, torch.bfloat16)
H100_SMS = 132  # streaming multiprocessors of an H100 SXM / H200 (compute capability 9.0)
FLASH_HEAD_DIMS = range(8, 257, 8)  # head sizes the CUDA flash kernels take without padding


def flash_eligible(dtype: torch.dtype, head_dim: int, capability: tuple[int, int] | None) -> bool:
    """Whether the CUDA flash kernels (flash-attn 2, PyTorch's copy) take attention in ``dtype`` with head size
    ``head_dim`` on a GPU of compute ``capability`` (they need fp16/bf16 and 8.0 or newer); the runtime's rule."""
    return (
        dtype in (torch.float16, torch.bfloat16)
        and head_dim in FLASH_HEAD_DIMS
        and capability is not None
        and capability >= (8, 0)
    )


@torch.compiler.disable
@functools.cache
def cpu_flash_takes_grouped_kv() -> bool:
    """Whether this PyTorch's CPU flash kernel takes K/V with fewer heads than the queries (``h_kv < h``).

    Asked of the kernel, not of the version: one small float64 call of its forward and backward on 4 query heads and
    2 KV heads, against the same calls on K/V expanded to every query head (dK/dV summed back per group). Any error,
    shape or value that differs is a no. Run once per process, outside any fake-tensor or other dispatch mode (a
    fake profile or an allocation recorder may be active at the first call), then cached.
    """
    with _disable_current_modes(), torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        q, grad_out = (torch.randn(1, 4, 5, 8, dtype=torch.float64, generator=gen) for _ in range(2))
        k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64, generator=gen) for _ in range(2))
        k_full, v_full = (t.repeat_interleave(2, dim=1) for t in (k, v))
        try:
            out, lse = _FORWARD(q, k, v, 0.0, True, scale=0.3)
            dq, dk, dv = _BACKWARD(grad_out, q, k, v, out, lse, 0.0, True, scale=0.3)
        except (RuntimeError, ValueError, NotImplementedError):
            return False
        out_full, lse_full = _FORWARD(q, k_full, v_full, 0.0, True, scale=0.3)
        dq_full, dk_full, dv_full = _BACKWARD(grad_out, q, k_full, v_full, out_full, lse_full, 0.0, True, scale=0.3)
        grouped = (out, lse, dq, dk, dv)
        expected = (
            out_full,
            lse_full,
            dq_full,
            dk_full.unflatten(1, (2, 2)).sum(2),
            dv_full.unflatten(1, (2, 2)).sum(2),
        )
        return all(
            a.shape == b.shape and torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(grouped, expected)
        )


def needs_kv_expansion(backend: str) -> bool:
    """Whether ``backend`` needs K/V expanded to the query heads (it does not take ``h_kv < h`` natively); for the
    CPU flash kernel, what :func:`cpu_flash_takes_grouped_kv` finds."""
    if backend == "cpu-flash":
        return not cpu_flash_takes_grouped_kv()
    return backend == "cuda-efficient"


FLASH_ATTN = "Dao-AILab/flash-attention csrc/flash_attn/flash_api.cpp"
TORCH_FLASH = "pytorch aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp"
TORCH_ATTENTION = "pytorch aten/src/ATen/native/transformers/cuda/attention_backward.cu"
TORCH_MEM_EFF = "pytorch aten/src/ATen/native/transformers/cuda/mem_eff_attention"
CORE = "hf_memo/runtime/attention_core.py"
_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@dataclass(frozen=True)
class Buffer:
    """One tensor a kernel allocates inside a call and frees before the call returns.

    Attributes:
        name: the variable's name in the source (``"dq_accum"``).
        shape: its shape, e.g. ``(B, round128(S_q), h, round32(D))``.
        source: the file and function that allocates it.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Workspace:
    """What one kernel call allocates and frees inside itself, beyond its outputs, in call order.

    ``events`` are ``("malloc" | "free", buffer)`` pairs, all after the call's outputs exist (the kernels
    allocate their outputs first); a buffer with no ``free`` event dies when the call returns.
    """

    kernel: str
    events: tuple[tuple[str, Buffer], ...] = ()

    @property
    def buffers(self) -> list[Buffer]:
        return [buffer for op, buffer in self.events if op == "malloc"]

    @property
    def nbytes(self) -> int:
        """All the bytes the call allocates, freed or not before it ends."""
        return sum(buffer.nbytes for buffer in self.buffers)

    @property
    def peak_bytes(self) -> int:
        """The most workspace bytes alive at once during the call (on top of its outputs)."""
        live = peak = 0
        for op, buffer in self.events:
            live += buffer.nbytes if op == "malloc" else -buffer.nbytes
            peak = max(peak, live)
        return peak


@dataclass(frozen=True)
class AttentionCall:
    """The shapes of one attention call as the kernels see them.

    ``q`` is ``(B, h, S_q, D)``, ``k`` ``(B, h_kv, S_k, D)``, ``v`` ``(B, h_kv, S_k, D_v)``; the ``*_bshd``
    flags say whether the backward's ``grad_out`` / ``out`` ``(B, h, S_q, D_v)`` are views of contiguous
    ``(B, S_q, h, D_v)`` memory (the layout the CUDA kernels read; PyTorch copies them otherwise).
    """

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    dropout_p: float = 0.0
    grad_out_bshd: bool = True
    out_bshd: bool = True

    @classmethod
    def of(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout_p: float = 0.0,
        grad_out: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> AttentionCall:
        """The call on ``q, k, v`` (shapes above), with the backward's ``grad_out`` and ``out`` if any."""
        batch, heads, q_len, head_dim = q.shape
        return cls(
            batch,
            heads,
            k.shape[1],
            q_len,
            k.shape[2],
            head_dim,
            v.shape[-1],
            q.dtype,
            dropout_p,
            grad_out is None or _bshd(grad_out),
            out is None or _bshd(out),
        )


def _bshd(x: torch.Tensor) -> bool:
    """Whether ``x`` ``(B, h, S, D)`` is a view of contiguous ``(B, S, h, D)`` memory."""
    return x.transpose(1, 2).is_contiguous()


def _round(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _flash_head_rounded(head_dim: int) -> int:
    """``head_size_rounded`` of ``mha_fwd`` / ``mha_bwd``: a multiple of 32 up to 128, of 64 above."""
    return _round(head_dim, 32 if head_dim <= 128 else 64)


# -- flash (flash-attn 2 and PyTorch's vendored copy) -------------------------------------------------------------


def _num_splits_heuristic(blocks: int, sms: int, n_blocks: int, max_splits: int) -> int:
    """``num_splits_heuristic`` of ``flash_api.cpp``: the fewest key splits within 85% of the best SM occupancy."""
    if blocks >= np.float32(0.8) * sms:
        return 1
    efficiency: dict[int, np.float32] = {}  # of the eligible split counts (each changes the blocks per split)
    for splits in range(1, min(max_splits, sms, n_blocks) + 1):
        if splits == 1 or -(-n_blocks // splits) != -(-n_blocks // (splits - 1)):
            waves = np.float32(blocks * splits) / np.float32(sms)
            efficiency[splits] = waves / np.ceil(waves)
    best = max(efficiency.values())
    return next(splits for splits, value in efficiency.items() if float(value) >= 0.85 * float(best))


def flash_forward_splits(call: AttentionCall, sms: int = H100_SMS) -> int:
    """The number of key splits ``mha_fwd`` runs ``call`` with (``set_params_splitkv``; 1: no split).

    ``num_splits_heuristic(B * h * ceil(S_q / 64), 2 * SMs, ceil(S_k / block_n), 128)`` with ``block_n`` 256, 128
    or 64 for head sizes up to 64, 128 or above; no split with dropout.
    """
    if call.dropout_p > 0:
        return 1
    block_n = 256 if call.head_dim <= 64 else 128 if call.head_dim <= 128 else 64
    blocks = call.batch * call.heads * -(-call.q_len // 64)
    return _num_splits_heuristic(blocks, 2 * sms, -(-call.kv_len // block_n), 128)


def flash_forward(call: AttentionCall, source: str = FLASH_ATTN, sms: int = H100_SMS) -> tuple[Buffer, ...]:
    """The flash forward's workspace: the split-key partial results when ``mha_fwd`` splits the keys.

    ``mha_fwd`` -> ``set_params_splitkv``: with ``n = flash_forward_splits(call) > 1``,
    ``softmax_lse_accum`` ``(n, B, h, S_q)`` and ``out_accum`` ``(n, B, h, S_q, round32(D))``, both fp32, kept
    until ``mha_fwd`` returns; nothing otherwise (``out``, ``softmax_lse`` and ``rng_state`` are outputs, ``p``
    is empty without ``return_softmax``).
    """
    splits = flash_forward_splits(call, sms)
    if splits == 1:
        return ()
    shape = (splits, call.batch, call.heads, call.q_len)
    where = f"{source} mha_fwd/set_params_splitkv"
    return (
        Buffer("softmax_lse_accum", shape, torch.float32, where),
        Buffer("out_accum", (*shape, _flash_head_rounded(call.head_dim)), torch.float32, where),
    )


def flash_backward(call: AttentionCall, source: str = FLASH_ATTN) -> tuple[Buffer, ...]:
    """``mha_bwd``'s workspace (non-deterministic): every buffer lives until it returns.

    * ``softmax_d`` ``(B, h, round128(S_q))`` fp32, returned and dropped by the caller (flash-attn's
      ``_flash_attn_backward`` returns it, hf_memo ignores it; PyTorch's ``_flash_attention_backward`` drops
      ``dSoftmax``);
    * ``dq_accum`` ``(B, round128(S_q), h, round32(D))`` fp32 (``round64`` above 128): twice dQ's bytes in bf16;
    * with ``h_kv < h``: ``dk_expanded``, ``dv_expanded`` ``(B, S_k, h, D)`` in the input dtype, summed into
      ``dk``, ``dv`` over each group of query heads (``at::sum_out``) before ``mha_bwd`` returns.
    """
    where = f"{source} mha_bwd"
    q_rounded = _round(call.q_len, 128)
    buffers = [
        Buffer("softmax_d", (call.batch, call.heads, q_rounded), torch.float32, where),
        Buffer(
            "dq_accum",
            (call.batch, q_rounded, call.heads, _flash_head_rounded(call.head_dim)),
            torch.float32,
            where,
        ),
    ]
    if call.kv_heads != call.heads:
        expanded = (call.batch, call.kv_len, call.heads, call.head_dim)
        buffers += [Buffer(name, expanded, call.dtype, where) for name in ("dk_expanded", "dv_expanded")]
    return tuple(buffers)


def torch_flash_backward_copies(call: AttentionCall) -> tuple[Buffer, ...]:
    """``_flash_attention_backward`` (``attention_backward.cu``) makes ``grad_out`` and ``out`` contiguous in
    ``(B, S_q, h, D_v)``: a copy of each that is not (none for the layouts hf_memo and Transformers pass)."""
    shape = (call.batch, call.q_len, call.heads, call.v_head_dim)
    where = f"{TORCH_ATTENTION} _flash_attention_backward"
    flags = (("contiguous_grad_out", call.grad_out_bshd), ("contiguous_out", call.out_bshd))
    return tuple(Buffer(name, shape, call.dtype, where) for name, contiguous in flags if not contiguous)


# -- memory-efficient (PyTorch's cutlass kernels) -----------------------------------------------------------------


@dataclass(frozen=True)
class EfficientKernel:
    """The template parameters of the ``AttentionBackwardKernel`` that ``dispatch_cutlassB`` launches."""

    block_i: int  # kBlockSizeI: queries per block
    block_j: int  # kBlockSizeJ: keys per block
    max_k: int  # kMaxK: the largest head size it takes


# ``cutlassB.h`` ``dispatch_cutlassB_{bf16,f16,f32}_sm80``, used from compute capability 8.0 to 9.x: the first
# kernel whose kMaxK covers the head size (assumed to fit the SM's shared memory, as on 8.0 and 9.0).
_HALF_KERNELS = (EfficientKernel(64, 64, 32), EfficientKernel(64, 64, 64), EfficientKernel(128, 128, 128))
_FLOAT_KERNELS = (EfficientKernel(64, 64, 32), EfficientKernel(64, 64, 64), EfficientKernel(128, 64, 128))
_ANY_HEAD = EfficientKernel(128, 64, 1 << 16)


def efficient_kernel(call: AttentionCall) -> EfficientKernel:
    """The backward kernel ``_efficient_attention_backward`` picks for ``call`` on compute capability 9.0."""
    largest = max(call.head_dim, call.v_head_dim)
    kernels = _HALF_KERNELS if call.dtype in HALF else _FLOAT_KERNELS
    return next((kernel for kernel in kernels if kernel.max_k >= largest), _ANY_HEAD)


def _efficient_split_keys(call: AttentionCall, kernel: EfficientKernel, accumulates_dkdv: bool) -> int:
    """``num_splits_key`` of ``_efficient_attention_backward``'s heuristic (split keys are on from sm70)."""
    splits = -(-call.kv_len // kernel.block_j)
    parallelism = call.batch * call.heads
    if parallelism >= 256 and call.kv_len <= 2 * kernel.block_j:
        splits = 1
    if accumulates_dkdv:
        splits = min(splits, 200 // parallelism)
    return max(splits, 1)


def efficient_backward_workspace_bytes(call: AttentionCall) -> int:
    """``Params::workspace_size()`` (``kernel_backward.h``): ``B * h * align4(gk + gv + gq)`` floats.

    * ``gq = ceil(S_q / I) * ceil(D / J) * (4 + I * J)``: a ``GradQTempStorage`` (lock, counter, padding and an
      ``I x J`` fp32 tile) per block of queries and columns: the fp32 dQ accumulator, padded to the tiles;
    * ``gk = splits * J * align(D, I)``, ``gv`` likewise with ``D_v``, only when dK/dV are not accumulated in
      registers (``kOutputInRF = half && kMaxK <= I``; fp32 kernels write dK/dV directly).
    """
    kernel = efficient_kernel(call)
    half = call.dtype in HALF
    accumulates_dkdv = half and kernel.max_k > kernel.block_i
    splits = _efficient_split_keys(call, kernel, accumulates_dkdv)
    gq = -(-call.q_len // kernel.block_i) * -(-call.head_dim // kernel.block_j) * (4 + kernel.block_i * kernel.block_j)
    gk = splits * kernel.block_j * _round(call.head_dim, kernel.block_i) if accumulates_dkdv else 0
    gv = splits * kernel.block_j * _round(call.v_head_dim, kernel.block_i) if accumulates_dkdv else 0
    return call.batch * call.heads * _round(gk + gv + gq, 4) * 4


def expanded_kv(call: AttentionCall) -> tuple[Buffer, ...]:
    """K and V expanded to every query head for the memory-efficient kernel, which takes ``h_kv == h`` only:
    ``expand_kv`` in ``attention_core.py`` (``attention_forward`` / ``attention_backward``), ``(B, h, S_k, D)``."""
    if call.kv_heads == call.heads or not needs_kv_expansion("cuda-efficient"):
        return ()
    shape = (call.batch, call.heads, call.kv_len)
    where = f"{CORE} expand_kv"
    return (
        Buffer("k_expanded", (*shape, call.head_dim), call.dtype, where),
        Buffer("v_expanded", (*shape, call.v_head_dim), call.dtype, where),
    )


def efficient_forward(call: AttentionCall) -> tuple[Buffer, ...]:
    """The memory-efficient forward's workspace: ``expanded_kv`` and, in ``_efficient_attention_forward``,
    ``output_accum`` ``(B, S_q, h, D_v)`` fp32 when the kernel cannot keep the output in registers
    (``kNeedsOutputAccumulatorBuffer``: ``cutlassF.h``'s sm80 half kernels take head sizes up to 128 in one
    pass; fp32 kernels accumulate in the output itself)."""
    buffers = list(expanded_kv(call))
    if call.dtype in HALF and max(call.head_dim, call.v_head_dim) > 128:
        shape = (call.batch, call.q_len, call.heads, call.v_head_dim)
        buffers.append(Buffer("output_accum", shape, torch.float32, f"{TORCH_MEM_EFF} _efficient_attention_forward"))
    return tuple(buffers)


def efficient_backward(call: AttentionCall) -> tuple[tuple[str, Buffer], ...]:
    """The memory-efficient backward's events (all in ``_efficient_attention_backward`` unless said):

    * ``expanded_kv`` and, for ``h_kv < h``, the kernel's dK/dV ``(B, h, S_k, D)`` before ``reduce_kv`` sums them
      (``attention_core.py`` ``attention_backward``; counted while the reduced dK/dV outputs exist, which is
      ``2 B h_kv S_k D`` elements more than the real peak);
    * ``grad_out`` made contiguous ``(B, S_q, h, D_v)`` if it is not;
    * ``delta`` ``(B, h, S_q)`` fp32; for fp32 inputs computed as ``(grad_out * out).sum(-1)``, whose product
      ``(B, S_q, h, D_v)`` and sum ``(B, S_q, h)`` (fp32) live until the statement ends;
    * ``workspace`` (bytes, :func:`efficient_backward_workspace_bytes`).
    """
    where = f"{TORCH_ATTENTION} _efficient_attention_backward"
    buffers = list(expanded_kv(call))
    if call.kv_heads != call.heads:
        grads = (call.batch, call.heads, call.kv_len)
        buffers += [
            Buffer("dk_expanded", (*grads, call.head_dim), call.dtype, f"{CORE} attention_backward"),
            Buffer("dv_expanded", (*grads, call.v_head_dim), call.dtype, f"{CORE} attention_backward"),
        ]
    rows = (call.batch, call.q_len, call.heads)
    if not call.grad_out_bshd:
        buffers.append(Buffer("grad_out_contiguous", (*rows, call.v_head_dim), call.dtype, where))
    events = [("malloc", buffer) for buffer in buffers]
    delta = Buffer("delta", (call.batch, call.heads, call.q_len), torch.float32, where)
    if call.dtype in HALF:  # kKernelComputesDelta
        events.append(("malloc", delta))
    else:
        transient = (
            Buffer("grad_out_times_out", (*rows, call.v_head_dim), torch.float32, where),
            Buffer("delta_rows", rows, torch.float32, where),
        )
        events += [*(("malloc", b) for b in transient), ("malloc", delta), *(("free", b) for b in transient)]
    workspace = Buffer("workspace", (efficient_backward_workspace_bytes(call),), torch.uint8, where)
    events.append(("malloc", workspace))
    return tuple(events)


# -- targets -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelTarget:
    """The device the profiled step is estimated for, which decides each attention call's kernel.

    Attributes:
        device: ``"cuda"`` or ``"cpu"`` (the profile's own kernel: no workspace).
        capability: the CUDA device's compute capability.
        flash_attn: whether the flash-attn package is importable there (the runtime then prefers it).
        sms: its streaming multiprocessors (the flash forward's key splits depend on them).
        kernel: one of :data:`KERNELS` to use for every call instead of the runtime's choice.
    """

    device: str = "cuda"
    capability: tuple[int, int] = (9, 0)
    flash_attn: bool = True
    sms: int = H100_SMS
    kernel: str | None = None

    def kernel_for(self, call: AttentionCall, masked: bool = False) -> str:
        """The kernel ``call`` runs on this target.

        The runtime's rule (:func:`flash_eligible`, as :func:`~hf_memo.runtime.attention_core.select_backend` uses it)
        with this target's
        flash-attn instead of this machine's; a call with an attention mask (Transformers with padding) runs
        the memory-efficient kernel, as the flash kernels take none.
        """
        if self.kernel is not None:
            return self.kernel
        if self.device == "cpu":
            return "cpu"
        if masked:
            return "cuda-efficient"
        if not flash_eligible(call.dtype, call.head_dim, self.capability):
            return "cuda-efficient"
        return "flash-attn" if self.flash_attn else "cuda-flash"


CUDA = KernelTarget()
"""The estimator's default: an H100/H200 (compute capability 9.0, 132 SMs) with hf_memo's ``gpu`` extra, so
fp16/bf16 attention with head sizes that are multiples of 8 up to 256 runs flash-attn 2. Its workspace is that
of PyTorch's vendored copy (which plain Transformers sdpa runs) in every layout hf_memo and Transformers pass."""
CPU = KernelTarget(device="cpu")
PROFILED_TARGET: ContextVar[KernelTarget | None] = ContextVar("hf_memo_profiled_target", default=None)
"""The CUDA target a fake profile is recording for (set by the recorder whose hook models its workspace), else
``None``: the attention core then stands in a CPU op whose outputs the target's kernel would allocate too."""


def kernel_target(kernels: str | KernelTarget) -> KernelTarget:
    """``"cuda"`` (:data:`CUDA`), ``"cpu"`` (:data:`CPU`), one of :data:`KERNELS` on :data:`CUDA`, or a target."""
    if isinstance(kernels, KernelTarget):
        return kernels
    if kernels == "cuda":
        return CUDA
    if kernels == "cpu":
        return CPU
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be 'cuda', 'cpu' or one of {', '.join(KERNELS)}, got {kernels!r}")
    return KernelTarget(kernel=kernels)


def forward_workspace(kernel: str, call: AttentionCall, sms: int = H100_SMS) -> Workspace:
    """What ``kernel``'s forward allocates and frees inside one call on ``call`` (see the module docstring)."""
    if kernel == "flash-attn":
        buffers = flash_forward(call, FLASH_ATTN, sms)
    elif kernel == "cuda-flash":
        buffers = flash_forward(call, TORCH_FLASH, sms)
    elif kernel == "cuda-efficient":
        buffers = efficient_forward(call)
    else:
        buffers = ()
    return Workspace(kernel, tuple(("malloc", buffer) for buffer in buffers))


def backward_workspace(kernel: str, call: AttentionCall) -> Workspace:
    """What ``kernel``'s backward allocates and frees inside one call on ``call`` (see the module docstring)."""
    if kernel == "flash-attn":
        events = tuple(("malloc", buffer) for buffer in flash_backward(call, FLASH_ATTN))
    elif kernel == "cuda-flash":
        buffers = (*torch_flash_backward_copies(call), *flash_backward(call, TORCH_FLASH))
        events = tuple(("malloc", buffer) for buffer in buffers)
    elif kernel == "cuda-efficient":
        events = efficient_backward(call)
    else:
        events = ()
    return Workspace(kernel, events)


def _bound(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name, defaults filled in."""
    bound = {}
    for position, argument in enumerate(func._schema.arguments):
        if position < len(args) and not argument.kwarg_only:
            bound[argument.name] = args[position]
        else:
            bound[argument.name] = kwargs.get(argument.name, argument.default_value)
    return bound


class AttentionWorkspace:
    """The recorder's hook: the workspace the target's kernel would allocate inside a traced CPU attention op.

    Called with every dispatched op; answers only for ``aten._scaled_dot_product_flash_attention_for_cpu`` and
    its ``_backward``, whose ``query, key, value`` are ``(B, h, S_q, D)``, ``(B, h_kv, S_k, D)``,
    ``(B, h_kv, S_k, D_v)``.
    """

    def __init__(self, target: KernelTarget) -> None:
        self.target = target

    def __call__(self, func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> Workspace | None:
        if func is not _FORWARD and func is not _BACKWARD:
            return None
        bound = _bound(func, args, kwargs)
        backward = func is _BACKWARD
        call = AttentionCall.of(
            bound["query"],
            bound["key"],
            bound["value"],
            bound["dropout_p"],
            bound["grad_out"] if backward else None,
            bound["out"] if backward else None,
        )
        kernel = self.target.kernel_for(call, masked=bound["attn_mask"] is not None)
        return backward_workspace(kernel, call) if backward else forward_workspace(kernel, call, self.target.sms)


def workspace_hook(kernels: str | KernelTarget) -> AttentionWorkspace | None:
    """The recorder hook for ``kernels`` (see :func:`kernel_target`); ``None`` for the CPU: nothing to add."""
    target = kernel_target(kernels)
    return None if (target.kernel or target.device) == "cpu" else AttentionWorkspace(target)
