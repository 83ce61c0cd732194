"""The family splits (Llama layout, GPT-2) under the memo executor: a single stashed copy of the attention output."""

import pytest
import torch
import torch.nn.functional as F

from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.patches.registry import family_for
from hf_memo.runtime.attention_core import LocalAttention, expand_kv
from hf_memo.runtime.executor import MemoLayerFunction
from tests.conftest import build_model
from tests.stash_recording import RecordingSource, attention_output_copies


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_offloading_every_token_of_a_real_layer_stashes_one_copy_of_the_attention_output(family):
    """Two sequences in three chunks, all offloaded: the rows o_proj / c_proj read are views of the attention
    output, and no flattened copy of them is saved for the weight gradient. The output equals the layer's."""
    model = build_model(family)
    x = torch.randn(2, 10, 32, dtype=torch.float64, requires_grad=True)
    if family == "gpt2":
        layer, embeddings = model.transformer.h[0], None
    else:
        layer = model.model.layers[0]
        embeddings = model.model.rotary_emb(x, torch.arange(10)[None])
    split = family_for(family).split(layer, embeddings)
    source = RecordingSource()
    params = list(layer.parameters())
    y = MemoLayerFunction.apply(source, split, LocalAttention, 2, chunk_bounds(10, 3), 3, x, *params)
    with torch.no_grad():
        q, k, v = split.project(x, 0, 10)
        groups = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, expand_kv(k, groups), expand_kv(v, groups), is_causal=True)
        want = layer(x, position_embeddings=embeddings) if embeddings is not None else layer(x)
    assert attention_output_copies(source.stash, out) == 1
    torch.testing.assert_close(y, want[0] if isinstance(want, tuple) else want, rtol=1e-12, atol=1e-12)
