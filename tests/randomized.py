"""Randomized configurations of a patched training step against the unpatched model (fp64).

Each seed draws a family (one of the five in ``tests.conftest``, or a model of ``tests/model_catalog.py``:
mixtures of experts, sliding windows, soft-capping, sinks, ...), a recompute mode (memo with a fixed offload
fraction or a random per-layer policy), chunk counts that need not divide the sequence, a batch layout (plain,
left or right padding with or without targets on the padding, packed samples), masked labels, LoRA or full
fine-tuning, and a step pattern: one to three graphs alive at once, differentiated in a random order, the first
maybe twice (``retain_graph=True``), accumulated with ``num_items_in_batch``. Loss and every gradient must equal
the unpatched model's.

The suite runs a fixed set of seeds of each (``tests/test_patches_randomized.py``); a longer search runs from the
command line: ``python -m tests.randomized --count 500 --first 1000 [--catalog]``.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import hf_memo
from hf_memo.planner.policy import LayerPolicy, MemoryPolicy
from tests.conftest import FAMILIES, VOCAB, build_model
from tests.model_catalog import CATALOG, CATALOG_NAMES, FP32_TOLERANCE, WINDOW, build_catalog_model

MODES = ("none", "full", "selective", "memo", "memo-policy")
LAYOUTS = ("plain", "left", "right", "right-targets", "packed")
# LoRA targets: attention and MLP projections, fused ones (Phi-3) and mixture-of-experts weights (PEFT wraps a
# fused gate_up expert parameter only with both gate_proj and up_proj targeted) included
LORA_TARGETS = ["q_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "c_fc"]


@dataclass(frozen=True)
class Case:
    """One drawn configuration (its ``repr`` reproduces it)."""

    seed: int
    family: str
    mode: str
    layers: int
    mlp_chunks: int
    lm_head_chunks: int
    offload_fraction: float
    policy: tuple[tuple[bool, bool, float], ...]
    layout: str  # "plain", "left", "right", "right-targets", "packed"
    batch: int
    length: int
    lora: bool
    graphs: int
    order: tuple[int, ...]
    retain: bool


def _fp32_softmax(family: str) -> bool:
    """Whether ``family`` is a catalog model whose eager attention rounds its softmax through fp32: in fp64 a
    query row with only padding to attend becomes NaN there (the ``-finfo.max`` mask turns ``-inf``)."""
    return family in CATALOG and CATALOG[family].fp32_softmax


def draw(seed: int, families: Sequence[str] = FAMILIES) -> Case:
    """The configuration of ``seed``, its family one of ``families`` (names of ``tests.conftest.FAMILIES`` or of
    the catalog)."""
    rng = random.Random(seed)
    layers = rng.randint(1, 3)
    layout = rng.choice(LAYOUTS)
    graphs = rng.choice((1, 1, 2, 3))
    family = rng.choice(families)
    if family in CATALOG:
        layers = CATALOG[family].layers  # a catalog model has its own layer pattern
    if layout == "left" and _fp32_softmax(family):
        layout = "right"  # a left-padded row's first queries attend only padding
    return Case(
        seed=seed,
        family=family,
        mode=rng.choice(MODES),
        layers=layers,
        mlp_chunks=rng.randint(1, 5),
        lm_head_chunks=rng.randint(1, 4),
        offload_fraction=rng.choice((0.0, 0.5, 1.0, 0.3)),
        policy=tuple(
            (rng.random() < 0.5, rng.random() < 0.5, rng.choice((0.0, 1 / 3, 0.5, 1.0))) for _ in range(layers)
        ),
        layout=layout,
        batch=1 if layout == "packed" else rng.randint(1, 3),
        length=rng.randint(5, 23),
        lora=rng.random() < 0.3,
        graphs=graphs,
        order=tuple(rng.sample(range(graphs), graphs)),
        retain=rng.random() < 0.3,
    )


def _batch(case: Case, index: int) -> dict:
    """The model inputs of graph ``index``: ``input_ids``, ``labels`` and a mask or positions per the layout."""
    gen = torch.Generator().manual_seed(case.seed * 10 + index)
    batch, length = case.batch, case.length + index  # a length per graph
    ids = torch.randint(3, VOCAB, (batch, length), generator=gen)
    labels = ids.clone()
    labels[torch.rand(batch, length, generator=gen) < 0.3] = -100
    inputs = {"input_ids": ids, "labels": labels}
    if case.layout == "packed":
        cuts = sorted(random.Random(case.seed + index).sample(range(1, length), min(3, length - 1)))
        starts = [0, *cuts]
        positions = torch.cat([torch.arange(b - a) for a, b in zip(starts, [*cuts, length])])[None]
        labels[0, starts] = -100  # a sample's first token predicts nothing from the previous sample
        inputs["position_ids"] = positions
    elif case.layout != "plain":
        mask = torch.ones_like(ids)
        # where a right-padded row's last window could hold only padding, less padding than the window
        most = min(length - 2, WINDOW - 1) if _fp32_softmax(case.family) else length - 2
        for row in range(batch):
            pad = int(torch.randint(0, most, (), generator=gen))
            if case.layout == "left":
                mask[row, :pad] = 0
            else:
                mask[row, length - pad :] = 0
        if case.layout != "right-targets":
            labels[mask == 0] = -100
        inputs["attention_mask"] = mask
    if not (labels[:, 1:] != -100).any():  # give the step one target: a loss over no tokens is 0 / 0
        trainable = torch.ones_like(ids, dtype=torch.bool)
        trainable[:, 0] = False
        if "attention_mask" in inputs:
            trainable &= inputs["attention_mask"].bool()
        if "position_ids" in inputs:
            trainable &= inputs["position_ids"] > 0
        row, column = trainable.nonzero()[0].tolist()
        labels[row, column] = ids[row, column]
    return inputs


def _models(case: Case) -> tuple[torch.nn.Module, torch.nn.Module]:
    if case.family in CATALOG:
        reference = build_catalog_model(case.family, seed=case.seed)
    else:
        layers = {"n_layer": case.layers} if case.family == "gpt2" else {"num_hidden_layers": case.layers}
        reference = build_model(case.family, seed=case.seed, **layers)
    if case.lora:
        from peft import LoraConfig, get_peft_model

        if case.family in CATALOG:
            targets = LORA_TARGETS
        else:
            targets = ["c_attn", "c_fc"] if case.family == "gpt2" else ["q_proj", "v_proj", "up_proj"]
        torch.manual_seed(case.seed)
        reference = get_peft_model(reference, LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    model = copy.deepcopy(reference)
    kwargs = {"mlp_chunks": case.mlp_chunks, "lm_head_chunks": case.lm_head_chunks}
    if case.mode == "memo":
        kwargs.update(recompute="memo", offload_fraction=case.offload_fraction)
    elif case.mode == "memo-policy":
        kwargs.update(recompute="memo")
    else:
        kwargs.update(recompute=case.mode)
    hf_memo.apply(model, **kwargs)
    if case.mode == "memo-policy":
        policy = MemoryPolicy(tuple(LayerPolicy(keep, host, alpha) for keep, host, alpha in case.policy))
        hf_memo.memo_runtime(model).assume_policy(policy)
    return model, reference


def run(case: Case) -> float:
    """The worst relative gradient difference from the unpatched model (raises if a loss differs or a gradient
    is present in only one model)."""
    model, reference = _models(case)
    batches = [_batch(case, i) for i in range(case.graphs)]
    num_items = torch.tensor(sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches))
    extra = {"num_items_in_batch": num_items}
    losses = [model(**b, **extra).loss for b in batches]
    if case.retain:
        (0.5 * losses[0]).backward(retain_graph=True)
    for index in case.order:
        losses[index].backward()
    for index, b in enumerate(batches):
        want = reference(**b, **extra, use_cache=False).loss
        torch.testing.assert_close(losses[index].detach(), want.detach(), rtol=1e-6, atol=1e-9)
        if case.retain and index == 0:
            (0.5 * want).backward(retain_graph=True)
        want.backward()
    worst = 0.0
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        ref = ref_params[name]
        assert (param.grad is None) == (ref.grad is None), f"{name}: gradient present in only one model"
        if param.grad is not None:
            scale = float(ref.grad.abs().max())
            worst = max(worst, float((param.grad - ref.grad).abs().max()) / max(scale, GRADIENT_FLOOR))
    return worst


def attends_across_packed_samples(case: Case) -> bool:
    """Whether the unpatched model of a ``"packed"`` ``case`` lets graph 0's packed samples attend to each other:
    its last sample's logits in the packed row differ from the sample's alone (what hf_memo's refusal of such a
    model's packed batches rests on, checked here without hf_memo)."""
    _, reference = _models(case)
    batch = _batch(case, 0)
    last = int((batch["position_ids"][0] == 0).nonzero()[-1])
    reference.eval()
    with torch.no_grad():
        packed = reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        alone = reference(input_ids=batch["input_ids"][:, last:], use_cache=False)
    difference = (packed.logits[:, last:] - alone.logits).abs().max()
    return bool(difference > 1e-4 * alone.logits.abs().max())  # far above fp32 softmax rounding (1e-7)


PACKING_REFUSAL = "builds its attention masks without the position_ids"  # hf_memo.patches.mask_packing


TOLERANCE = 1e-8  # relative to each gradient's largest element, fp64
GRADIENT_FLOOR = 1e-6  # a gradient whose largest element is below this is compared absolutely (rounding noise)


def tolerance(case: Case) -> float:
    """The largest difference :func:`run` may return for ``case``: fp32 rounding for a catalog model that
    computes in fp32 inside (``CatalogModel.fp32_rounded``)."""
    recompute = "memo" if case.mode.startswith("memo") else case.mode
    return FP32_TOLERANCE if case.family in CATALOG and CATALOG[case.family].fp32_rounded(recompute) else TOLERANCE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--catalog", action="store_true", help="draw the models of tests/model_catalog.py")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    failures = 0
    for seed in range(args.first, args.first + args.count):
        case = draw(seed, CATALOG_NAMES if args.catalog else FAMILIES)
        try:
            worst = run(case)
            status = "ok" if worst <= tolerance(case) else f"WRONG {worst:.2e}"
        except ValueError as error:  # a clear refusal is an answer, not a wrong gradient
            status = f"refused: {str(error).splitlines()[0][:100]}"
            worst = 0.0
        except RuntimeError as error:
            if not (case.mode == "selective" and case.retain and "backward an extra time" in str(error)):
                raise
            status, worst = "refused: PyTorch's own retain_graph error (selective checkpointing)", 0.0
        except Exception as error:  # noqa: BLE001 (the search reports every other failure)
            status = f"ERROR {type(error).__name__}: {str(error).splitlines()[0][:100]}"
            worst = float("inf")
        failures += worst > tolerance(case)
        print(f"{status:12.100}  {case}", flush=True)
    print(f"{failures} of {args.count} wrong or crashed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
