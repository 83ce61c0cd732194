"""Randomized search of sequence-parallel memo steps against the unpatched model, on gloo ranks.

Each seed draws a degree (2, 3 or 4), a family and its head layout (even, uneven, KV heads repeated after the
exchange), 2 to 4 layers with a drawn :class:`~hf_memo.planner.policy.LayerPolicy` each (input only or input and
attention, host or device, alpha 0 to 1), chunk counts that need not divide the rank's positions, a batch (rows,
length, masked labels, right padding or packed samples) and one or two accumulated micro-batches. The step's loss
and every gradient (averaged over the group, as DDP does) must equal the unpatched model's on the whole batch (fp64;
to fp32 rounding at degree 3, where the fp32 cross-entropy's backward runs on 3 x the gradient before the average,
bounded on the scale of the model's largest gradient).

    python -m tests.randomized_sequence_parallel --count 60 --first 0
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import torch

import hf_memo
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from tests.conftest import build_model
from tests.model_catalog import FP32_TOLERANCE
from tests.multiprocess import run_processes
from tests.test_parallel_causal_lm import Case, _averaged_grads, _compare

HEAD_LAYOUTS = {  # (hidden, query heads, KV heads), all with head dim 8 (4 for 10 heads)
    "4 heads, 2 KV": (32, 4, 2),
    "4 heads, 1 KV": (32, 4, 1),
    "4 heads, 4 KV": (32, 4, 4),
    "6 heads, 2 KV": (48, 6, 2),
    "10 heads, 2 KV": (40, 10, 2),
}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class Drawn:
    """One drawn step: the degree, the case (batch and model) and the memo settings."""

    seed: int
    sp: int
    case: Case
    policy: tuple[LayerPolicy, ...]
    mlp_chunks: int
    lm_head_chunks: int
    micro_batches: int


def draw(seed: int) -> Drawn:
    rng = random.Random(seed)
    sp = rng.choice((2, 3, 4))
    family = rng.choice(FAMILIES)
    hidden, heads, kv_heads = HEAD_LAYOUTS[rng.choice([n for n, (_, h, _) in HEAD_LAYOUTS.items() if h >= sp])]
    layers = rng.randint(2, 4)
    overrides = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads)
    overrides["num_hidden_layers"] = layers
    if family == "qwen3":
        overrides["head_dim"] = hidden // heads
    rows, length = rng.randint(1, 2), rng.randint(sp, 37)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 101, (rows, length), generator=gen)
    labels = ids.masked_fill(torch.rand(rows, length, generator=gen) < rng.choice((0.0, 0.3, 0.8)), -100)
    kwargs = {}
    layout = rng.choice(("plain", "padded", "packed"))
    if layout == "padded" and length > 3:
        mask = torch.ones_like(ids)
        cut = rng.randint(2, length - 1)
        mask[-1, cut:] = 0
        labels[-1, cut:] = -100
        kwargs["attention_mask"] = mask
    elif layout == "packed" and length > 3:
        cuts = sorted(rng.sample(range(1, length), rng.randint(1, min(3, length - 1))))
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, length])]
        positions = torch.cat([torch.arange(n) for n in lengths]).expand(rows, -1).contiguous()
        labels = labels.masked_fill(positions == 0, -100)
        kwargs["position_ids"] = positions
    for row in range(rows):  # each micro-batch needs a target (else its loss is 0 / 0 in both models); a label at
        if not (labels[row, 1:] != -100).any():  # position 0 is no token's target
            labels[row, 1] = ids[row, 1]
    policy = tuple(
        LayerPolicy(rng.random() < 0.5, rng.random() < 0.5, rng.choice((0.0, 0.25, 0.5, 1.0))) for _ in range(layers)
    )
    case = Case(family, ids, labels, overrides=overrides, kwargs=kwargs)
    micro_batches = rng.choice((1, 2)) if rows == 2 else 1
    return Drawn(seed, sp, case, policy, rng.randint(1, 5), rng.randint(1, 3), micro_batches)


def _parts(drawn: Drawn) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
    """The micro-batches: the whole batch, or each row."""
    case = drawn.case
    if drawn.micro_batches == 1:
        return [(case.ids, case.labels, case.kwargs)]
    return [
        (case.ids[r : r + 1], case.labels[r : r + 1], {k: v[r : r + 1] for k, v in case.kwargs.items()})
        for r in range(case.ids.shape[0])
    ]


def _sequence_parallel_step(drawn: Drawn) -> dict:
    model = build_model(drawn.case.family, **drawn.case.overrides)
    hf_memo.apply(
        model,
        recompute="memo",
        sequence_parallel_size=drawn.sp,
        mlp_chunks=drawn.mlp_chunks,
        lm_head_chunks=drawn.lm_head_chunks,
    )
    hf_memo.memo_runtime(model).assume_policy(MemoryPolicy(drawn.policy))
    loss = 0
    for ids, labels, kwargs in _parts(drawn):
        step = model(input_ids=ids, labels=labels, **kwargs).loss
        step.backward()
        loss = loss + step.detach()
    return {"loss": loss, "grads": _averaged_grads(model)}


def _reference(drawn: Drawn) -> tuple[torch.Tensor, dict]:
    model = build_model(drawn.case.family, **drawn.case.overrides)
    loss = 0
    for ids, labels, kwargs in _parts(drawn):
        if "position_ids" in kwargs:
            kwargs = {k: v for k, v in kwargs.items() if k != "attention_mask"}
        step = model(input_ids=ids, labels=labels, use_cache=False, **kwargs).loss
        step.backward()
        loss = loss + step.detach()
    return loss, {n: p.grad for n, p in model.named_parameters()}


def _within_fp32_rounding(got: dict, loss: torch.Tensor, grads: dict) -> None:
    """The loss to fp32 rounding and every gradient within ``FP32_TOLERANCE`` of the model's largest gradient element:
    the rounding enters with the loss's gradient and spreads over every parameter, so a gradient that is zero (a query
    that sees one key: no gradient reaches q and k) is compared on the model's scale, not on its own rounding noise."""
    torch.testing.assert_close(got["loss"], loss, rtol=1e-6, atol=0)
    scale = max(float(g.abs().max()) for g in grads.values() if g is not None)
    for name, want in grads.items():
        torch.testing.assert_close(got["grads"][name], want, rtol=0, atol=FP32_TOLERANCE * scale, msg=name)


def _worker(rank: int, world: int, seeds: list[int]) -> dict[int, dict]:
    return {seed: _sequence_parallel_step(draw(seed)) for seed in seeds}


def search(seeds: range) -> list[str]:
    """Every seed's step against the unpatched model; the failures, described."""
    by_degree: dict[int, list[int]] = {}
    for seed in seeds:
        by_degree.setdefault(draw(seed).sp, []).append(seed)
    failures = []
    for sp, group in sorted(by_degree.items()):
        per_rank = run_processes(_worker, sp, group)
        for seed in group:
            drawn = draw(seed)
            loss, grads = _reference(drawn)
            for rank, results in enumerate(per_rank):
                try:
                    if sp == 3:
                        _within_fp32_rounding(results[seed], loss, grads)
                    else:
                        _compare(results[seed], loss, grads, drawn.case)
                except AssertionError as error:
                    failures.append(f"seed {seed} (sp={sp}, rank {rank}): {str(error).splitlines()[0]}\n  {drawn}")
                    break
        print(f"sp={sp}: {len(group)} seeds run", flush=True)
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=30)
    parser.add_argument("--first", type=int, default=0)
    args = parser.parse_args()
    failures = search(range(args.first, args.first + args.count))
    print("\n".join(failures) or "no failures")
    print(f"{len(failures)} of {args.count} seeds failed")


if __name__ == "__main__":
    main()
