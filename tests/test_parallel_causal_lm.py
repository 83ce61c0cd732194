"""Sequence-parallel training on 2 and 4 CPU processes against the single-process unpatched model.

Every case compares the loss on every rank and every parameter gradient, after the data-parallel
average over the world that DDP applies (or with the model actually wrapped in DDP), with plain
Hugging Face on the whole batch. Bad input must fail on every rank, before the step does anything.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM

import hf_memo
from tests.conftest import assert_same_grads, build_model, make_batch
from tests.multiprocess import run_processes

CHUNKS = dict(mlp_chunks=2, lm_head_chunks=3)

# name -> (family, config overrides, batch, seq, fraction of masked labels)
TWO_RANK_CASES = {
    "llama, 1 KV head < sp (replicated)": ("llama", {"num_key_value_heads": 1}, 2, 16, 0.3),
    "llama, 2 KV heads = sp, S padded": ("llama", {}, 2, 13, 0.3),
    "llama, 4 KV heads > sp": ("llama", {"num_key_value_heads": 4}, 1, 16, 0.3),
    "mistral": ("mistral", {}, 2, 10, 0.3),
    "qwen2": ("qwen2", {}, 1, 11, 0.3),
    "qwen3": ("qwen3", {}, 2, 12, 0.3),
    "gpt2, S padded": ("gpt2", {}, 2, 15, 0.3),
    "llama, most labels masked": ("llama", {}, 3, 9, 0.8),
}
FOUR_RANK_CASES = {
    "sp=4, llama, 2 KV heads (replicated), S padded": ("llama", {}, 2, 18, 0.3),
    "sp=4, gpt2": ("gpt2", {}, 1, 16, 0.3),
    "sp=4, qwen3, 4 KV heads": ("qwen3", {"num_key_value_heads": 4}, 2, 8, 0.3),
    "sp=4, S=3 shorter than sp": ("mistral", {}, 2, 3, 0.0),
}


def _averaged_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gradient averaged over the world, as DDP does."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad)
        grads[name] = grad / dist.get_world_size()
    return grads


def _sp_step(family, overrides, sp, ids, labels, wrap_ddp=False, checkpointing=False, **kwargs):
    model = build_model(family, **overrides)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_memo.apply(model, sequence_parallel_size=sp, **CHUNKS)
    runner = DistributedDataParallel(model) if wrap_ddp else model
    loss = runner(input_ids=ids, labels=labels, **kwargs).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()} if wrap_ddp else _averaged_grads(model)
    return {"loss": loss.detach(), "grads": grads}


def _expect_error(action) -> str:
    try:
        action()
    except ValueError as error:
        return str(error)
    return "no error"


def _two_rank_worker(rank, world):
    results = {}
    for name, (family, overrides, batch, seq, masked) in TWO_RANK_CASES.items():
        ids, labels = make_batch(batch, seq, masked)
        results[name] = _sp_step(family, overrides, 2, ids, labels)

    ids, labels = make_batch(2, 16, 0.2)
    labels[:, 8:] = -100  # rank 1's shard (tokens 8..15) has no target at all
    results["rank 1's shard fully masked"] = _sp_step("llama", {}, 2, ids, labels)

    ids, labels = make_batch(2, 12, 0.2)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    labels[1, 8:] = -100
    results["right padding with attention_mask"] = _sp_step("llama", {}, 2, ids, labels, attention_mask=mask)

    ids, labels = make_batch(2, 14)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    shift[0, 3] = 5
    results["shift_labels given"] = _sp_step("qwen2", {}, 2, ids, labels, shift_labels=shift)
    results["num_items_in_batch given"] = _sp_step("llama", {}, 2, ids, labels, num_items_in_batch=torch.tensor(40))
    results["HF gradient checkpointing"] = _sp_step("llama", {}, 2, ids, labels, checkpointing=True)
    results["wrapped in DDP"] = _sp_step("gpt2", {}, 2, ids, labels, wrap_ddp=True)

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

    results["errors"] = {
        "world size": _expect_error(lambda: hf_memo.apply(build_model("llama"), sequence_parallel_size=4)),
        "heads": _expect_error(
            lambda: hf_memo.apply(
                build_model("llama", hidden_size=24, num_attention_heads=3, num_key_value_heads=3),
                sequence_parallel_size=2,
            )
        ),
        "eager attention": _expect_error(
            lambda: hf_memo.apply(build_model("llama", attn_implementation="eager"), sequence_parallel_size=2)
        ),
        "different batches": _expect_error(different_batches),
        "training without labels": _expect_error(
            lambda: hf_memo.apply(build_model("llama"), sequence_parallel_size=2)(input_ids=ids)
        ),
    }
    return results


def _four_rank_worker(rank, world):
    results = {}
    for name, (family, overrides, batch, seq, masked) in FOUR_RANK_CASES.items():
        ids, labels = make_batch(batch, seq, masked)
        results[name] = _sp_step(family, overrides, 4, ids, labels)
    replica = rank // 2  # ranks 0, 1 train on one batch, ranks 2, 3 on another
    ids, labels = make_batch(2, 11, seed=10 + replica)
    results["2 replicas x sp=2, DDP"] = _sp_step("llama", {"num_key_value_heads": 1}, 2, ids, labels, wrap_ddp=True)
    return results


def _reference(family, overrides, ids, labels, **kwargs):
    model = build_model(family, **overrides)
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return model, out.loss.detach()


def _check(case, per_rank, family, overrides, ids, labels, **kwargs):
    reference, loss = _reference(family, overrides, ids, labels, **kwargs)
    for rank, results in enumerate(per_rank):
        got = results[case]
        assert torch.isfinite(got["loss"]), f"{case}: rank {rank} loss is {got['loss']}"
        torch.testing.assert_close(got["loss"], loss, rtol=1e-6, atol=0, msg=lambda m, r=rank: f"{case}, rank {r}: {m}")
    model = build_model(family, **overrides)
    for name, param in model.named_parameters():
        param.grad = per_rank[0][case]["grads"][name]
        for rank, results in enumerate(per_rank[1:], start=1):
            torch.testing.assert_close(
                results[case]["grads"][name], param.grad, msg=lambda m, r=rank, n=name: f"{case}, rank {r}, {n}: {m}"
            )
    assert_same_grads(model, reference)


@pytest.fixture(scope="module")
def two_ranks():
    return run_processes(_two_rank_worker, 2)


@pytest.fixture(scope="module")
def four_ranks():
    return run_processes(_four_rank_worker, 4)


@pytest.mark.parametrize("case", list(TWO_RANK_CASES))
def test_two_ranks_match_single_process(two_ranks, case):
    family, overrides, batch, seq, masked = TWO_RANK_CASES[case]
    _check(case, two_ranks, family, overrides, *make_batch(batch, seq, masked))


def test_a_shard_without_targets_adds_nothing_and_no_nan(two_ranks):
    ids, labels = make_batch(2, 16, 0.2)
    labels[:, 8:] = -100
    _check("rank 1's shard fully masked", two_ranks, "llama", {}, ids, labels)


def test_right_padding_mask_is_exact(two_ranks):
    ids, labels = make_batch(2, 12, 0.2)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    labels[1, 8:] = -100
    _check("right padding with attention_mask", two_ranks, "llama", {}, ids, labels, attention_mask=mask)


def test_shift_labels_and_num_items_in_batch_are_honoured(two_ranks):
    ids, labels = make_batch(2, 14)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    shift[0, 3] = 5
    _check("shift_labels given", two_ranks, "qwen2", {}, ids, labels, shift_labels=shift)
    _check("num_items_in_batch given", two_ranks, "llama", {}, ids, labels, num_items_in_batch=torch.tensor(40))


def test_hf_gradient_checkpointing_and_ddp(two_ranks):
    ids, labels = make_batch(2, 14)
    _check("HF gradient checkpointing", two_ranks, "llama", {}, ids, labels)
    _check("wrapped in DDP", two_ranks, "gpt2", {}, ids, labels)


def test_evaluation_runs_unsplit_with_its_mask_and_revert_restores_attention(two_ranks):
    ids, _ = make_batch(2, 12)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    want = build_model("llama").eval()(input_ids=ids, attention_mask=mask).logits
    for results in two_ranks:
        torch.testing.assert_close(results["eval logits"], want)
        assert results["attention while patched"] == ("hf_memo_ulysses_sp2_sdpa", "sdpa")
        assert results["attention after revert"] == (True, "sdpa")


@pytest.mark.parametrize(
    "error,expected",
    [
        ("world size", "MemoConfig.sequence_parallel_size=4 must divide the world size 2"),
        ("heads", "MemoConfig.sequence_parallel_size=2 must divide the model's num_attention_heads=3"),
        ("eager attention", "attn_implementation to be one of sdpa, flash_attention_2"),
        ("different batches", "ranks of a sequence-parallel group must get the same batch"),
        ("training without labels", "a training forward must compute the loss"),
    ],
)
def test_bad_input_fails_on_every_rank(two_ranks, error, expected):
    for rank, results in enumerate(two_ranks):
        assert expected in results["errors"][error], f"rank {rank}: {results['errors'][error]}"


@pytest.mark.parametrize("case", list(FOUR_RANK_CASES))
def test_four_ranks_match_single_process(four_ranks, case):
    family, overrides, batch, seq, masked = FOUR_RANK_CASES[case]
    _check(case, four_ranks, family, overrides, *make_batch(batch, seq, masked))


def test_two_replicas_of_two_ranks_under_ddp_average_the_replicas(four_ranks):
    case = "2 replicas x sp=2, DDP"
    references = []
    for replica in (0, 1):
        ids, labels = make_batch(2, 11, seed=10 + replica)
        references.append(_reference("llama", {"num_key_value_heads": 1}, ids, labels))
    for rank, results in enumerate(four_ranks):
        torch.testing.assert_close(results[case]["loss"], references[rank // 2][1], rtol=1e-6, atol=0)
    model = build_model("llama", num_key_value_heads=1)
    replica_grads = [dict(reference.named_parameters()) for reference, _ in references]
    for name, param in model.named_parameters():
        param.grad = (replica_grads[0][name].grad + replica_grads[1][name].grad) / 2
    for results in four_ranks:
        got = build_model("llama", num_key_value_heads=1)
        for name, param in got.named_parameters():
            param.grad = results[case]["grads"][name]
        assert_same_grads(got, model)


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
    with pytest.raises(ValueError, match="accepted for this model: 1, 3"):
        hf_memo.apply(model, sequence_parallel_size=2)
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
