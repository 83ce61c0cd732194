"""What an uneven Ulysses head split costs: per-rank heads, exchange buffers and attention time, on CPU.

For model shapes whose query heads the degree does not divide, each rank of a fake process group (its collectives
move nothing, tensors keep their shapes) runs hf_memo's Ulysses core (forward and backward) on its shard; the bytes
it holds beyond the single-GPU core are measured with the allocation recorder of the fake profiles and compared with
the per-rank memory model (:func:`~hf_memo.estimator.cluster.all_to_all_bytes`, rank 0's). Attention's time grows
with a rank's query heads: the core's forward + backward is timed on CPU for ``⌈h/P⌉`` and ``⌊h/P⌋`` heads of the
whole sequence: the slowest rank's time over the mean of all ranks' (the even share), against the load imbalance
``⌈h/P⌉ / (h/P)``.

    python benchmarks/sequence_parallel_uneven.py [--out DIR]   # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import LlamaConfig

from hf_memo.estimator.cluster import Cluster, all_to_all_bytes
from hf_memo.parallel.heads import HeadSplit
from hf_memo.parallel.memo_attention import UlyssesAttention
from hf_memo.profiler.allocations import AllocationRecorder
from hf_memo.profiler.analysis import peak
from hf_memo.runtime.attention_core import LocalAttention
from hf_memo.runtime.attention_traits import AttentionTraits

from common import add_out_option, results_folder

# (name, query heads, KV heads, degree): Qwen2.5-7B on 8 GPUs, a 40-head model at 16, Llama-3-8B (even) at 8
SHAPES = [("Qwen2.5-7B", 28, 4, 8), ("40 heads (Llama-2-13B)", 40, 40, 16), ("Llama-3-8B", 32, 8, 8)]
HEAD_DIM, RANK_TOKENS, TIMED_TOKENS = 128, 64, 2048


def _extra(core: object, heads: int, kv_heads: int) -> int:
    """Bytes ``core``'s forward or backward allocates at its peak beyond its inputs, on ``(1, heads, s, D)``."""

    def sequence_major(n: int) -> torch.Tensor:
        return torch.randn(1, RANK_TOKENS, n, HEAD_DIM, dtype=torch.bfloat16).transpose(1, 2)

    q, out, grad = (sequence_major(heads) for _ in range(3))
    k, v = sequence_major(kv_heads), sequence_major(kv_heads)
    traits, peaks = AttentionTraits(HEAD_DIM**-0.5), []
    _, stats = core.forward(q, k, v, traits)
    for call in (lambda: core.forward(q, k, v, traits), lambda: core.backward(grad, q, k, v, out, stats, traits)):
        recorder = AllocationRecorder(lambda: "attention", lambda: "step")
        with recorder:
            recorder.track((q, k, v, out, grad, stats.lse))
            start = peak(recorder.trace()).total
            call()
        peaks.append(peak(recorder.trace()).total - start)
    return max(peaks)


def rank_bytes(heads: int, kv_heads: int, size: int) -> list[int]:
    """Each rank's exchange bytes beyond the single-GPU core, under a fake process group of ``size``."""
    local = _extra(LocalAttention(), heads, kv_heads)
    result = []
    for rank in range(size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
        try:
            result.append(_extra(UlyssesAttention(dist.group.WORLD, size), heads, kv_heads) - local)
        finally:
            dist.destroy_process_group()
    return result


def attention_seconds(heads: int, repeats: int = 5) -> float:
    """Best of ``repeats`` forward + backward of the core on ``heads`` heads of ``TIMED_TOKENS`` positions (fp32)."""
    core, traits = LocalAttention(), AttentionTraits(HEAD_DIM**-0.5)
    q, k, v, grad = (torch.randn(1, heads, TIMED_TOKENS, HEAD_DIM) for _ in range(4))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out, stats = core.forward(q, k, v, traits)
        core.backward(grad, q, k, v, out, stats, traits)
        best = min(best, time.perf_counter() - start)
    return best


def measure(name: str, heads: int, kv_heads: int, size: int) -> dict:
    split = HeadSplit(heads, kv_heads, size)
    config = LlamaConfig(hidden_size=heads * HEAD_DIM, num_attention_heads=heads, num_key_value_heads=kv_heads)
    measured = rank_bytes(heads, kv_heads, size)
    counts = [len(r) for r in split.queries]
    seconds = {str(n): attention_seconds(n) for n in sorted(set(counts))}
    mean = sum(seconds[str(n)] for n in counts) / size  # the group's attention time shared evenly
    return {
        "model": name,
        "heads": heads,
        "kv_heads": kv_heads,
        "degree": size,
        "query_heads_per_rank": counts,
        "kv_heads_attended_per_rank": [split.attended_kv_heads(r) for r in range(size)],
        "grouped": split.grouped,
        "imbalance": split.imbalance,
        "exchange_bytes_per_rank": measured,
        "model_bytes_rank_0": all_to_all_bytes(config, Cluster(size, size), 1, RANK_TOKENS, 2),
        "attention_seconds": seconds,
        "measured_imbalance": seconds[str(split.most_query_heads)] / mean,
    }


def markdown(results: list[dict]) -> str:
    lines = [
        f"Uneven Ulysses head splits, batch 1, head dim {HEAD_DIM}: exchange bytes per rank at {RANK_TOKENS} "
        f"positions per rank (bf16, fake process group), attention forward + backward on {TIMED_TOKENS} positions "
        "(fp32, CPU).",
        "",
        "| model | P | query heads per rank | ⌈h/P⌉ / (h/P) | measured time imbalance | exchange bytes, rank 0 / "
        "lightest rank (model: rank 0) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        heads = sorted(set(r["query_heads_per_rank"]), reverse=True)
        counts = " or ".join(str(h) for h in heads)
        bytes_ = r["exchange_bytes_per_rank"]
        lines.append(
            f"| {r['model']} ({r['heads']} q / {r['kv_heads']} kv) | {r['degree']} | {counts} | {r['imbalance']:.3f} "
            f"| {r['measured_imbalance']:.3f} | {bytes_[0]:,} / {min(bytes_):,} ({r['model_bytes_rank_0']:,}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_option(parser)
    args = parser.parse_args()
    date, out = results_folder(args.out)
    torch.manual_seed(0)
    results = [measure(*shape) for shape in SHAPES]
    meta = {"date": date, "machine": platform.processor() or platform.machine(), "torch": torch.__version__}
    (out / "sequence_parallel_uneven.json").write_text(json.dumps({**meta, "runs": results}, indent=2))
    table = markdown(results)
    (out / "sequence_parallel_uneven.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
