"""Mini-Sequence Transformer ops: the MLP and the LM head + loss over row chunks, autograd-exact.

The public names are imported on first use (PEP 562): the estimator reads the chunking rule
(:mod:`hf_memo.minseq.chunking`) without PyTorch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_memo.lazy_names import lazy_names

if TYPE_CHECKING:
    from hf_memo.minseq.chunking import auto_chunks, chunk_bounds, resolve_chunks
    from hf_memo.minseq.lm_head import causal_lm_loss, linear_cross_entropy, shifted_targets
    from hf_memo.minseq.mlp import minseq_mlp

_PUBLIC = {  # name -> the module it comes from
    "auto_chunks": "hf_memo.minseq.chunking",
    "chunk_bounds": "hf_memo.minseq.chunking",
    "resolve_chunks": "hf_memo.minseq.chunking",
    "causal_lm_loss": "hf_memo.minseq.lm_head",
    "linear_cross_entropy": "hf_memo.minseq.lm_head",
    "shifted_targets": "hf_memo.minseq.lm_head",
    "minseq_mlp": "hf_memo.minseq.mlp",
}

__all__ = [
    "auto_chunks",
    "causal_lm_loss",
    "chunk_bounds",
    "linear_cross_entropy",
    "minseq_mlp",
    "resolve_chunks",
    "shifted_targets",
]

__getattr__ = lazy_names(__name__, _PUBLIC)
