# ruff: noqa  -- a port of ../shared/gpu_checks, kept in its style so that the two still diff line by line
"""GPU check 3: does memo overlap its copies, sync, and pin what it says? Llama-3-8B layer shapes, 4 layers, bf16.

python benchmarks/gpu_session/overlap_check.py [S] [alpha|auto] [out_dir]

../shared/gpu_checks/overlap_check.py with its one stale part fenced (the kit runs this one): it imported
``hf_memo.patches.llama.FAMILY``, which no longer exists, so the whole check failed at import; the calibration
section (one layer's warm forward time and peak) now reports its error and the steady-step profile still runs.
"""

import collections, json, os, sys, time, warnings, torch

warnings.filterwarnings("ignore")
from transformers import LlamaConfig, LlamaForCausalLM
import hf_memo
from hf_memo.runtime import calibration

S = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
alpha = sys.argv[2] if len(sys.argv) > 2 else "0.5"
out_dir = sys.argv[3] if len(sys.argv) > 3 else "."
dev = torch.device("cuda")
cfg = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=1 << 20,
    rope_theta=500000.0,
    attn_implementation="sdpa",
    use_cache=False,
)
with dev:
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).train()
hf_memo.apply(
    model, recompute="memo", offload_fraction=alpha if alpha == "auto" else float(alpha), host_memory_limit="48GiB"
)
rt = hf_memo.memo_runtime(model)
ids = torch.randint(0, cfg.vocab_size, (1, S), device=dev)


def step():
    torch.cuda.synchronize()
    t = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t


times = [step() for _ in range(3)]
print(f"S={S} alpha={alpha}: step times {['%.3f' % t for t in times]}  plan {rt.plan}")
print("  measured bandwidth B/s:", {str(k): f"{v:.3g}" for k, v in rt._bandwidth.items()})
print(
    f"  host pool requested {rt.host_reserved_bytes / 2**30:.2f} GiB, pinned allocator "
    f"{torch.cuda.host_memory_stats().get('allocated_bytes.current', 0) / 2**30:.2f} GiB; device buffers "
    f"{rt.device_buffer_bytes / 2**30:.2f} GiB; max allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
)
# calibration: cold (as the runtime did) vs warm layer time
try:
    from hf_memo.patches.llama import FAMILY

    layer = model.model.layers[0]
    x = torch.randn(1, S, 4096, device=dev, dtype=torch.bfloat16)
    pe = model.model.rotary_emb(x, torch.arange(S, device=dev)[None])
    split = FAMILY.split(layer, pe)
    print(
        "  layer_forward_seconds now (warm):", ["%.4f" % calibration.layer_forward_seconds(split, x) for _ in range(3)]
    )
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    calibration.layer_forward_seconds(split, x)
    print(
        f"  calibration's unchunked layer forward peak: {(torch.cuda.max_memory_allocated() - base) / 2**30:.2f} GiB above resident"
    )
except Exception as error:  # the layer-split API moved: report, and go on to the profile
    print("  calibration section skipped:", type(error).__name__, error)
# profile one steady step
from torch.profiler import ProfilerActivity, profile

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step()
events = [e for e in prof.events()]
per_stream = collections.defaultdict(float)
copies = collections.defaultdict(float)
calls = collections.Counter()
for e in events:
    name = e.name
    if e.device_type == torch.autograd.DeviceType.CUDA:
        key = getattr(e, "stream", None) or getattr(e, "device_resource_id", None)
        per_stream[key] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        if "Memcpy" in name or "memcpy" in name:
            copies[name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    if name.startswith("cuda") and any(
        s in name for s in ("Synchronize", "HostAlloc", "MallocHost", "FreeHost", "Memcpy")
    ):
        calls[name] += 1
print("  GPU busy us per stream:", {k: round(v) for k, v in per_stream.items()})
print("  copies us:", {k: round(v) for k, v in copies.items()})
print("  runtime calls in a steady step:", dict(calls))
prof.export_chrome_trace(os.path.join(out_dir, f"memo_S{S}_a{alpha}.json.gz"))  # keep < 16 MiB for $OUT
