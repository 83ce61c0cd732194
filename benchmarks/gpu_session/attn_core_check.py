# ruff: noqa  -- a port of ../shared/gpu_checks, kept in its style so that the two still diff line by line
"""GPU check 1: memo attention core vs SDPA autograd, all backends; stash round trip; CUDA sanitizer-friendly.

python benchmarks/gpu_session/attn_core_check.py [cpu|cuda]

../shared/gpu_checks/attn_core_check.py ported to today's runtime API (the kit runs this one): the attention core
takes an ``AttentionTraits`` rather than a scale and its backward returns the sinks' gradient too; a ``LayerStash``
takes one set of prefetch slots.
"""

import dataclasses, sys, itertools, torch, torch.nn.functional as F
from hf_memo.runtime.attention_core import attention_forward, attention_backward, backend_for
from hf_memo.runtime.attention_traits import AttentionTraits
from hf_memo.runtime.offload import CopyEngine, HostPool
from hf_memo.runtime.stash import DeviceSlots, LayerStash

dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
torch.manual_seed(0)
dtypes = [torch.float32] if dev.type == "cpu" else [torch.bfloat16, torch.float16, torch.float32]
tol = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 2e-4, torch.float64: 1e-10}
engine = CopyEngine(dev)
pool = HostPool(dev)
pre = DeviceSlots("p", dev, engine)
fails = 0
for dtype, groups, S, D, B in itertools.product(dtypes, (1, 4), (1, 127, 1000, 4096), (64, 128), (1, 2)):
    h_kv = 2
    h = h_kv * groups
    q = torch.randn(B, h, S, D, device=dev, dtype=dtype)
    k = torch.randn(B, h_kv, S, D, device=dev, dtype=dtype)
    v = torch.randn(B, h_kv, S, D, device=dev, dtype=dtype)
    g = torch.randn(B, h, S, D, device=dev, dtype=dtype)
    traits = AttentionTraits(scale=D**-0.5)
    out, stats = attention_forward(q, k, v, traits)
    # round trip what the executor keeps through a swapped stash (D2H on side stream, H2D prefetch)
    stash = LayerStash(0, True, engine, pool, pre)
    refs = [stash.add(t) for t in (q, k, v, out, stats.lse)]
    stash.seal()
    junk = [torch.full((B * h * S * D,), 7, device=dev, dtype=dtype) for _ in range(4)]  # reuse freed memory
    q2, k2, v2, out2, lse2 = (stash.rebuild(r) for r in refs)
    dq, dk, dv, _ = attention_backward(g, q2, k2, v2, out2, dataclasses.replace(stats, lse=lse2), traits)
    stash.release()
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=traits.scale, enable_gqa=groups > 1)
    ref.backward(g)
    errs = [
        ((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-6)).item()
        for a, b in ((out, ref), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad))
    ]
    bad = max(errs) > tol[dtype]
    fails += bad
    if bad or (S == 4096 and D == 128 and B == 2):
        print(
            f"{'FAIL' if bad else 'ok  '} {backend_for(q, traits)} {dtype} groups={groups} S={S} D={D} B={B} "
            f"rel err out/dq/dk/dv={['%.1e' % e for e in errs]} out.stride={tuple(out.stride())} "
            f"lse={tuple(stats.lse.shape)} {stats.lse.dtype}"
        )
if dev.type == "cuda":
    print(
        "host pool reserved (requested) bytes:",
        pool.reserved_bytes,
        "pinned allocator bytes:",
        torch.cuda.host_memory_stats().get("allocated_bytes.current"),
    )
print("FAILURES:", fails)
