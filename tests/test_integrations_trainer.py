import json
import time

import psutil
import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

import hf_memo
from hf_memo import MemoCallback, MemoConfig
from hf_memo.integrations import trainer as memo_trainer
from hf_memo.integrations.flops import FlopModel
from hf_memo.integrations.trainer import (
    ALPHA,
    DEVICE_PEAK,
    HOST_OFFLOAD,
    MFU,
    PROCESS_PEAK_RSS,
    TOKENS_PER_GPU_PER_SECOND,
    TOKENS_PER_SECOND,
)
from hf_memo.patches.apply import memo_runtime
from hf_memo.planner.plan import MemoryPlan
from hf_memo.runtime import policy_sizer
from tests.conftest import VOCAB, build_model

MEMO = MemoConfig(recompute="memo", offload_fraction=0.5, mlp_chunks=4, planner="greedy")
BATCH, SEQ = 2, 64


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and spinning threads stall a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def markov_tokens(rows: int, seq_len: int, states: int = 16, seed: int = 0) -> torch.Tensor:
    """``(rows, seq_len)`` tokens of a fixed sparse Markov chain over ``states`` ids: learnable in a few steps."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(VOCAB, generator=gen)[:states]
    successors = torch.randint(0, states, (states, 2), generator=gen)
    state = torch.randint(0, states, (rows,), generator=gen)
    tokens = torch.empty(rows, seq_len, dtype=torch.long)
    for t in range(seq_len):
        tokens[:, t] = ids[state]
        state = successors[state, torch.randint(0, 2, (rows,), generator=gen)]
    return tokens


class TokenRows(Dataset):
    """Markov-chain token rows, each its own labels."""

    def __init__(self, rows: int = 16, seq_len: int = SEQ) -> None:
        self.tokens = markov_tokens(rows, seq_len)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class LaidOutRows(Dataset):
    """Markov-chain rows of ``SEQ`` tokens packed (``position_ids`` restarting) or padded (``attention_mask``)."""

    def __init__(self, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> None:
        self.tokens = markov_tokens(8, SEQ)
        self.position_ids, self.attention_mask = position_ids, attention_mask

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = {"input_ids": self.tokens[index], "labels": self.tokens[index].clone()}
        if self.position_ids is not None:
            row["position_ids"] = self.position_ids
        if self.attention_mask is not None:
            row["attention_mask"] = self.attention_mask
            row["labels"][self.attention_mask == 0] = -100
        return row


class Recorder(TrainerCallback):
    """Keeps every log it is given (a stand-in for TensorBoard / W&B)."""

    def __init__(self) -> None:
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def make_trainer(out, model=None, callbacks=(), steps=6, dataset=None, **arguments):
    options = dict(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    args = TrainingArguments(**{**options, **arguments})
    model = model if model is not None else build_model("llama", num_hidden_layers=4)
    return Trainer(model=model, args=args, train_dataset=dataset or TokenRows(), callbacks=list(callbacks))


def train_losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.fixture(scope="module")
def memo_and_plain(tmp_path_factory):
    """Six steps with MemoCallback (memo executor, planned) and six without hf_memo, from the same seed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("trainer")
    recorder = Recorder()
    callback = MemoCallback(MEMO, peak_flops=1e12, progress=False)
    memo = make_trainer(out / "memo", callbacks=[recorder, callback])
    began = time.perf_counter()
    memo.train()
    wall = time.perf_counter() - began
    plain = make_trainer(out / "plain")
    plain.train()
    torch.set_num_threads(threads)
    return memo, plain, callback, recorder, wall


def test_training_matches_plain_hugging_face_step_by_step_and_the_loss_falls(memo_and_plain):
    memo, plain, callback, _, _ = memo_and_plain
    assert hf_memo.applied_config(memo.model) == MEMO
    assert hf_memo.applied_config(plain.model) is None
    memo_losses, plain_losses = train_losses(memo), train_losses(plain)
    assert len(memo_losses) == 6
    torch.testing.assert_close(memo_losses, plain_losses, rtol=1e-7, atol=0)  # fp64 model, fp32 loss accumulator
    assert memo_losses[-1] < memo_losses[0] - 0.5
    reference = dict(plain.model.named_parameters())
    for name, param in memo.model.named_parameters():
        torch.testing.assert_close(param, reference[name], rtol=1e-9, atol=1e-12, msg=name)
    assert memo_runtime(memo.model).attention_calls > 0  # the memo executor really ran


def test_plan_is_made_before_the_first_step_for_the_first_batch_and_cached(memo_and_plain):
    memo, _, callback, _, _ = memo_and_plain
    assert callback.plan_source == "planned"
    plan = MemoryPlan.load(callback.plan_path)
    assert callback.plan_path.name == "hf_memo_plan.json" and callback.plan_path.parent.samefile(memo.args.output_dir)
    assert (plan.meta["batch_size"], plan.meta["seq_len"]) == (BATCH, SEQ)
    assert plan.meta["fits"]["hf_memo_config"] == MEMO.to_dict()
    runtime = memo_runtime(memo.model)
    assert runtime.memory_plan.fingerprint == plan.fingerprint  # the runtime uses it and made no plan of its own


def test_logged_metrics_are_present_sane_and_reach_callbacks_before_it(memo_and_plain):
    memo, _, callback, recorder, wall = memo_and_plain
    entries = [entry for entry in memo.state.log_history if "loss" in entry]
    runtime = memo_runtime(memo.model)
    rss_now = psutil.Process().memory_info().rss / 2**30
    busy = 0.0
    for entry in entries:
        assert DEVICE_PEAK not in entry  # CPU: no device counter, the process peak instead
        assert entry[PROCESS_PEAK_RSS] >= 0.9 * rss_now
        assert entry[HOST_OFFLOAD] == runtime.host_reserved_bytes / 2**30 > 0
        assert entry[ALPHA] == 0.5 and {layer.alpha for layer in runtime.plan.layers} == {0.5}
        assert entry[TOKENS_PER_GPU_PER_SECOND] == entry[TOKENS_PER_SECOND] > 0  # one process
        flops_per_token = FlopModel.of(memo.model).flops(SEQ, SEQ**2) / SEQ
        assert entry[MFU] == pytest.approx(entry[TOKENS_PER_SECOND] * flops_per_token / 1e12, rel=1e-12)
        busy += BATCH * SEQ / entry[TOKENS_PER_SECOND]  # the training time each entry measured
    assert 0 < busy <= wall
    # The recorder was passed before MemoCallback, and still saw every metric.
    recorded = [log for log in recorder.logs if "loss" in log]
    assert [log[TOKENS_PER_SECOND] for log in recorded] == [e[TOKENS_PER_SECOND] for e in entries]
    assert all(MFU in log and ALPHA in log for log in recorded)


def _restarting(*lengths: int) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


@pytest.mark.parametrize(
    ("position_ids", "attention_mask", "tokens", "squared_lengths"),
    [
        (_restarting(20, 31, 13), None, 64, 20**2 + 31**2 + 13**2),  # packed: Σ s_i**2, not S**2
        (None, torch.tensor([1] * 40 + [0] * 24), 40, 40**2),  # right padding: 24 tokens of no work
        (_restarting(10, 30, 24), torch.tensor([1] * 40 + [0] * 24), 40, 10**2 + 30**2),  # packed, then padding
    ],
)
def test_mfu_and_tokens_per_second_count_real_tokens_and_attention_per_sample(
    tmp_path, position_ids, attention_mask, tokens, squared_lengths
):
    trainer = make_trainer(
        tmp_path, callbacks=[MemoCallback(peak_flops=1e12)], steps=2, dataset=LaidOutRows(position_ids, attention_mask)
    )
    trainer.train()
    params = 4 * (32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 3 * 32 * 72 + 2 * 32) + 32 + VOCAB * 32  # no embedding
    flops_per_step = BATCH * (6 * params * tokens + 6 * 4 * 32 * squared_lengths)  # 4 layers, query width 32
    for entry in (e for e in trainer.state.log_history if "loss" in e):
        seconds = BATCH * tokens / entry[TOKENS_PER_SECOND]  # one step per log
        assert entry[MFU] == pytest.approx(flops_per_step / seconds / 1e12, rel=1e-12)


def test_other_recompute_modes_log_no_alpha_no_offload_and_no_mfu_without_a_peak(tmp_path):
    trainer = make_trainer(tmp_path, callbacks=[MemoCallback()], steps=2)
    trainer.train()
    entry = next(e for e in trainer.state.log_history if "loss" in e)
    assert hf_memo.applied_config(trainer.model) == MemoConfig()
    assert entry[HOST_OFFLOAD] == 0 and ALPHA not in entry and MFU not in entry
    assert entry[TOKENS_PER_SECOND] > 0


def test_resume_reuses_the_plan_and_a_new_shape_or_config_plans_again(tmp_path, monkeypatch):
    plans = []
    original = memo_trainer.plan_training_step
    monkeypatch.setattr(memo_trainer, "plan_training_step", lambda *a, **k: plans.append(a[1:3]) or original(*a, **k))
    callbacks = [MemoCallback(MEMO, progress=False)]
    first = make_trainer(tmp_path, callbacks=callbacks, steps=2, save_strategy="steps", save_steps=2)
    first.train()
    assert plans == [(BATCH, SEQ)] and (tmp_path / "checkpoint-2").is_dir()

    callback = MemoCallback(MEMO, progress=False)
    resumed = make_trainer(tmp_path, callbacks=[callback], steps=4)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    assert callback.plan_source == "reused" and plans == [(BATCH, SEQ)]
    assert memo_runtime(resumed.model).memory_plan.meta["seq_len"] == SEQ

    longer = MemoCallback(MEMO, progress=False)
    make_trainer(tmp_path, callbacks=[longer], steps=1, dataset=TokenRows(seq_len=48)).train()
    assert longer.plan_source == "planned" and plans[-1] == (BATCH, 48)
    assert MemoryPlan.load(tmp_path / "hf_memo_plan.json").meta["seq_len"] == 48

    other = MemoCallback(MEMO.replace(offload_fraction=0.25), progress=False)
    make_trainer(tmp_path, callbacks=[other], steps=1, dataset=TokenRows(seq_len=48)).train()
    assert other.plan_source == "planned" and len(plans) == 3

    again = MemoCallback(MEMO.replace(offload_fraction=0.25), progress=False)  # the cache fits: reused
    make_trainer(tmp_path, callbacks=[again], steps=1, dataset=TokenRows(seq_len=48)).train()
    assert again.plan_source == "reused" and len(plans) == 3
    wider = MemoCallback(MEMO.replace(offload_fraction=0.25), progress=False)  # another model config
    model = build_model("llama", num_hidden_layers=4, intermediate_size=96)
    make_trainer(tmp_path, model=model, callbacks=[wider], steps=1, dataset=TokenRows(seq_len=48)).train()
    assert wider.plan_source == "planned" and len(plans) == 4
    monkeypatch.setattr(memo_trainer, "world_size", lambda: 4)  # the same job on four processes
    spread = MemoCallback(MEMO.replace(offload_fraction=0.25), progress=False)
    make_trainer(tmp_path, model=model, callbacks=[spread], steps=1, dataset=TokenRows(seq_len=48)).train()
    assert spread.plan_source == "planned" and len(plans) == 5


def test_lora_training_matches_plain_peft_and_plans_with_the_adapters(tmp_path):
    def lora_model():
        lora = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens", "norm"]
        )
        return get_peft_model(build_model("llama", num_hidden_layers=4), lora)

    callback = MemoCallback(MEMO, progress=False)
    memo = make_trainer(tmp_path / "memo", model=lora_model(), callbacks=[callback], steps=4)
    memo.train()
    plain = make_trainer(tmp_path / "plain", model=lora_model(), steps=4)
    plain.train()
    torch.testing.assert_close(train_losses(memo), train_losses(plain), rtol=1e-7, atol=0)
    assert train_losses(memo)[-1] < train_losses(memo)[0]
    assert callback.plan_source == "planned"
    assert MemoryPlan.load(callback.plan_path).meta["fits"]["adapters"] is not None
    trainable = {name for name, p in memo.model.named_parameters() if p.requires_grad}
    assert any("lora_A" in name for name in trainable) and any("norm" in name for name in trainable)


def test_hugging_face_checkpointing_under_a_recompute_mode_trains_as_plain_training(tmp_path):
    callback = MemoCallback(MEMO, progress=False)
    memo = make_trainer(tmp_path / "memo", callbacks=[callback], steps=2, gradient_checkpointing=True)
    memo.train()
    plain = make_trainer(tmp_path / "plain", steps=2)
    plain.train()
    assert memo.model.is_gradient_checkpointing  # the flag stays; hf_memo's memo executor runs the layers
    torch.testing.assert_close(train_losses(memo), train_losses(plain), rtol=1e-7, atol=0)


def test_hugging_face_checkpointing_trains_with_recompute_none(tmp_path):
    trainer = make_trainer(tmp_path, callbacks=[MemoCallback()], steps=2, gradient_checkpointing=True)
    trainer.train()
    assert len(train_losses(trainer)) == 2


def test_liger_kernel_is_refused_before_it_patches_anything(tmp_path):
    model = build_model("llama")
    with pytest.raises(ValueError, match=r"use_liger_kernel=True\) would patch the MLP and the LM head"):
        make_trainer(tmp_path, model=model, callbacks=[MemoCallback()], use_liger_kernel=True)
    assert hf_memo.applied_config(model) is None


def test_a_model_patched_with_another_config_is_refused(tmp_path):
    model = hf_memo.apply(build_model("llama"), recompute="full")
    with pytest.raises(ValueError, match=r"recompute='full' \(MemoCallback: 'memo'\)"):
        make_trainer(tmp_path, model=model, callbacks=[MemoCallback(MEMO)])
    kept = make_trainer(tmp_path, model=model, callbacks=[MemoCallback()], steps=1)  # no config: the model's
    kept.train()
    assert hf_memo.applied_config(model).recompute == "full"


def test_bad_callback_arguments_are_refused():
    with pytest.raises(ValueError, match="peak_flops must be None or FLOP/s > 0, got -1"):
        MemoCallback(peak_flops=-1)
    with pytest.raises(ValueError, match="config must be a MemoConfig or None, got dict"):
        MemoCallback({"recompute": "memo"})


def test_plan_fit_survives_the_plan_file(tmp_path):
    model = hf_memo.apply(build_model("llama", num_hidden_layers=4), MEMO)
    fit = memo_trainer.plan_fit(model, MEMO, 1, 16)
    assert json.loads(json.dumps(fit)) == fit
    assert memo_trainer.plan_fit(build_model("llama", num_hidden_layers=3), MEMO, 1, 16) != fit


def test_auto_offload_is_planned_once_for_the_alpha_the_first_step_solved(tmp_path, monkeypatch):
    plans = []
    original = memo_trainer.plan_training_step
    monkeypatch.setattr(
        memo_trainer, "plan_training_step", lambda *a, **k: plans.append("callback") or original(*a, **k)
    )
    # Fixed layer time and bandwidth: the solved alpha is the same on every machine (bandwidth bound, 0 < alpha < 1).
    config = MEMO.replace(offload_fraction="auto", layer_time=1.0, host_bandwidth=4e5)
    callback = MemoCallback(config, progress=False)
    trainer = make_trainer(tmp_path, callbacks=[callback], steps=2)
    trainer.train()
    runtime = memo_runtime(trainer.model)
    assert plans == []  # the callback made no plan of its own for an offload not solved yet
    cached = MemoryPlan.load(tmp_path / "hf_memo_plan.json")
    assert callback.plan_source == "planned" and cached.fingerprint == runtime.memory_plan.fingerprint
    alphas = {layer["alpha"] for layer in cached.meta["offload"]["layers"]}
    assert alphas == {layer.alpha for layer in runtime.plan.layers} and 0 < min(alphas) < 1


def test_a_device_budget_trains_the_solved_policy_as_plain_training(tmp_path, monkeypatch):
    """A device budget of five layer inputs: the policy solver keeps every layer's input only (no room for an
    attention output beside two device layers and two copy buffers); the run equals plain training. The solver's
    own accounting is under test: the policy sizer finds nothing beyond the kept tensors (sizing is tested in
    test_integrations_policy_sizing)."""
    monkeypatch.setattr(policy_sizer, "_registered", [lambda *args: 0])
    layer_input = BATCH * SEQ * 32 * 8  # float64 hidden states of one layer
    model = build_model("llama", num_hidden_layers=4)
    gradients = sum(p.numel() * p.element_size() for p in model.parameters())  # kept out of the budget
    limit = 5 * layer_input + gradients
    config = MEMO.replace(offload_fraction="auto", layer_time=1e-3, host_bandwidth=1e9, device_memory_limit=f"{limit}B")
    memo = make_trainer(tmp_path / "memo", model, callbacks=[MemoCallback(config, progress=False)], steps=3)
    memo.train()
    plain = make_trainer(tmp_path / "plain", steps=3)
    plain.train()
    policy = memo_runtime(memo.model).plan
    assert not any(layer.keep_attention for layer in policy.layers) and policy.device_bytes <= 5 * layer_input
    torch.testing.assert_close(train_losses(memo), train_losses(plain), rtol=1e-7, atol=0)
    reference = dict(plain.model.named_parameters())
    for name, param in memo.model.named_parameters():
        torch.testing.assert_close(param, reference[name], rtol=1e-9, atol=1e-12, msg=name)
