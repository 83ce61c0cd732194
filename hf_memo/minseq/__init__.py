"""Mini-Sequence Transformer ops: the MLP and the LM head + loss over row chunks, autograd-exact."""

from hf_memo.minseq.chunking import auto_chunks, chunk_bounds, resolve_chunks
from hf_memo.minseq.lm_head import causal_lm_loss, linear_cross_entropy, shifted_targets
from hf_memo.minseq.mlp import minseq_mlp

__all__ = [
    "auto_chunks",
    "causal_lm_loss",
    "chunk_bounds",
    "linear_cross_entropy",
    "minseq_mlp",
    "resolve_chunks",
    "shifted_targets",
]
