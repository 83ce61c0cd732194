"""The ``flash-attn`` package as a backend of the attention core: a cached try-import and its two calls.

hf_memo calls flash-attn's ``_flash_attn_forward`` / ``_flash_attn_backward``, whose signatures are the
same in every release from 2.7.0 to 2.8.3 (read in the package's source):

* ``_flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
  softcap, alibi_slopes, return_softmax) -> (out, softmax_lse, S_dmask, rng_state)``
* ``_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
  window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state)``, writing
  ``dq, dk, dv`` in place.

2.6 took one ``window_size`` pair and returned eight values, so :data:`SUPPORTED` is the range the
``gpu`` extra pins. Arguments are passed by name, so a release whose signature differs fails loudly
instead of binding values to the wrong parameters. Tensors are ``(B, S, h, D)`` with a unit last
stride; ``k, v`` may have fewer heads than ``q`` (grouped-query attention is native).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from types import ModuleType

import torch
from packaging.version import InvalidVersion, Version

SUPPORTED = (Version("2.7.0"), Version("2.9.0"))  # [low, high): the `gpu` extra's flash-attn pin


@functools.cache
def flash_attn_interface() -> ModuleType | None:
    """``flash_attn.flash_attn_interface`` if a supported flash-attn imports with its CUDA extension, else ``None``.

    Tried once per process: an install that is missing, of another version, or whose extension fails
    to load (``find_spec`` would accept it) gives one warning and the PyTorch kernels are used instead.
    """
    try:
        package = importlib.import_module("flash_attn")
    except ImportError:
        return None  # not installed: PyTorch's kernels, nothing to warn about
    try:
        version = Version(getattr(package, "__version__", ""))
    except InvalidVersion:
        version = None
    if version is None or not SUPPORTED[0] <= version < SUPPORTED[1]:
        warnings.warn(
            f"flash-attn {getattr(package, '__version__', '(unknown version)')} is installed, but hf_memo calls the "
            f"interface of flash-attn >={SUPPORTED[0]},<{SUPPORTED[1]}; using PyTorch's attention kernels",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    try:
        return importlib.import_module("flash_attn.flash_attn_interface")
    except Exception as error:  # an extension built for another torch or CUDA raises ImportError or OSError
        warnings.warn(
            f"flash-attn {version} is installed but does not load ({type(error).__name__}: {error}); "
            "using PyTorch's attention kernels",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def _window_and_softcap(window: int | None, softcap: float | None) -> dict[str, float | int]:
    """flash-attn's arguments for a causal ``window`` (``-1``: none) and ``softcap`` (``0.0``: none)."""
    return {
        "window_size_left": -1 if window is None else window - 1,
        "window_size_right": -1 if window is None else 0,
        "softcap": 0.0 if softcap is None else softcap,
    }


def forward(
    fa: ModuleType,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    dropout_p: float,
    causal: bool = True,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention: q ``(B, S, h, D)``, k, v ``(B, S, h_kv, D)`` -> out ``(B, S, h, D)``, lse ``(B, h, S)``,
    and the ``rng_state`` that replays the dropout mask. ``causal=False``: every query attends to every key.
    ``window``: query ``i`` sees keys ``i - window < j <= i`` (transformers' rule; flash-attn's window is
    ``(window - 1, 0)``); ``softcap``: scores become ``softcap * tanh(score / softcap)``."""
    out, lse, _, rng_state = fa._flash_attn_forward(
        q=q,
        k=k,
        v=v,
        dropout_p=dropout_p,
        softmax_scale=scale,
        causal=causal,
        **_window_and_softcap(window, softcap),
        alibi_slopes=None,
        return_softmax=False,
    )
    return out, lse, rng_state


def backward(
    fa: ModuleType,
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rng_state: torch.Tensor,
    scale: float,
    dropout_p: float,
    causal: bool = True,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in the layouts of ``q, k, v`` (``(B, S, h, D)``, ``(B, S, h_kv, D)``), replaying the forward's
    dropout mask from its ``rng_state`` (``causal``, ``window`` and ``softcap`` as in :func:`forward`)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fa._flash_attn_backward(
        dout=grad_out,
        q=q,
        k=k,
        v=v,
        out=out,
        softmax_lse=lse,
        dq=dq,
        dk=dk,
        dv=dv,
        dropout_p=dropout_p,
        softmax_scale=scale,
        causal=causal,
        **_window_and_softcap(window, softcap),
        alibi_slopes=None,
        deterministic=False,
        rng_state=rng_state,
    )
    return dq, dk, dv
