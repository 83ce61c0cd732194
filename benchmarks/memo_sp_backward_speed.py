"""CPU step time of the sequence-parallel memo backward in query chunks over held keys, against the whole-sequence
backward, side by side in one run.

Two gloo ranks (one thread each) train the model of ``benchmarks/memo_speed.py`` under sequence parallelism 2 with
the memo executor, every layer on the host, keeping its input only ("X only") or its input and attention output
("X + attention"). Each policy runs two ways on the same weights and batch: as hf_memo runs it (a layer's backward
one chunk of queries at a time, k/v exchanged once: ``ExchangedQueryBlocks``) and with the Ulysses core told not to
block queries, so the layer's backward exchanges and attends the whole sequence of its heads at once (the path
before query chunks, still used for dropout and packed batches). Timed steps alternate over the four contenders,
starting one later each round. Reported per length: rank 0's median step seconds, the chunked over the whole time
(below 1: faster now), and the largest loss and gradient differences between the two ways.

    python benchmarks/memo_sp_backward_speed.py                        # S = 4,096 and 8,192, 5 rounds
    python benchmarks/memo_sp_backward_speed.py --tiny --out /tmp/x    # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import add_out_option, results_folder, tiny_llama

HERE = Path(__file__).resolve().parent
SP = 2
POLICIES = {"X only": False, "X + attention": True}  # name: keep_attention
WAYS = ("query chunks", "whole sequence")


def _build(config, keep_attention: bool, seed: int):
    import memo_speed
    from transformers import LlamaForCausalLM

    import hf_memo
    from hf_memo.planner.policy import LayerPolicy, MemoryPolicy

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().train()
    hf_memo.apply(
        model, recompute="memo", sequence_parallel_size=SP, host_memory_limit=memo_speed.HOST_LIMIT, mlp_chunks=4
    )
    layer = LayerPolicy(keep_attention=keep_attention, on_host=True)
    hf_memo.memo_runtime(model).assume_policy(MemoryPolicy((layer,) * config.num_hidden_layers))
    return model


def _step(model, ids: torch.Tensor, whole: bool) -> tuple[float, float, dict]:
    """One forward and backward on ``ids``: seconds, loss, gradients; ``whole``: queries not blocked."""
    from hf_memo.parallel.memo_attention import UlyssesAttention

    original = UlyssesAttention.blocks_queries
    if whole:
        UlyssesAttention.blocks_queries = lambda self, length, traits: False
    try:
        model.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        seconds = time.perf_counter() - start
    finally:
        UlyssesAttention.blocks_queries = original
    return seconds, loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _rank(rank: int, folder: str, tiny: bool, seq_lens: list[int], repeats: int, seed: int) -> None:
    sys.path.insert(0, str(HERE))
    import memo_speed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=SP)
    config = tiny_llama(2) if tiny else memo_speed.benchmark_config()
    results = {}
    for seq_len in seq_lens:
        ids = torch.randint(3, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(seed + 1))
        contenders = [(policy, way) for policy in POLICIES for way in WAYS]
        models = {policy: _build(config, keep, seed) for policy, keep in POLICIES.items()}
        rows = {f"{policy}, {way}": {"step_s": []} for policy, way in contenders}
        for policy in POLICIES:  # warm-up, and the two ways compared
            (_, loss_a, grads_a), (_, loss_b, grads_b) = (
                _step(models[policy], ids, way == "whole sequence") for way in WAYS
            )
            rows[f"{policy}, {WAYS[0]}"]["max_loss_diff"] = abs(loss_a - loss_b)
            rows[f"{policy}, {WAYS[0]}"]["max_grad_diff"] = max(
                float((grads_a[n] - grads_b[n]).abs().max()) for n in grads_a
            )
        for round_ in range(repeats):
            shift = round_ % len(contenders)
            for policy, way in contenders[shift:] + contenders[:shift]:
                gc.collect()
                seconds, _, _ = _step(models[policy], ids, way == "whole sequence")
                rows[f"{policy}, {way}"]["step_s"].append(seconds)
            if rank == 0:
                print(f"S={seq_len}: round {round_ + 1}/{repeats}", flush=True)
        for row in rows.values():
            row["median_s"] = statistics.median(row["step_s"])
        for policy in POLICIES:
            chunked, whole = rows[f"{policy}, {WAYS[0]}"], rows[f"{policy}, {WAYS[1]}"]
            chunked["chunked_over_whole"] = chunked["median_s"] / whole["median_s"]
        results[seq_len] = rows
        del models
        gc.collect()
    dist.destroy_process_group()
    if rank == 0:
        Path(folder, "results.json").write_text(json.dumps(results))


def table(results: dict, shape: str, repeats: int) -> str:
    lines = [
        f"{shape}; sequence parallel {SP} on gloo (one thread per rank); forward + backward, no optimizer; rank 0's "
        f"median of {repeats} interleaved steps.",
        "",
        "| S | policy | query chunks (s) | whole sequence (s) | chunks / whole | max loss diff | max grad diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for seq_len, rows in results.items():
        for policy in POLICIES:
            chunked, whole = rows[f"{policy}, {WAYS[0]}"], rows[f"{policy}, {WAYS[1]}"]
            lines.append(
                f"| {int(seq_len):,} | {policy} | {chunked['median_s']:.3f} | {whole['median_s']:.3f} | "
                f"{chunked['chunked_over_whole']:.3f} | {chunked['max_loss_diff']:.2e} | "
                f"{chunked['max_grad_diff']:.2e} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None, help="global sequence lengths")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="tiny model and length: a seconds-long smoke run")
    add_out_option(parser)
    args = parser.parse_args()
    seq_lens = args.seq_lens or ([256] if args.tiny else [4096, 8192])
    repeats = 2 if args.tiny else args.repeats
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(folder, args.tiny, seq_lens, repeats, args.seed), nprocs=SP, join=True)
        results = json.loads(Path(folder, "results.json").read_text())
    sys.path.insert(0, str(HERE))
    import memo_speed

    config = tiny_llama(2) if args.tiny else memo_speed.benchmark_config()
    shape = memo_speed.describe(config, args.tiny)
    _, out = results_folder(args.out)
    (out / "memo_sp_backward_speed.json").write_text(json.dumps({"shape": shape, "repeats": repeats, **results}))
    (out / "memo_sp_backward_speed.md").write_text(
        "# Memo's sequence-parallel backward: query chunks vs whole\n\n" + table(results, shape, repeats)
    )
    print(table(results, shape, repeats))


if __name__ == "__main__":
    main()
