"""Sequence-parallel training on 2 and 4 CPU processes against the single-process unpatched model.

Every case compares the loss on every rank and every parameter gradient, after the data-parallel
average over the world that DDP applies (or with the model actually wrapped in DDP), with plain
Hugging Face on the whole batch. Besides the five families of ``tests.conftest``, models of the catalog
(``tests/model_catalog.py``) bring the attention traits and layer layouts of other families: a sliding window
shorter than the sequence, soft-capped scores, sinks, a parallel and a post-norm layout, a mixture-of-experts
model without its router loss (which sequence parallelism refuses). Bad input must fail on every rank, before
the step does anything.
Each process group is started once per test (starting one costs seconds), and a test reports every
failing case, not just the first.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM

import hf_memo
from hf_memo.runtime.arena import ArenaWarning
from tests.conftest import assert_same_grads, build_model, make_batch
from tests.model_catalog import CATALOG, build_catalog_model
from tests.multiprocess import run_processes
from tests.test_parallel_ulysses import assert_exact, exchange_results
from tests.test_patches_structure import assert_grads_within_fp32_rounding

CHUNKS = dict(mlp_chunks=2, lm_head_chunks=3)
MEMO = dict(recompute="memo", offload_fraction=0.5)  # 4 layers: the first two are swapped to the host
THREE_HEADS = dict(hidden_size=24, num_attention_heads=3, num_key_value_heads=3)  # uneven at sp=2
# 10 query heads in 2 groups of 5: at sp=3 ranks attend with 4, 3, 3 query heads and rank 1 with both KV heads
TEN_HEADS = dict(hidden_size=40, num_attention_heads=10, num_key_value_heads=2)
SIX_HEADS = dict(hidden_size=24, num_attention_heads=6, num_key_value_heads=2)  # at sp=4: 2, 2, 1, 1; a group straddles


@dataclass
class Case:
    """One training step to run sequence-parallel and compare with the unpatched model."""

    family: str
    ids: torch.Tensor
    labels: torch.Tensor
    overrides: dict = field(default_factory=dict)
    kwargs: dict = field(default_factory=dict)
    ddp: bool = False
    checkpointing: bool = False
    memo: dict = field(default_factory=dict)  # MemoConfig fields for the sequence-parallel model
    catalog: bool = False  # ``family`` names a catalog model (fp64); ``overrides`` are set on its config


def _build(case: Case) -> torch.nn.Module:
    """The unpatched model of ``case`` (with the attention implementation of its family)."""
    if not case.catalog:
        return build_model(case.family, **case.overrides)
    model = build_catalog_model(case.family)
    for name, value in case.overrides.items():
        setattr(model.config, name, value)
    return model


def _catalog_case(name: str, memo: dict | None = None, **overrides) -> Case:
    """Catalog model ``name`` on 2 rows of 21 tokens (longer than its sliding windows, padded for sp=2 and 4)."""
    return Case(name, *make_batch(2, 21), overrides=overrides, memo=memo or {}, catalog=True)


def _batch_case(family, batch, seq, masked=0.3, **overrides):
    return Case(family, *make_batch(batch, seq, masked), overrides=overrides)


def _packed_case(family, rows, memo=None, catalog=False, **overrides):
    """Rows of packed samples (``rows``: each row's sample lengths, equal sums), positions restarting."""
    gen = torch.Generator().manual_seed(sum(map(sum, rows)))
    ids = torch.stack([torch.randint(3, 101, (sum(lengths),), generator=gen) for lengths in rows])
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])
    labels = ids.masked_fill(positions == 0, -100)  # a sample's first token is nobody's target
    labels[0, 2] = -100
    kwargs = {"position_ids": positions}
    return Case(family, ids, labels, overrides=overrides, kwargs=kwargs, memo=memo or {}, catalog=catalog)


def _left_padded_case(memo=None, **overrides):
    ids, labels = make_batch(2, 13, 0.2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    labels[1, :5] = -100  # the last padding token still predicts the first real one
    return Case("llama", ids, labels, overrides=overrides, kwargs={"attention_mask": mask}, memo=memo or {})


def two_rank_cases() -> dict[str, Case]:
    fully_masked = make_batch(2, 16, 0.2)
    fully_masked[1][:, 8:] = -100  # rank 1's shard (tokens 8..15) has no target at all
    padded_ids, padded_labels = make_batch(2, 12, 0.2)
    mask = torch.ones_like(padded_ids)
    mask[1, 8:] = 0
    padded_labels[1, 8:] = -100
    ids, labels = make_batch(2, 14)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    shift[0, 3] = 5  # differs from shifting `labels`: using them is observable
    return {
        "llama, 1 KV head < sp (replicated)": _batch_case("llama", 2, 16, num_key_value_heads=1),
        "llama, 2 KV heads = sp, S padded": _batch_case("llama", 2, 13),
        "llama, 4 KV heads > sp": _batch_case("llama", 1, 16, num_key_value_heads=4),
        "mistral": _batch_case("mistral", 2, 10),
        "qwen2": _batch_case("qwen2", 1, 11),
        "qwen3": _batch_case("qwen3", 2, 12),
        "gpt2, S padded": _batch_case("gpt2", 2, 15),
        "llama, most labels masked": _batch_case("llama", 3, 9, 0.8),
        "rank 1's shard fully masked": Case("llama", *fully_masked),
        "right padding with attention_mask": Case("llama", padded_ids, padded_labels, kwargs={"attention_mask": mask}),
        "shift_labels given": Case("qwen2", ids, labels, kwargs={"shift_labels": shift}),
        "num_items_in_batch given": Case("llama", ids, labels, kwargs={"num_items_in_batch": torch.tensor(40)}),
        "HF gradient checkpointing": Case("llama", ids, labels, checkpointing=True),
        "wrapped in DDP": Case("gpt2", ids, labels, ddp=True),
        "memo executor, llama, 1 KV head, S padded": Case(
            "llama", *make_batch(2, 15), overrides={"num_key_value_heads": 1, "num_hidden_layers": 4}, memo=MEMO
        ),
        "memo executor, gpt2": Case("gpt2", *make_batch(2, 16), overrides={"n_layer": 4}, memo=MEMO),
        "3 heads at sp=2 (2 and 1 per rank), S padded": _batch_case("llama", 2, 13, **THREE_HEADS),
        "3 heads at sp=2, memo executor, packed": _packed_case("llama", [(4, 7, 3), (9, 5)], memo=MEMO, **THREE_HEADS),
        "packed, borders on and inside shards": _packed_case("llama", [(5, 3, 6, 2), (1, 9, 6)]),
        "packed, S padded, gpt2": _packed_case("gpt2", [(4, 7, 4)]),
        "left padding": _left_padded_case(),
        "packed samples, then padding": Case(
            "llama",
            torch.arange(3, 17)[None],
            torch.tensor([[-100, 4, 5, -100, 7, 8, 9, 10, -100, 12, 13, -100, -100, -100]]),
            kwargs={
                "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 0, 0, 0]]),
                "attention_mask": torch.tensor([[1] * 11 + [0] * 3]),
            },
        ),
        "packed, selective recompute (attention recomputed in backward)": _packed_case(
            "qwen3", [(6, 3, 3), (2, 10)], memo={"recompute": "selective"}
        ),
        "memo executor, packed, S padded": _packed_case(
            "qwen2", [(5, 3, 7), (8, 7)], memo=MEMO, num_hidden_layers=4, num_key_value_heads=1
        ),
        "memo executor, left padding": _left_padded_case(memo=MEMO, num_hidden_layers=4),
        "memo executor with the memory planner": Case(
            "llama", *make_batch(2, 16), overrides={"num_hidden_layers": 4}, memo={**MEMO, "planner": "greedy"}
        ),
        "memo executor, alpha solved (calibration runs the all-to-alls on every rank)": Case(
            "llama", *make_batch(2, 16), overrides={"num_hidden_layers": 4}, memo={"recompute": "memo"}
        ),
        **catalog_cases(),
    }


def catalog_cases() -> dict[str, Case]:
    """Catalog models under sp=2, in no recompute and under the memo executor.

    Gemma 2 (soft-capped scores) and gpt-oss (sinks) run their eager attention: Ulysses wraps it with hf_memo's
    attention core in training (no recompute) and the memo executor's core attends with the same traits.
    """
    memo = dict(recompute="memo", offload_fraction=0.5)  # 2-3 layers: the first is swapped to the host
    return {
        "catalog mistral-window (window < S)": _catalog_case("mistral-window"),
        "catalog mistral-window, selective recompute": _catalog_case("mistral-window", {"recompute": "selective"}),
        "catalog mistral-window, memo executor": _catalog_case("mistral-window", memo),
        "catalog mistral-window, memo executor, packed": _packed_case(
            "mistral-window", [(12, 3, 6), (2, 19)], memo=memo, catalog=True
        ),
        "catalog cohere (parallel attention and MLP)": _catalog_case("cohere"),
        "catalog cohere, memo executor": _catalog_case("cohere", memo),
        "catalog olmo2 (post-norm)": _catalog_case("olmo2"),
        "catalog olmo2, memo executor": _catalog_case("olmo2", memo),
        "catalog gemma2 (soft-capped scores, eager)": _catalog_case("gemma2"),
        "catalog gemma2, memo executor": _catalog_case("gemma2", memo),
        "catalog gpt_oss (sinks, eager, dense path)": _catalog_case("gpt_oss", output_router_logits=False),
        "catalog gpt_oss, memo executor": _catalog_case("gpt_oss", memo, output_router_logits=False),
        "catalog qwen3_moe without its router loss, memo executor": _catalog_case(
            "qwen3_moe", memo, output_router_logits=False
        ),
    }


def four_rank_cases() -> dict[str, Case]:
    return {
        "sp=4, llama, 2 KV heads (replicated), S padded": _batch_case("llama", 2, 18),
        "sp=4, gpt2": _batch_case("gpt2", 1, 16),
        "sp=4, qwen3, 4 KV heads": _batch_case("qwen3", 2, 8, num_key_value_heads=4),
        "sp=4, S=3 shorter than sp": _batch_case("mistral", 2, 3, 0.0),
        "sp=4, packed, S padded": _packed_case("mistral", [(5, 6, 7), (2, 3, 13)]),
        "sp=4, memo executor, packed": _packed_case("llama", [(3, 5, 2, 6)], memo=MEMO, num_hidden_layers=4),
        "sp=4, memo executor, qwen3": Case("qwen3", *make_batch(2, 16), overrides={"num_hidden_layers": 4}, memo=MEMO),
        "sp=4, 6 heads in 2 groups (uneven, a group straddles ranks), S padded": _batch_case(
            "llama", 2, 14, **SIX_HEADS
        ),
        "sp=4, 6 heads, memo executor, packed": _packed_case(
            "qwen2", [(3, 9, 4), (7, 9)], memo=MEMO, num_hidden_layers=4, **SIX_HEADS
        ),
    }


def three_rank_cases() -> dict[str, Case]:
    """sp=3 on 10 query heads in 2 groups of 5, every mode, padded and packed batches, and under DDP."""
    return {
        "sp=3, no recompute, S padded": _batch_case("llama", 2, 13, **TEN_HEADS),
        "sp=3, full recompute, left padding": _left_padded_case(memo={"recompute": "full"}, **TEN_HEADS),
        "sp=3, selective recompute, packed": _packed_case(
            "llama", [(5, 6, 4), (8, 7)], memo={"recompute": "selective"}, **TEN_HEADS
        ),
        "sp=3, memo executor offload 0, packed, qwen2": _packed_case(
            "qwen2", [(2, 9, 4), (11, 4)], memo={"recompute": "memo", "offload_fraction": 0.0}, **TEN_HEADS
        ),
        "sp=3, memo executor offload 1, left padding": _left_padded_case(
            memo={"recompute": "memo", "offload_fraction": 1.0}, **TEN_HEADS
        ),
        "sp=3, wrapped in DDP": Case("llama", *make_batch(2, 12), overrides=TEN_HEADS, ddp=True),
    }


def _replica_batch(replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    return make_batch(2, 11, seed=10 + replica)


def _averaged_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gradient averaged over the world, as DDP does."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad)
        grads[name] = grad / dist.get_world_size()
    return grads


def _sp_step(case: Case, sp: int) -> dict:
    model = _build(case)
    if case.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_memo.apply(model, sequence_parallel_size=sp, **CHUNKS, **case.memo)
    runner = DistributedDataParallel(model) if case.ddp else model
    with warnings.catch_warnings():
        warnings.simplefilter("error", ArenaWarning)  # a plan that does not fit this rank's shard would warn
        loss = runner(input_ids=case.ids, labels=case.labels, **case.kwargs).loss
        loss.backward()
    if case.memo.get("planner", "off") != "off":
        assert hf_memo.memo_runtime(model).memory_plan.meta["seq_len"] == -(-case.ids.shape[1] // sp)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()} if case.ddp else _averaged_grads(model)
    return {"loss": loss.detach(), "grads": grads}


def _expect_error(action) -> str:
    try:
        action()
    except ValueError as error:
        return str(error)
    return "no error"


def _two_rank_worker(rank, world):
    results = {name: _sp_step(case, 2) for name, case in two_rank_cases().items()}

    model = hf_memo.apply(build_model("llama"), sequence_parallel_size=2, **CHUNKS)
    ids, labels = make_batch(2, 12)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    results["eval logits"] = model.eval()(input_ids=ids, attention_mask=mask).logits.detach()
    layer = model.model.layers[0].self_attn
    results["attention while patched"] = (layer.config._attn_implementation, model.config._attn_implementation)
    hf_memo.revert(model)
    results["attention after revert"] = (layer.config is model.config, layer.config._attn_implementation)

    def different_batches():
        own_ids, own_labels = make_batch(1, 8, seed=rank)
        hf_memo.apply(build_model("llama"), sequence_parallel_size=2)(input_ids=own_ids, labels=own_labels)

    one_head = dict(num_attention_heads=1, num_key_value_heads=1)
    routed = build_catalog_model("qwen3_moe")  # output_router_logits on
    results["errors"] = {
        "router aux loss": _expect_error(
            lambda: hf_memo.apply(routed, sequence_parallel_size=2)(input_ids=ids, labels=labels)
        ),
        "world size": _expect_error(lambda: hf_memo.apply(build_model("llama"), sequence_parallel_size=4)),
        "heads": _expect_error(lambda: hf_memo.apply(build_model("llama", **one_head), sequence_parallel_size=2)),
        "flex attention": _expect_error(
            lambda: hf_memo.apply(build_model("llama", attn_implementation="flex_attention"), sequence_parallel_size=2)
        ),
        "different batches": _expect_error(different_batches),
        "training without labels": _expect_error(
            lambda: hf_memo.apply(build_model("llama"), sequence_parallel_size=2)(input_ids=ids)
        ),
    }
    return results


def _four_rank_worker(rank, world):
    results = {name: _sp_step(case, 4) for name, case in four_rank_cases().items()}
    ids, labels = _replica_batch(rank // 2)  # ranks 0, 1 train on one batch, ranks 2, 3 on another
    replicas = Case("llama", ids, labels, overrides={"num_key_value_heads": 1}, ddp=True)
    results["2 replicas x sp=2, DDP"] = _sp_step(replicas, 2)
    return results


def _three_rank_worker(rank, world):
    results = {name: _sp_step(case, 3) for name, case in three_rank_cases().items()}
    results["exchange"] = exchange_results((3,))
    return results


def _reference(case: Case) -> tuple[torch.nn.Module, torch.Tensor]:
    model = _build(case)
    kwargs = dict(case.kwargs)
    if "position_ids" in kwargs:  # packed: transformers keeps samples apart only without a mask (the padding at
        kwargs.pop("attention_mask", None)  # the end then forms samples of its own, with no target)
    out = model(input_ids=case.ids, labels=case.labels, use_cache=False, **kwargs)  # no cache: no cross-sample
    out.loss.backward()
    return model, out.loss.detach()


def _compare(got: dict, want_loss: torch.Tensor, want_grads: dict, case: Case, rounded: bool = False) -> None:
    """Loss and gradients as the unpatched model's (to fp32 rounding where ``rounded``, or for a catalog model that
    computes in fp32 inside: ``CatalogModel.fp32_rounded``)."""
    assert torch.isfinite(got["loss"]), f"loss is {got['loss']}"
    torch.testing.assert_close(got["loss"], want_loss, rtol=1e-6, atol=0)
    model, reference = _build(case), _build(case)
    for (param_name, param), ref in zip(model.named_parameters(), reference.parameters()):
        param.grad, ref.grad = got["grads"][param_name], want_grads[param_name]
    if rounded or (case.catalog and CATALOG[case.family].fp32_rounded(case.memo.get("recompute", "none"))):
        assert_grads_within_fp32_rounding(model, reference)
    else:
        assert_same_grads(model, reference)


def _failures(per_rank: list[dict], cases: dict[str, Case], rounded: bool = False) -> list[str]:
    """Every (case, rank) whose loss or gradients differ from the unpatched model's, with the reason (``rounded``:
    gradients to fp32 rounding)."""
    failures = []
    for name, case in cases.items():
        reference, loss = _reference(case)
        grads = {n: p.grad for n, p in reference.named_parameters()}
        for rank, results in enumerate(per_rank):
            try:
                _compare(results[name], loss, grads, case, rounded)
            except AssertionError as error:
                failures.append(f"{name}, rank {rank}: {error}")
    return failures


def test_two_ranks_match_single_process_and_refuse_bad_input_on_every_rank():
    per_rank = run_processes(_two_rank_worker, 2)
    failures = _failures(per_rank, two_rank_cases())

    ids, _ = make_batch(2, 12)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    want = build_model("llama").eval()(input_ids=ids, attention_mask=mask).logits
    expected_errors = {
        "router aux loss": "does not compute the router aux loss under sequence parallelism",
        "world size": "MemoConfig.sequence_parallel_size=4 must divide the world size 2",
        "heads": "sequence_parallel_size=2 exceeds the model's num_attention_heads=1 (Ulysses gives every rank at "
        "least one query head); the largest degree for this model is 1",
        "flex attention": "attn_implementation to be one of sdpa, flash_attention_2",
        "different batches": "ranks of a sequence-parallel group must get the same batch",
        "training without labels": "a training forward must compute the loss",
    }
    for rank, results in enumerate(per_rank):
        if not torch.allclose(results["eval logits"], want):
            failures.append(f"rank {rank}: evaluation (unsplit, with the padding mask) differs from unpatched")
        if results["attention while patched"] != ("hf_memo_ulysses_sp2_sdpa", "sdpa"):
            failures.append(f"rank {rank}: attention while patched is {results['attention while patched']}")
        if results["attention after revert"] != (True, "sdpa"):
            failures.append(f"rank {rank}: attention after revert is {results['attention after revert']}")
        for error, expected in expected_errors.items():
            if expected not in results["errors"][error]:
                failures.append(f"rank {rank}, {error}: expected {expected!r}, got {results['errors'][error]!r}")
    assert not failures, "\n".join(failures)


def test_four_ranks_match_single_process_and_replicas_average_under_ddp():
    per_rank = run_processes(_four_rank_worker, 4)
    failures = _failures(per_rank, four_rank_cases())

    replicas = [Case("llama", *_replica_batch(r), overrides={"num_key_value_heads": 1}) for r in (0, 1)]
    references = [_reference(case) for case in replicas]
    replica_grads = [{n: p.grad for n, p in model.named_parameters()} for model, _ in references]
    averaged = {name: (replica_grads[0][name] + replica_grads[1][name]) / 2 for name in replica_grads[0]}
    for rank, results in enumerate(per_rank):
        try:
            got = results["2 replicas x sp=2, DDP"]
            _compare(got, references[rank // 2][1], averaged, replicas[rank // 2])
        except AssertionError as error:
            failures.append(f"2 replicas x sp=2 under DDP, rank {rank}: {error}")
    assert not failures, "\n".join(failures)


def test_three_ranks_split_ten_heads_unevenly_and_match_single_process_in_every_mode():
    """4, 3 and 3 query heads per rank; the group of KV head 0 straddles ranks 0 and 1, that of KV head 1 ranks 1
    and 2, so KV heads are repeated to one per query head after the exchange. The exchanges themselves and the
    attention cores at sp=3 as well (``tests/test_parallel_ulysses.py``, exact in fp64).

    Gradients to fp32 rounding: the loss is an fp32 cross-entropy (as transformers') and every rank back-propagates
    the group's sum, so its backward runs on ``3 x`` the gradient in fp32 before the data-parallel average divides
    by 3 (exact for 2 and 4 ranks only)."""
    per_rank = run_processes(_three_rank_worker, 3)
    assert_exact([results.pop("exchange") for results in per_rank], (3,))
    failures = _failures(per_rank, three_rank_cases(), rounded=True)
    assert not failures, "\n".join(failures)


def test_without_a_process_group_training_fails_before_the_step():
    model = hf_memo.apply(build_model("llama"), sequence_parallel_size=2)
    ids, labels = make_batch(1, 8)
    with pytest.raises(ValueError, match="sequence_parallel_size=2 needs torch.distributed, but no process group"):
        model(input_ids=ids, labels=labels)
    assert all(p.grad is None for p in model.parameters())


def test_apply_checks_heads_and_attention_without_a_process_group():
    config = LlamaConfig(
        hidden_size=24, num_attention_heads=3, num_key_value_heads=3, num_hidden_layers=1, vocab_size=11
    )
    model = LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="the largest degree for this model is 3"):
        hf_memo.apply(model, sequence_parallel_size=4)
    assert hf_memo.applied_config(model) is None and model.config._attn_implementation == "sdpa"


def test_a_model_sharing_the_config_keeps_its_own_attention():
    first = build_model("llama")
    second = LlamaForCausalLM(first.config).double()
    hf_memo.apply(first, sequence_parallel_size=2)
    assert first.config is second.config and second.config._attn_implementation == "sdpa"
    assert second.model.layers[0].self_attn.config is second.config
    ids, labels = make_batch(1, 8)
    second(input_ids=ids, labels=labels).loss.backward()  # unpatched: no process group needed


def test_a_patched_model_can_be_deep_copied():
    model = hf_memo.apply(build_model("llama"), sequence_parallel_size=2)
    twin = copy.deepcopy(model)
    layer = twin.model.layers[1].self_attn
    assert layer.config._config is twin.config and layer.config._attn_implementation == "hf_memo_ulysses_sp2_sdpa"
    ids, _ = make_batch(1, 8)
    torch.testing.assert_close(twin.eval()(input_ids=ids).logits, model.eval()(input_ids=ids).logits)
