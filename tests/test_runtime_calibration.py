import weakref

import torch

from hf_memo.minseq.chunking import chunk_bounds
from hf_memo.patches.llama import FAMILY
from hf_memo.runtime.calibration import host_bandwidth, layer_bytes_per_token, time_layer_forward
from hf_memo.runtime.offload import HostPool
from tests.conftest import build_model


def _layer_input(seq=64):
    model = build_model("llama", num_hidden_layers=2)
    x = torch.randn(2, seq, 32, dtype=torch.float64, requires_grad=True) * 1.0
    split = FAMILY.split(model.model.layers[0], model.model.rotary_emb(x, torch.arange(seq)[None]))
    return split, x


def test_bytes_per_token_do_not_depend_on_the_probe_length():
    split, x = _layer_input()
    fixed, other = layer_bytes_per_token(split, x, rows=16)
    assert (fixed, other) == layer_bytes_per_token(split, x, rows=48)
    # layer input (32) + attention output (4 heads x 8) in fp64, + 4 fp64 softmax statistics
    assert fixed == 32 * 8 + 32 * 8 + 4 * 8
    assert other > fixed  # norms, projections, RoPE and the MLP save more than input and output


def test_probing_leaves_the_rng_and_no_references_behind():
    split, x = _layer_input()
    storage = weakref.ref(x.untyped_storage())
    torch.manual_seed(5)
    layer_bytes_per_token(split, x)
    time_layer_forward(split, x.detach(), chunk_bounds(x.shape[1], 4))
    drawn = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(3))
    del x
    assert storage() is None  # freed at once: the probe's stash holds no graph that holds the stash


def test_timings_and_bandwidth_are_positive():
    split, x = _layer_input()
    assert time_layer_forward(split, x.detach(), chunk_bounds(x.shape[1], 3)).seconds > 0
    pool = HostPool(torch.device("cpu"))
    assert host_bandwidth(x, pool) > 0
    assert pool.in_use_bytes == 0 and pool.reserved_bytes == x.numel() * x.element_size()  # kept for the stash
