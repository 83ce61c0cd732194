import json
import subprocess
import sys

import pytest
from transformers import GPT2LMHeadModel

from hf_memo.integrations import cli
from hf_memo.integrations.estimate import estimate
from hf_memo.integrations.setups import MODES, Mode
from hf_memo.profiler.analysis import peak
from hf_memo.profiler.phases import decoder_layers
from hf_memo.profiler.placement import mark_host
from hf_memo.profiler.trace import AllocationTrace
from tests.test_profiler_step import CONFIGS

MiB = 2**20


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    CONFIGS["llama"](6).save_pretrained(folder)
    return str(folder / "config.json")


@pytest.fixture(scope="module")
def result(config_path):
    return estimate(config_path, 4096, gpu_memory=24 * MiB, progress=False)


def test_modes_side_by_side_with_the_longest_sequence_that_fits(result):
    vanilla, checkpointing, minseq = (result.modes[m] for m in ("vanilla", "hf-checkpointing", "minseq"))
    assert vanilla.footprint.device.total > checkpointing.footprint.device.total > minseq.footprint.device.total
    assert "closed form fitted to 4 fresh fake-tensor profiles" in vanilla.footprint.method
    for mode in (vanilla, checkpointing, minseq):
        assert mode.fits == (mode.footprint.device.total <= 24 * MiB)
        assert mode.footprint.host.total == 0
        by_category = mode.footprint.device.by_category
        assert sum(by_category.values()) == mode.footprint.device.total
        assert by_category["parameter"] == vanilla.footprint.device.by_category["parameter"] > 0
    assert 0 < vanilla.longest_seq_len < checkpointing.longest_seq_len < minseq.longest_seq_len


def test_the_longest_sequence_fits_and_the_next_one_does_not(config_path, result):
    longest = result.modes["minseq"].longest_seq_len
    at = estimate(config_path, longest, gpu_memory=24 * MiB, modes=["minseq"], search=False, progress=False)
    past = estimate(config_path, longest + 256, gpu_memory=24 * MiB, modes=["minseq"], search=False, progress=False)
    assert at.modes["minseq"].fits and not past.modes["minseq"].fits
    assert at.modes["minseq"].longest_seq_len is None


def test_memo_fits_some_policy_up_to_its_longest_sequence_and_none_past_it(config_path, result):
    memo, minseq = result.modes["memo"], result.modes["minseq"]
    assert memo.longest_seq_len >= minseq.longest_seq_len
    for seq_len, fits in ((memo.longest_seq_len, True), (memo.longest_seq_len + 256, False)):
        at = estimate(config_path, seq_len, 24 * MiB, modes=["memo"], search=False, progress=False).modes
        assert at["memo"].fits == fits
        if fits:  # the chosen policy's memory is within the device budget
            assert at["memo"].footprint.device.total <= 24 * MiB
            assert "/device" in at["memo"].policy and at["memo"].step_seconds > 0 and 0 < at["memo"].mfu <= 1
        else:
            assert at["memo"].policy.startswith("none fits: no memory policy fits") and at["memo"].mfu is None


def test_models_configs_and_lora_are_accepted():
    config = CONFIGS["gpt2"](2)
    model = GPT2LMHeadModel(config)
    by_model = estimate(model, 512, modes=["vanilla"], search=False, progress=False)
    by_config = estimate(config, 512, modes=["vanilla"], search=False, progress=False)
    assert by_model.modes["vanilla"].footprint == by_config.modes["vanilla"].footprint
    assert "2 fresh fake-tensor profiles (2,048 and 4,096 tokens)" in by_config.modes["vanilla"].footprint.method
    lora = estimate(config, 512, modes=["vanilla"], trainable="lora", search=False, progress=False)
    full, adapted = by_config.modes["vanilla"].footprint.device, lora.modes["vanilla"].footprint.device
    assert adapted.by_category["parameter"] > full.by_category["parameter"]  # base weights + adapters
    # AdamW states of the adapters only: rank 8 on c_attn (64 -> 192) of 2 layers, fp32 (PEFT's default), + steps
    adapter_params = 2 * 8 * (64 + 192)
    assert adapted.by_category["optimizer"] == 2 * 4 * adapter_params + 4 * 4
    with pytest.raises(ValueError, match="learned positions for at most 4,096"):
        estimate(config, 8192, progress=False)


def _host_offloading(model, host_memory):
    """A mode that keeps a host copy of each decoder layer's output, as an offloading executor would."""

    def offload(module, args, output):
        module.offloaded = mark_host(output.detach().clone())

    for layer in decoder_layers(model):
        layer.register_forward_hook(offload)


def test_a_new_mode_is_one_table_entry_and_host_bytes_count_as_host_memory(monkeypatch, config_path):
    monkeypatch.setitem(MODES, "offload", Mode("copies layer outputs to the host", _host_offloading))
    result = estimate(config_path, 1024, modes=["vanilla", "offload"], search=False, progress=False)
    plain, offload = result.modes["vanilla"].footprint, result.modes["offload"].footprint
    assert offload.host.total == 6 * 1024 * 64 * 2  # six (S, H) bf16 layer outputs
    assert offload.device.total == plain.device.total  # none of it on the device
    limited = estimate(config_path, 1024, modes=["offload"], host_memory=6 * 1024 * 64, progress=False)
    assert not limited.modes["offload"].fits
    assert limited.modes["offload"].longest_seq_len == 512  # host memory is the limit here


def test_cli_prints_the_table_json_traces_and_a_plot(tmp_path, capsys, config_path):
    argv = ["estimate", "--model", config_path, "--seq-len", "2k", "--gpu-memory", "24MiB", "--reserve", "0GiB"]
    assert cli.main(argv + ["--modes", "vanilla,minseq"]) == 0
    table = capsys.readouterr().out
    assert "vanilla" in table and "minseq" in table and "hf-checkpointing" not in table
    for label in ("peak device memory", "activations", "optimizer state", "longest sequence", "closed form fitted to"):
        assert label in table
    traces, plot = tmp_path / "traces", tmp_path / "timeline.png"
    assert cli.main(argv + ["--json", "--no-search", "--trace-dir", str(traces), "--plot", str(plot)]) == 0
    record = json.loads(capsys.readouterr().out)
    assert set(record["modes"]) == {"vanilla", "hf-checkpointing", "minseq", "memo"}
    assert record["modes"]["minseq"]["longest_seq_len"] is None
    assert record["gpu_memory"] == 24 * MiB
    for mode, values in record["modes"].items():
        trace = AllocationTrace.load(traces / f"{mode}.jsonl")
        assert trace.meta["mode"] == mode and trace.meta["layers"] == 6 and trace.meta["seq_len"] == 2048
        if mode != "memo":  # memo's memory is its chosen policy's; its trace is of the smallest MEMO policy
            assert values["footprint"]["device"]["total"] == peak(trace).total
    kinds = record["modes"]["memo"]["policy"].split(", ")  # e.g. "1 X+attn/device (alpha 0.438), 5 X+attn/..."
    assert sum(int(kind.split()[0]) for kind in kinds) == 6
    assert plot.stat().st_size > 10_000


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--model", "llama-9b"], "unknown model 'llama-9b'; built-in models are gpt-7b"),
        (["--gpu-memory", "eighty"], "--gpu-memory: expected a size such as '80GiB'"),
        (["--seq-len", "0"], "--seq-len: a token count must be positive"),
        (["--seq-len", "-5"], "--seq-len: expected a token count"),
        (["--modes", "vanilla,fast"], "--modes must be one of vanilla, hf-checkpointing, minseq, memo, got 'fast'"),
        (["--batch", "0"], "--batch must be an integer >= 1"),
        (["--trainable", "half"], "--trainable must be one of full, lora"),
        (["--optimizer", "sgd"], "--optimizer must be one of adamw, none"),
        (["--zero", "4"], "--zero must be one of 0, 1, 2, 3, got '4'"),
        (["--num-gpus", "0"], "--num-gpus must be an integer >= 1"),
        (["--sequence-parallel", "3"], "--sequence-parallel must divide --num-gpus (1), got '3'"),
        (["--gpus-per-node", "x"], "--gpus-per-node must be an integer >= 1"),
        (["--pinned-memory", "lots"], "--pinned-memory: expected a size"),
        (["--jobs", "0"], "--jobs must be an integer >= 1"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(capsys, extra, message):
    flags = {"--model": "llama-3-8b", "--seq-len": "4k", "--gpu-memory": "80GB", extra[0]: extra[1]}
    assert cli.main(["estimate", *(item for pair in flags.items() for item in pair)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_cli_refuses_an_encoder_config_and_argparse_errors_are_one_line_too(tmp_path, capsys):
    from transformers import BertConfig

    BertConfig().save_pretrained(tmp_path)
    assert cli.main(["estimate", "--model", str(tmp_path), "--seq-len", "1k", "--gpu-memory", "80GiB"]) == 2
    assert "not a decoder-only causal LM config (model_type 'bert')" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["estimate", "--seq-len", "1k", "--gpu-memory", "80GiB"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "--model" in err


def test_the_command_exits_2_without_a_traceback():
    command = [sys.executable, "-m", "hf_memo.integrations.cli", "estimate", "--model", "llama-3-8b"]
    done = subprocess.run(command + ["--seq-len", "eighty", "--gpu-memory", "80GiB"], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "hf-memo estimate: error: --seq-len: expected a token count such as '4096', '128k' or '1M', got 'eighty'"
    ]


def test_eight_gpus_shard_the_model_states_and_split_the_sequence(config_path):
    from hf_memo.integrations.cluster import Cluster

    one = estimate(config_path, 8192, gpu_memory=24 * MiB, modes=["minseq"], search=False, progress=False)
    cluster = Cluster(num_gpus=8, sequence_parallel=8, zero=3, offload_optimizer=True)
    eight = estimate(
        config_path, 8192, 24 * MiB, host_memory=64 * MiB, modes=["minseq"], cluster=cluster, progress=False
    )
    single, rank = one.modes["minseq"].footprint.device.by_category, eight.modes["minseq"].footprint.device.by_category
    # every parameter of this tiny model is under ZeRO-3's persistence threshold (1e5 elements): whole on every rank
    assert rank["parameter"] == single["parameter"] and rank["optimizer"] == 0 < single["optimizer"]
    assert rank["activation"] < single["activation"]  # S / 8 tokens per rank
    assert eight.modes["minseq"].footprint.host.by_category["optimizer"] > 0  # the offloaded optimizer state
    assert eight.modes["minseq"].binding in ("device", "host", "pinned")
    assert "8 GPUs (8 per node), sequence parallel 8, ZeRO-3, optimizer offloaded to the host" in eight.table()


def test_the_answer_depends_neither_on_the_workers_nor_on_the_order_of_the_modes(config_path, monkeypatch):
    from hf_memo.integrations import estimate as module

    answers = []
    for workers, modes in [(1, ("memo", "vanilla")), (2, ("vanilla", "memo"))]:
        monkeypatch.setattr(module, "_CLOSED_FORMS", {})  # profile everything again
        found = estimate(config_path, 4096, gpu_memory=24 * MiB, host_memory=8 * MiB, modes=modes, workers=workers)
        answers.append({mode: found.modes[mode].to_dict() for mode in sorted(modes)})
    assert answers[0] == answers[1]
    assert answers[0]["memo"]["longest_seq_len"] > answers[0]["vanilla"]["longest_seq_len"]
