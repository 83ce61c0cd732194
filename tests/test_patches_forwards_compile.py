"""``torch.compile(fullgraph=True)`` of patched models against the unpatched model (eager, tiny models).

The eager and aot_eager backends check what Dynamo and AOTAutograd trace without inductor's long compile times.
"""

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from transformers import CompileConfig

import hf_memo
from tests.conftest import assert_same_grads, build_model, make_batch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family,recompute", [("llama", "memo"), ("gpt2", "full")])
def test_evaluation_and_static_cache_generate_compile_whole(family, recompute):
    model = build_model(family, dtype=torch.float32)
    reference = copy.deepcopy(model)
    hf_memo.apply(model, recompute=recompute, mlp_chunks=2, lm_head_chunks=3)
    model.eval()
    reference.eval()
    ids, _ = make_batch(2, 12)
    counter = CompileCounter()
    with torch.no_grad():
        got = torch.compile(model, fullgraph=True, backend=counter)(input_ids=ids).logits
        want = reference(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1

    compile_config = CompileConfig(fullgraph=True, backend="eager", mode=None, dynamic=False)
    compile_config._compile_all_devices = True  # transformers compiles generate() on accelerators only otherwise
    prompt = ids[:1, :4]
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    torch._dynamo.utils.counters.clear()
    out = model.generate(prompt, cache_implementation="static", compile_config=compile_config, **settings)
    assert torch.equal(out, reference.generate(prompt, **settings))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the decoding steps ran compiled


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_compiled_training_step_with_dropout_is_exact(recompute):
    # none: hf_memo's default; selective adds its checkpoint regions (with their policy) around the chunks' own
    model = build_model("gpt2", resid_pdrop=0.2)
    reference = copy.deepcopy(model)
    hf_memo.apply(model, recompute=recompute, mlp_chunks=3, lm_head_chunks=2)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids, labels = make_batch(2, 11)
    losses = []
    for m in (compiled, reference):
        torch.manual_seed(7)  # the same dropout masks in both
        out = m(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
        losses.append(out.loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)
