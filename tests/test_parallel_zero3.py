"""hf_memo under DeepSpeed ZeRO stage 3 (hf_memo/parallel/zero3.py): exact in every mode, one gather per layer.

Every test runs DeepSpeed itself on CPU (``DS_ACCELERATOR=cpu``) over two gloo processes and compares hf_memo with
the unpatched model under the same ZeRO-3 config: 2 optimizer steps of 2 accumulated micro-batches each, the
loss of every micro-batch and every parameter's full gradient (``deepspeed.utils.safe_get_full_grad``, fp32)
before each step. Parameters are partitioned down to the smallest (``stage3_param_persistence_threshold: 0``),
so no weight escapes ZeRO-3. A mixture-of-experts model (the catalog's Qwen3-MoE, whose sparse MoE blocks
DeepSpeed makes leaf modules) also returns the router aux loss, compared too. Skipped where DeepSpeed is not
installed (``DS_BUILD_OPS=0 pip install deepspeed``).
Run alone with ``python -m pytest -n 0 tests/test_parallel_zero3.py``.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
import torch

import hf_memo
from hf_memo.patches.apply import causal_lm_of
from hf_memo.patches.patching import patch_state
from tests.conftest import build_model, make_batch
from tests.model_catalog import build_catalog_model
from tests.multiprocess import run_processes

pytest.importorskip("deepspeed")

CHUNKS = {"mlp_chunks": 3, "lm_head_chunks": 3}  # 13 tokens: chunks that do not divide S
MODES = {
    "none": {},
    "full": {"recompute": "full"},
    "selective": {"recompute": "selective"},
    "memo alpha=0": {"recompute": "memo", "offload_fraction": 0.0},
    "memo alpha=0.5": {"recompute": "memo", "offload_fraction": 0.5},
    "memo alpha=1": {"recompute": "memo", "offload_fraction": 1.0},
}
MOE = "qwen3_moe"  # router logits on, router_aux_loss_coef 0.25; its sparse MoE blocks are DeepSpeed leaf modules
TOKENS = 13
RELATIVE = 1e-5  # fp32: |got - want| <= 1e-5 * max |want|, per gradient tensor


def zero3_config(accumulation: int = 2, **zero: object) -> dict:
    """A ZeRO-3 config (unless ``stage`` says otherwise): ``accumulation`` micro-batches per step, SGD, every
    parameter partitioned."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }


def _environment(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def _batch(rank: int, step: int, micro: int, sp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks of one sequence-parallel group see one batch; data-parallel ranks see their own."""
    return make_batch(1, TOKENS, seed=100 * step + 10 * micro + (0 if sp > 1 else rank))


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    return get_peft_model(model, config)


class GatherCounter:
    """Counts ZeRO-3's all-gathers per decoder layer (and the LM head + final norm) in forward and in backward.

    Wraps the coordinator's all-gather, through which every fetch and prefetch of module hooks goes.
    ``calls[(owner, phase)]`` is the number of all-gather calls that moved any of ``owner``'s parameters;
    ``moved[(owner, phase)]`` the parameters they moved.
    """

    def __init__(self, owners: dict[str, list[torch.nn.Parameter]]) -> None:
        from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator

        self._class = coordinator.PartitionedParameterCoordinator
        self._name = "_PartitionedParameterCoordinator__all_gather_params"
        self._original = getattr(self._class, self._name)
        self.owner_of = {id(p): name for name, params in owners.items() for p in params}
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.moved: dict[tuple[str, str], set[int]] = defaultdict(set)
        original, counter = self._original, self

        def counted(coordinator_self, params, forward):
            phase = "forward" if forward else "backward"
            owners = {counter.owner_of.get(id(p)) for p in params if p.ds_status.name == "NOT_AVAILABLE"}
            for owner in owners - {None}:
                counter.calls[(owner, phase)] += 1
            for p in params:
                if counter.owner_of.get(id(p)) is not None:
                    counter.moved[(counter.owner_of[id(p)], phase)].add(id(p))
            return original(coordinator_self, params, forward)

        setattr(self._class, self._name, counted)

    def reset(self) -> None:
        self.calls.clear()
        self.moved.clear()

    def close(self) -> None:
        setattr(self._class, self._name, self._original)


def _owners(model: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
    causal_lm = causal_lm_of(model)
    backbone = causal_lm.model
    owners = {f"layer {i}": list(layer.parameters()) for i, layer in enumerate(backbone.layers)}
    owners["lm_head"] = list(causal_lm.lm_head.parameters())
    owners["final norm"] = list(backbone.norm.parameters())
    return owners


def _released(model: torch.nn.Module) -> bool:
    """Whether every parameter below the embeddings is partitioned (a ``[0]`` placeholder) again."""
    causal_lm = causal_lm_of(model)
    params = list(causal_lm.model.layers.parameters()) + list(causal_lm.lm_head.parameters())
    return all(p.ds_status.name == "NOT_AVAILABLE" and p.data.numel() == 0 for p in params)


THREE_HEADS = {"hidden_size": 24, "num_attention_heads": 3, "num_key_value_heads": 3}  # 2 and 1 per rank at sp=2


def _build(name: str, **config: object) -> torch.nn.Module:
    """``build_model("llama", **config)`` or the catalog model ``name``, in fp32."""
    return build_model("llama", dtype=torch.float32, **config) if name == "llama" else build_catalog_model(name).float()


def _loaded_under_zero3(config: dict, folder: str) -> torch.nn.Module:
    """``build_model("llama")`` saved and loaded back with ``from_pretrained`` while transformers' DeepSpeed config
    says ZeRO-3: transformers builds it under ``deepspeed.zero.Init``, so it is partitioned before hf_memo sees it."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    if not os.path.exists(os.path.join(folder, "config.json")):
        build_model("llama", dtype=torch.float32).save_pretrained(folder)  # rank 0 writes
    dist.barrier()
    keep = HfDeepSpeedConfig(config)  # noqa: F841 (transformers holds it weakly)
    try:
        model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    finally:
        unset_hf_deepspeed_config()
    assert all(hasattr(p, "ds_id") and p.data.numel() == 0 for p in model.parameters())
    return model


def _train(
    rank: int,
    memo: dict | None,
    *,
    name: str = "llama",
    sp: int = 1,
    lora: bool = False,
    frozen_embeddings: bool = False,
    count: bool = False,
    folder: str = "",
    accumulation: int = 2,
    config: dict | None = None,
    **zero,
) -> dict:
    """2 optimizer steps x ``accumulation`` micro-batches of model ``name`` (:func:`_build`; hf_memo applied with
    ``memo`` unless None), under ZeRO-3 (``zero`` adds to ``zero_optimization``); from ``folder`` if given (see
    :func:`_loaded_under_zero3`; ``config`` overrides the llama config). Its losses, router aux losses (if any),
    gradients before each step, and the number of DeepSpeed leaf modules."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    ds_config = zero3_config(accumulation, **zero)
    model = _loaded_under_zero3(ds_config, folder) if folder else _build(name, **(config or {}))
    if lora:
        model = _lora(model)
    if frozen_embeddings:  # the first layer's hidden states need no gradient
        model.get_input_embeddings().requires_grad_(False)
    if memo is not None:
        hf_memo.apply(model, **memo, **CHUNKS, sequence_parallel_size=sp)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config)
    counter = GatherCounter(_owners(engine.module)) if count else None
    result: dict = {"losses": [], "aux_losses": [], "grads": [], "calls": [], "released": []}
    result["leaves"] = sum(getattr(m, "_z3_leaf", False) for m in engine.module.modules())
    state = patch_state(causal_lm_of(engine.module))
    try:
        for step in range(2):
            if counter is not None:
                counter.reset()
            for micro in range(accumulation):
                ids, labels = _batch(rank, step, micro, sp)
                out = engine(input_ids=ids, labels=labels)
                loss = out.loss
                if getattr(out, "aux_loss", None) is not None:
                    result["aux_losses"].append(out.aux_loss.detach().clone())
                if counter is not None:
                    result["released"].append(_released(engine.module))
                engine.backward(loss)
                if counter is not None:
                    result["released"].append(_released(engine.module))
                result["losses"].append(loss.detach().clone())
            grads = {}
            for name, param in engine.module.named_parameters():
                if param.requires_grad:
                    grads[name] = safe_get_full_grad(param).clone()
            result["grads"].append(grads)
            if counter is not None:
                result["calls"].append(dict(counter.calls))
                result["moved"] = {k: len(v) for k, v in counter.moved.items()}
                result["sizes"] = {name: len(params) for name, params in _owners(engine.module).items()}
            engine.step()
    finally:
        if counter is not None:
            counter.close()
    result["self_checked"] = None if state is None else set(state.self_check.checked)
    return result


def _assert_same(got: dict, want: dict, what: str) -> None:
    for kind in ("losses", "aux_losses"):
        for i, (loss, reference) in enumerate(zip(got[kind], want[kind], strict=True)):
            torch.testing.assert_close(
                loss, reference, rtol=RELATIVE, atol=0, msg=lambda m, i=i, kind=kind: f"{what}, {kind} {i}: {m}"
            )
    for step, (grads, reference) in enumerate(zip(got["grads"], want["grads"], strict=True)):
        assert grads.keys() == reference.keys() and grads, what
        for name, grad in reference.items():
            error = (grads[name] - grad).abs().max().item()
            scale = grad.abs().max().item()
            assert error <= RELATIVE * scale, (
                f"{what}, step {step}, {name}: |diff| {error:.3g} vs max |grad| {scale:.3g}"
            )


def _modes_worker(rank: int, world: int) -> dict:
    _environment(rank, world)
    # No prefetch and no reuse: every gather is one a module asked for, every release happens when allowed.
    exact = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}
    results = {"unpatched": _train(rank, None, count=True, **exact)}
    for name, memo in MODES.items():
        results[name] = _train(rank, memo, count=True, **exact)
    return results


def test_every_mode_is_exact_under_zero3_and_gathers_each_layer_once_per_pass(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for rank, results in enumerate(run_processes(_modes_worker, 2)):
        reference = results.pop("unpatched")
        # The unpatched model gathers each submodule on its own: several all-gathers per layer and pass.
        assert all(reference["calls"][1][(f"layer {i}", "forward")] > 1 for i in range(2))
        assert len(reference["released"]) == 8 and all(reference["released"])
        for name, got in results.items():
            _assert_same(got, reference, f"rank {rank}, {name}")
            assert len(got["released"]) == 8 and all(got["released"]), f"{name}: parameters left gathered"
            assert got["self_checked"] == {"plain"}, f"{name}: the self-check did not run under ZeRO-3"
            for step, calls in enumerate(got["calls"][1:], start=1):  # (the first step also runs the self-check)
                for phase in ("forward", "backward"):
                    for owner in ("layer 0", "layer 1", "lm_head"):
                        n = calls[(owner, phase)] / 2  # two micro-batches per step
                        assert n == 1, f"{name}, step {step}: {owner} gathered {n} times per {phase}"
                    # The final norm (H elements) once more: the backbone's own call of it, a pass-through here.
                    assert calls[("final norm", phase)] / 2 == 2
            for owner, size in got["sizes"].items():
                assert got["moved"][(owner, "forward")] == size and got["moved"][(owner, "backward")] == size


def _variants_worker(rank: int, world: int, folder: str) -> dict:
    """DeepSpeed's default prefetch and reuse settings here (in-flight prefetches meet hf_memo's gathers)."""
    _environment(rank, world)
    memo = MODES["memo alpha=0.5"]
    offload = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}, "folder": folder}
    return {
        "lora": (_train(rank, None, lora=True), _train(rank, memo, lora=True)),
        "sp=2": (_train(rank, None, sp=2), _train(rank, memo, sp=2)),
        "sp=2, 3 heads": (_train(rank, None, sp=2, config=THREE_HEADS), _train(rank, memo, sp=2, config=THREE_HEADS)),
        "zero.Init + cpu offload": (_train(rank, None, **offload), _train(rank, memo, **offload)),
        # ZeRO-2 (parameters whole) keeps its gradients readable after one micro-batch per step only
        "zero stage 2": (_train(rank, None, stage=2, accumulation=1), _train(rank, memo, stage=2, accumulation=1)),
    }


def test_lora_sequence_parallelism_zero_init_and_cpu_offload_are_exact_under_zero3(monkeypatch, tmp_path):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for rank, results in enumerate(run_processes(_variants_worker, 2, str(tmp_path))):
        for name, (want, got) in results.items():
            _assert_same(got, want, f"rank {rank}, {name}")
        assert all("lora_" in n for n in results["lora"][1]["grads"][0])  # only the adapters train


def _moe_worker(rank: int, world: int) -> dict:
    _environment(rank, world)
    memo, reference = MODES["memo alpha=1"], _train(rank, None, name=MOE)
    return {
        "none": (reference, _train(rank, MODES["none"], name=MOE)),
        "memo alpha=1": (reference, _train(rank, memo, name=MOE)),
        "memo alpha=1, frozen embeddings": (
            _train(rank, None, name=MOE, frozen_embeddings=True),
            _train(rank, memo, name=MOE, frozen_embeddings=True),
        ),
    }


def test_moe_model_with_its_router_aux_loss_is_exact_under_zero3(monkeypatch):
    """DeepSpeed reduces a leaf module's gradients once per call of the module, where hf_memo calls it per chunk:
    hf_memo runs that reduction once per backward of the layer instead (in every mode, the memo executor's
    chunks differentiated one by one included, and where the first layer's input needs no gradient)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for rank, results in enumerate(run_processes(_moe_worker, 2)):
        for name, (want, got) in results.items():
            assert want["leaves"] == got["leaves"] == 2  # DeepSpeed's defaults make both MoE blocks leaf modules
            assert got["self_checked"] == {"plain"}  # its probe ran no leaf reduction of the step's
            assert len(want["aux_losses"]) == 4 and len(set(map(float, want["aux_losses"]))) == 4
            _assert_same(got, want, f"rank {rank}, {name}")
        assert not any("embed" in name for name in results["memo alpha=1, frozen embeddings"][1]["grads"][0])


def test_apply_under_a_zero3_config_registers_each_region_and_revert_removes_it():
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    plain = hf_memo.apply(build_model("llama"))
    assert not any(hasattr(m, "_external_params") for m in plain.modules())  # no ZeRO-3: nothing registered
    keep = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})  # noqa: F841
    try:
        model = hf_memo.apply(build_model("llama"), recompute="memo")
    finally:
        unset_hf_deepspeed_config()
    for layer in model.model.layers:
        assert {id(p) for p in layer._external_params.values()} == {id(p) for p in layer.parameters()}
    assert list(model.lm_head._external_params.values()) == [model.model.norm.weight]
    hf_memo.revert(model)
    assert all(not getattr(m, "_external_params", {}) for m in model.modules())
