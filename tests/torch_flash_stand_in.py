"""PyTorch's CUDA flash ops computed on CPU tensors, so the code paths that call them run without a GPU.

:class:`TorchFlashOnCpu` answers ``aten._flash_attention_forward`` / ``_flash_attention_backward`` (dense
``(B, S, h, D)`` or packed ``(total, h, D)`` with ``cum_seq_q``) with written-out math under the kernel's
documented contract: causal, query ``i`` sees keys ``i - window_size_left <= j <= i + window_size_right``
(``None``: unbounded), ``h_kv <= h`` heads, ``lse`` ``(B, h, S)`` or ``(h, total)``, and a backward that recomputes
the probabilities from the ``logsumexp`` it is given and ``D = rowsum(dO * out)`` from the ``out`` it is given
(what the sinks' composition relies on). No dropout. It records every call's bound arguments.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

FORWARD = torch.ops.aten._flash_attention_forward.default
BACKWARD = torch.ops.aten._flash_attention_backward.default


def _bound(func, args, kwargs):
    return {
        a.name: args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name, a.default_value)
        for i, a in enumerate(func._schema.arguments)
    }


def _sequences(call, *tensors):
    """Per sequence: ``(rows, [t[rows] (s, h, D) for t in tensors])``; rows index the batch or the packed tokens."""
    cu = call["cum_seq_q"]
    if cu is None:
        return [((b,), [t[b] for t in tensors]) for b in range(tensors[0].shape[0])]
    bounds = cu.tolist()
    return [((slice(a, b),), [t[a:b] for t in tensors]) for a, b in zip(bounds, bounds[1:])]


def _probs(call, q, k, lse=None):
    """``(h, s, s_k)`` probabilities (from ``lse`` when given) and scores' scale, for one sequence (s, h, D)."""
    assert call["is_causal"] and call["dropout_p"] == 0
    groups = q.shape[1] // k.shape[1]
    scores = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(groups, 1)) * call["scale"]
    i, j = torch.arange(q.shape[0])[:, None], torch.arange(k.shape[0])
    left, right = call["window_size_left"], call["window_size_right"]
    visible = (j <= i) & (j >= i - (left if left is not None and left >= 0 else q.shape[0]))
    if right is not None and right >= 0:
        visible &= j <= i + right
    scores = scores.masked_fill(~visible, -torch.inf)
    if lse is None:
        lse = torch.logsumexp(scores, -1)
    return torch.exp(scores - lse[..., None]), lse


class TorchFlashOnCpu(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in (FORWARD, BACKWARD):
            return func(*args, **(kwargs or {}))
        call = _bound(func, args, kwargs or {})
        self.calls.append((func, call))
        return self._forward(call) if func is FORWARD else self._backward(call)

    @staticmethod
    def _forward(call):
        q, k, v = call["query"], call["key"], call["value"]
        out = torch.empty_like(q)
        packed = call["cum_seq_q"] is not None
        lse = q.new_empty((q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1]))
        for rows, (qs, ks, vs) in _sequences(call, q, k, v):
            probs, seq_lse = _probs(call, qs, ks)
            out[rows] = torch.einsum("hij,jhd->ihd", probs, vs.repeat_interleave(q.shape[-2] // k.shape[-2], 1))
            if packed:
                lse[:, rows[0]] = seq_lse
            else:
                lse[rows] = seq_lse
        return out, lse, torch.zeros(2, dtype=torch.int64), torch.empty(0), torch.empty(0)

    @staticmethod
    def _backward(call):
        q, k, v, out, grad = call["query"], call["key"], call["value"], call["out"], call["grad_out"]
        lse, packed = call["logsumexp"], call["cum_seq_q"] is not None
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        groups = q.shape[-2] // k.shape[-2]
        for rows, (qs, ks, vs, os, gs) in _sequences(call, q, k, v, out, grad):
            probs, _ = _probs(call, qs, ks, lse[:, rows[0]] if packed else lse[rows])
            d_probs = torch.einsum("ihd,jhd->hij", gs, vs.repeat_interleave(groups, 1))
            d_scores = probs * (d_probs - (gs * os).sum(-1).T[..., None]) * call["scale"]
            dq[rows] = torch.einsum("hij,jhd->ihd", d_scores, ks.repeat_interleave(groups, 1))
            per_head_k = torch.einsum("hij,ihd->jhd", d_scores, qs)
            per_head_v = torch.einsum("hij,ihd->jhd", probs, gs)
            dk[rows] = per_head_k.unflatten(1, (-1, groups)).sum(2)
            dv[rows] = per_head_v.unflatten(1, (-1, groups)).sum(2)
        return dq, dk, dv
