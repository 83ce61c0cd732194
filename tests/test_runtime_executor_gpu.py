"""The memo executor end to end on CUDA (GPU only): copy streams, pinned host pool, CUDA RNG, several steps.

Each check compares with the unpatched model and prints its worst error against the stated tolerance, so a first
GPU run catches what the CPU suite cannot see: a copy read before it finished or after its source was freed,
host buffers reused across steps, decisions taken again at a new length, autocast over fp32 weights.
"""

import copy

import pytest
import torch

import hf_memo
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from hf_memo.runtime.offload import CopyEngine, HostPool
from hf_memo.runtime.stash import DeviceSlots, LayerStash
from tests.conftest import build_model, make_batch
from tests.test_patches_packing import packed_row, padded_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA executor needs a GPU")
MIXED = MemoryPolicy(
    (
        LayerPolicy(keep_attention=False, on_host=True, alpha=0.5),
        LayerPolicy(keep_attention=True, on_host=True, alpha=1.0),
        LayerPolicy(keep_attention=True, on_host=True, alpha=0.0),
        LayerPolicy(keep_attention=False, on_host=False, alpha=1.0),
    )
)
MODES = {
    "none": {},
    "full": {"recompute": "full"},
    "selective": {"recompute": "selective"},
    "memo 0.5": {"recompute": "memo", "offload_fraction": 0.5},
    "memo mixed": {"recompute": "memo"},
}


def _worst(model, reference) -> float:
    return max(
        float((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30))
        for p, q in zip(model.parameters(), reference.parameters())
        if q.grad is not None
    )


def _pair(mode: str, dtype=torch.float32):
    reference = build_model("llama", dtype=dtype, num_hidden_layers=4, hidden_size=64, num_attention_heads=4).cuda()
    model = hf_memo.apply(copy.deepcopy(reference), mlp_chunks=3, lm_head_chunks=2, **MODES[mode])
    if mode == "memo mixed":
        hf_memo.memo_runtime(model).assume_policy(MIXED)
    return model, reference


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_under_bf16_autocast_over_fp32_weights_for_three_steps(mode):
    model, reference = _pair(mode)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    for step in range(3):
        ids, labels = (t.cuda() for t in make_batch(2, 200 + 24 * step, seed=step))  # a new length each step
        for m in (model, reference):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
        worst = _worst(model, reference)
        print(f"{mode} autocast step {step}: worst relative gradient error {worst:.2e} (tolerance 5e-2)")
        assert worst <= 5e-2
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize("batch", ["packed", "right-padded", "left-padded"])
def test_memo_packed_and_padded_batches_on_cuda(batch):
    torch.backends.cuda.matmul.allow_tf32 = False
    model, reference = _pair("memo mixed")
    if batch == "packed":
        samples, labels, ids, packed_labels, positions, num_items = (
            [t.cuda() for t in x] if isinstance(x, list) else x.cuda() for x in packed_row()
        )
        model(input_ids=ids, labels=packed_labels, position_ids=positions, num_items_in_batch=num_items).loss.backward()
        for sample, label in zip(samples, labels):
            reference(input_ids=sample[None], labels=label[None], num_items_in_batch=num_items).loss.backward()
    else:
        ids, labels, mask = (t.cuda() for t in padded_batch(batch.split("-")[0]))
        for m in (model, reference):
            m(input_ids=ids, labels=labels, attention_mask=mask).loss.backward()
    worst = _worst(model, reference)
    print(f"memo {batch} on CUDA fp32: worst relative gradient error {worst:.2e} (tolerance 1e-4)")
    assert worst <= 1e-4


def test_memo_live_graphs_and_retained_graph_on_cuda():
    torch.backends.cuda.matmul.allow_tf32 = False
    model, reference = _pair("memo mixed")
    batches = [tuple(t.cuda() for t in make_batch(2, 160 + 16 * i, seed=i)) for i in range(3)]
    losses = [model(input_ids=ids, labels=labels).loss for ids, labels in batches]
    losses[0].backward(retain_graph=True)
    for index in (0, 2, 1):
        losses[index].backward()
    for i, (ids, labels) in enumerate(batches):
        reference(input_ids=ids, labels=labels).loss.backward(retain_graph=i == 0)
        if i == 0:
            reference(input_ids=ids, labels=labels).loss.backward()
    worst = _worst(model, reference)
    print(f"memo live graphs on CUDA: worst relative gradient error {worst:.2e} (tolerance 1e-4)")
    assert worst <= 1e-4


def test_offloaded_bytes_survive_their_source_being_freed_and_overwritten():
    """The copy to the host reads the stashed tensor itself: its memory must not serve another tensor first."""
    device = torch.device("cuda")
    engine = CopyEngine(device)
    prefetch = DeviceSlots("prefetch", device, engine)
    pool = HostPool(device)
    stash = LayerStash(0, True, engine, pool, prefetch)
    source = torch.randn(64, 2**16, device=device)
    want = source.cpu()
    ref = stash.add(source)
    stash.seal()  # copies to the host on the side stream
    del source
    noise = [torch.full((64, 2**16), float("nan"), device=device) for _ in range(8)]  # reuse the freed blocks
    prefetch.release_all()
    stash.prefetch()
    noise.append(torch.full((64, 2**16), float("nan"), device=device))
    got = stash.rebuild(ref).cpu()
    del noise
    assert torch.equal(got, want)
