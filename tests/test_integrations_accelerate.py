"""Accelerate integration: data loaders per replica, DDP training equal to one process, `accelerate launch`
of the 2-process CPU config running Trainer steps, the launch configs, and errors before any step.
(Training over several replicas x sequence-parallel ranks under DDP is tested in test_parallel_causal_lm.py.)"""

from __future__ import annotations

import os
import socket
import sys
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator, DistributedType
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.state import AcceleratorState
from accelerate.utils import ParallelismConfig
from accelerate.utils.launch import prepare_deepspeed_cmd_env
from torch.utils.data import DataLoader

import hf_memo
from hf_memo.integrations.accelerate import attach, prepare_data_loader
from hf_memo.parallel.groups import SequenceParallelGroups
from tests.conftest import ROOT, assert_same_grads, build_model, make_batch, run_command
from tests.multiprocess import run_processes

CONFIGS = ROOT / "examples" / "accelerate_configs"
SAMPLES, SEQ, STEPS, LR = 8, 11, 3, 0.1


def _dataset() -> list[dict[str, torch.Tensor]]:
    ids, labels = make_batch(SAMPLES, SEQ, seed=3)
    return [{"input_ids": i, "labels": label} for i, label in zip(ids, labels)]


def _accelerate_worker(rank, world):
    # The process group exists already; these let Accelerate see a CPU run of `world` processes.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    accelerator = Accelerator(cpu=True)
    model = hf_memo.apply(build_model("llama"), sequence_parallel_size=world, mlp_chunks=2)
    groups = attach(accelerator, model)
    loader = DataLoader(_dataset(), batch_size=1, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen = []
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        seen.append(batch["input_ids"].clone())
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    weights = {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
    return {"layout": (groups.sp_rank, groups.dp_rank, groups.dp_size), "seen": seen, "weights": weights}


def test_accelerator_with_ddp_trains_like_one_process():
    """Two processes, one sequence split over both: they get the same batches from the prepared loader,
    and training through Accelerate's DDP equals one unpatched process on those batches."""
    per_rank = run_processes(_accelerate_worker, 2)
    assert [r["layout"] for r in per_rank] == [(0, 0, 1), (1, 0, 1)]
    assert len(per_rank[0]["seen"]) == STEPS
    assert all(torch.equal(a, b) for a, b in zip(per_rank[0]["seen"], per_rank[1]["seen"]))

    by_ids = {tuple(sample["input_ids"].tolist()): sample["labels"] for sample in _dataset()}
    reference = build_model("llama")
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for ids in per_rank[0]["seen"]:
        labels = by_ids[tuple(ids[0].tolist())].unsqueeze(0)
        reference(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for rank, results in enumerate(per_rank):
        for name, param in reference.named_parameters():
            torch.testing.assert_close(
                results["weights"][name], param.detach(), msg=lambda m, r=rank, n=name: f"rank {r}, {n}: {m}"
            )


@pytest.fixture
def cpu_accelerator():
    accelerator = Accelerator(cpu=True)
    yield accelerator
    AcceleratorState._reset_state(reset_partial_state=True)


def test_data_loaders_are_split_over_replicas_and_shared_within_one(cpu_accelerator):
    def batches(sp_rank: int, dp_rank: int) -> list[int]:
        groups = SequenceParallelGroups(None, sp_size=2, sp_rank=sp_rank, dp_size=3, dp_rank=dp_rank)
        loader = prepare_data_loader(cpu_accelerator, groups, DataLoader(list(range(12)), batch_size=2))
        return [int(x) for batch in loader for x in batch]

    replicas = [batches(0, dp_rank) for dp_rank in range(3)]
    assert all(batches(1, dp_rank) == replicas[dp_rank] for dp_rank in range(3))
    assert sorted(sum(replicas, [])) == list(range(12)) and all(len(r) == 4 for r in replicas)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_accelerate_launch_of_the_cpu_config_runs_trainer_steps_like_one_process(tmp_path):
    script = ROOT / "tests" / "scripts" / "sequence_parallel_trainer.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "cpu_2proc_sp.yaml")]
    launch += ["--main_process_port", str(_free_port()), str(script), "--sequence-parallel", "2"]
    run_command([*launch, "--out", str(tmp_path / "sp.pt")], env)
    single = [sys.executable, str(script), "--sequence-parallel", "1", "--out", str(tmp_path / "single.pt")]
    run_command(single, env)

    got, want = torch.load(tmp_path / "sp.pt"), torch.load(tmp_path / "single.pt")
    assert got["world"] == 2 and want["world"] == 1
    assert len(got["losses"]) == len(want["losses"]) == 3
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-6, atol=0)
    for name, weight in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], weight, msg=lambda m, n=name: f"{n}: {m}")
    assert any(not torch.equal(w, build_model("llama").state_dict().get(n, w)) for n, w in want["weights"].items())


def _validated(config: str) -> tuple:
    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / config), "train.py"])
    return _validate_launch_command(args)


@pytest.mark.parametrize(
    "config,processes,multi_gpu",
    [("single_gpu.yaml", 1, False), ("multi_gpu_8_sp.yaml", 8, True), ("cpu_2proc_sp.yaml", 2, True)],
)
def test_launch_configs_are_valid_for_accelerate_launch(config, processes, multi_gpu):
    args, _, _ = _validated(config)
    assert (args.num_processes, args.multi_gpu, args.use_deepspeed) == (processes, multi_gpu, False)


def test_deepspeed_config_asks_for_zero2_and_deepspeed_sequence_parallelism():
    args, defaults, _ = _validated("deepspeed_zero2_sp.yaml")
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # as `accelerate launch` does
    _, env = prepare_deepspeed_cmd_env(args)
    assert (args.use_deepspeed, args.num_processes) == (True, 8)
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"
    assert (env["PARALLELISM_CONFIG_SP_SIZE"], env["PARALLELISM_CONFIG_SP_BACKEND"]) == ("8", "deepspeed")


def test_zero3_config_asks_for_zero3_with_zero_init_and_no_deepspeed_sequence_parallelism(monkeypatch):
    from hf_memo.parallel.zero3 import zero3_expected

    args, defaults, _ = _validated("deepspeed_zero3_sp.yaml")
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    _, env = prepare_deepspeed_cmd_env(args)
    assert (args.use_deepspeed, args.num_processes) == (True, 8)
    assert (env["ACCELERATE_DEEPSPEED_ZERO_STAGE"], env["ACCELERATE_DEEPSPEED_ZERO3_INIT"]) == ("3", "true")
    assert "PARALLELISM_CONFIG_SP_SIZE" not in env  # hf_memo's own sequence parallelism (attach) runs instead
    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        monkeypatch.setenv(name, env[name])
    assert zero3_expected(build_model("llama"))  # what apply() registers the regions on, before DeepSpeed starts


def _stub_accelerator(distributed_type=DistributedType.MULTI_CPU, processes=2, parallelism_config=None):
    return SimpleNamespace(
        distributed_type=distributed_type,
        num_processes=processes,
        parallelism_config=parallelism_config,
        state=SimpleNamespace(deepspeed_plugin=None),
    )


def test_attach_refuses_a_model_without_sequence_parallelism():
    with pytest.raises(ValueError, match="has none applied"):
        attach(_stub_accelerator(), hf_memo.apply(build_model("llama")))


def test_attach_refuses_an_accelerator_that_is_not_distributed():
    model = hf_memo.apply(build_model("llama"), sequence_parallel_size=2)
    with pytest.raises(ValueError, match="sequence_parallel_size=2 needs a distributed Accelerator"):
        attach(_stub_accelerator(DistributedType.NO, 1), model)


def test_attach_refuses_accelerates_own_sequence_parallelism_as_well():
    model = hf_memo.apply(build_model("llama"), sequence_parallel_size=2)
    config = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    with pytest.raises(ValueError, match="would both split the sequence"):
        attach(_stub_accelerator(DistributedType.DEEPSPEED, parallelism_config=config), model)


def test_deepspeed_sequence_parallelism_composes_with_mini_sequences_on_its_shards():
    """With Accelerate's DeepSpeed Ulysses, hf_memo runs with sequence_parallel_size=1 on the shard DeepSpeed
    gives each rank: its input ids, global position ids and pre-shifted labels (also passed as labels)."""
    model, reference = build_model("llama"), build_model("llama")
    hf_memo.apply(model, lm_head_chunks=3)
    ids, labels = make_batch(2, 16)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    shard = {
        "input_ids": ids[:, 8:],
        "position_ids": torch.arange(8, 16).expand(2, 8),
        "shift_labels": shift[:, 8:].contiguous(),
    }
    got = model(**shard, labels=shard["shift_labels"])
    want = reference(**shard, labels=shard["shift_labels"])
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)
    got.loss.backward()
    want.loss.backward()
    assert_same_grads(model, reference)
