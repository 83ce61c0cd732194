"""GPT-2 with its default dropouts on CUDA (GPU only): ``full`` and ``selective`` against the unpatched model
under the same seed, fp32 and bf16. The CUDA attention kernels draw their dropout inside one fused call; a
selective policy that saved such a call would shift every later dropout mask of the layer."""

import copy

import pytest
import torch

import hf_memo
from tests.conftest import build_model, make_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA attention kernels need a GPU")
DROPOUT = {"attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1}  # GPT-2's defaults


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_gpt2_dropout_trains_like_unpatched_under_the_same_seed(recompute, dtype):
    reference = build_model("gpt2", dtype=dtype, n_layer=3, n_embd=64, **DROPOUT).cuda()
    model = hf_memo.apply(copy.deepcopy(reference), recompute=recompute, mlp_chunks=1, lm_head_chunks=2)
    ids, labels = (t.cuda() for t in make_batch(2, 512))
    losses = []
    for m in (model, reference):
        torch.manual_seed(11)
        loss = m(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(float(loss))
    worst = max(
        float((p.grad - q.grad).float().abs().max() / q.grad.float().abs().max().clamp_min(1e-30))
        for p, q in zip(model.parameters(), reference.parameters())
    )
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2  # a shifted mask differs by O(1)
    print(f"gpt2 dropout {recompute} {dtype}: loss {losses[0]:.6f} vs {losses[1]:.6f}, worst grad rel {worst:.2e}")
    assert abs(losses[0] - losses[1]) <= tolerance * abs(losses[1]) and worst <= tolerance
