import json
import subprocess
import sys

import pytest
from transformers import GPT2LMHeadModel

from hf_memo.estimator.estimate import estimate
from hf_memo.estimator.setups import MODES, Mode
from hf_memo.integrations import cli
from hf_memo.profiler.analysis import peak
from hf_memo.profiler.phases import decoder_layers
from hf_memo.profiler.placement import mark_host
from hf_memo.profiler.trace import AllocationTrace
from hf_memo.profiler.workers import run_side_by_side
from tests.test_profiler_step import CONFIGS

MiB = 2**20


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    CONFIGS["llama"](6).save_pretrained(folder)
    return str(folder / "config.json")


@pytest.fixture(scope="module")
def profiled(config_path):
    """The module's answer, every mode profiled in 2 processes, and each batch of profile jobs it ran with their
    traces."""
    from hf_memo.estimator import estimate as module

    ran = []

    def recording(jobs, workers=None, on_done=None):
        traces = run_side_by_side(jobs, workers, on_done)
        ran.append((list(jobs), traces))
        return traces

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "run_side_by_side", recording)
        answer = estimate(config_path, 4096, gpu_memory=24 * MiB, progress=False, workers=2)
    return answer, ran


@pytest.fixture(scope="module")
def result(profiled):
    return profiled[0]


def test_modes_side_by_side_with_the_longest_sequence_that_fits(result):
    plain, checkpointing, full = (result.modes[m] for m in ("hf", "hf-checkpointing", "full"))
    assert plain.footprint.device.total > checkpointing.footprint.device.total > full.footprint.device.total
    assert "closed form fitted to 4 fresh fake-tensor profiles" in plain.footprint.method
    for mode in (plain, checkpointing, full):
        assert mode.fits == (mode.footprint.device.total <= 24 * MiB)
        assert mode.footprint.host.total == 0
        by_category = mode.footprint.device.by_category
        assert sum(by_category.values()) == mode.footprint.device.total
        assert by_category["parameter"] == plain.footprint.device.by_category["parameter"] > 0
    assert 0 < plain.longest_seq_len < checkpointing.longest_seq_len < full.longest_seq_len


def test_the_longest_sequence_fits_and_the_next_one_does_not(config_path, result):
    longest = result.modes["full"].longest_seq_len
    at = estimate(config_path, longest, gpu_memory=24 * MiB, modes=["full"], search=False, progress=False)
    past = estimate(config_path, longest + 256, gpu_memory=24 * MiB, modes=["full"], search=False, progress=False)
    assert at.modes["full"].fits and not past.modes["full"].fits
    assert at.modes["full"].longest_seq_len is None


def test_memo_fits_some_policy_up_to_its_longest_sequence_and_none_past_it(config_path, result):
    memo, full = result.modes["memo"], result.modes["full"]
    assert memo.longest_seq_len >= full.longest_seq_len
    for seq_len, fits in ((memo.longest_seq_len, True), (memo.longest_seq_len + 256, False)):
        at = estimate(config_path, seq_len, 24 * MiB, modes=["memo"], search=False, progress=False).modes
        assert at["memo"].fits == fits
        if fits:  # the chosen policy's memory is within the device budget
            assert at["memo"].footprint.device.total <= 24 * MiB
            assert "/device" in at["memo"].policy and at["memo"].step_seconds > 0 and 0 < at["memo"].mfu <= 1
        else:
            assert at["memo"].policy.startswith("none fits: no memory policy fits") and at["memo"].mfu is None


def test_where_the_solver_finds_no_policy_a_fitting_smallest_one_is_the_answer(config_path, result, monkeypatch):
    """The solver's cost model can find nothing where a policy fits by its own profile (with little pinned memory its
    device room is that of two device layers): the answer is then the fastest smallest policy that fits."""
    from hf_memo.estimator import memo_policy as memo_estimate
    from hf_memo.planner.policy_solver import PolicyDoesNotFit

    def no_policy(*args, **kwargs):
        raise PolicyDoesNotFit("the solver's cost model finds none", 1.0, 0.0)

    monkeypatch.setattr(memo_estimate, "solve_policy", no_policy)
    longest = result.modes["memo"].longest_seq_len
    for seq_len, fits in ((longest, True), (longest + 256, False)):
        memo = estimate(config_path, seq_len, 24 * MiB, modes=["memo"], search=False, progress=False).modes["memo"]
        assert memo.fits == fits, (seq_len, memo.policy)
        if fits:  # X only everywhere, as many layers on the device as fit
            assert memo.footprint.device.total <= 24 * MiB and memo.step_seconds > 0
            assert "X+attn" not in memo.policy and "alpha" not in memo.policy and "X/device" in memo.policy
        else:
            assert memo.policy == "none fits: the solver's cost model finds none"


def test_models_configs_and_lora_are_accepted():
    config = CONFIGS["gpt2"](2)
    model = GPT2LMHeadModel(config)
    by_model = estimate(model, 512, modes=["hf"], search=False, progress=False)
    by_config = estimate(config, 512, modes=["hf"], search=False, progress=False)
    assert by_model.modes["hf"].footprint == by_config.modes["hf"].footprint
    assert "2 fresh fake-tensor profiles (2,048 and 4,096 tokens)" in by_config.modes["hf"].footprint.method
    lora = estimate(config, 512, modes=["hf"], trainable="lora", search=False, progress=False)
    full, adapted = by_config.modes["hf"].footprint.device, lora.modes["hf"].footprint.device
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
    result = estimate(config_path, 1024, modes=["hf", "offload"], search=False, progress=False)
    plain, offload = result.modes["hf"].footprint, result.modes["offload"].footprint
    assert offload.host.total == 6 * 1024 * 64 * 2  # six (S, H) bf16 layer outputs
    assert offload.device.total == plain.device.total  # none of it on the device
    limited = estimate(config_path, 1024, modes=["offload"], host_memory=6 * 1024 * 64, progress=False)
    assert not limited.modes["offload"].fits
    assert limited.modes["offload"].longest_seq_len == 512  # host memory is the limit here


def test_cli_prints_the_table_json_traces_and_a_plot(tmp_path, capsys, config_path):
    # the module's question (4,096 tokens, 24 MiB, no reserve): its closed forms are this process's already
    argv = ["estimate", "--model", config_path, "--seq-len", "4k", "--gpu-memory", "24MiB", "--reserve", "0GiB"]
    assert cli.main(argv + ["--modes", "hf,full"]) == 0
    table = capsys.readouterr().out
    assert " hf " in table and "full" in table and "hf-checkpointing" not in table
    for label in ("peak device memory", "activations", "optimizer state", "longest sequence", "closed form fitted to"):
        assert label in table
    traces, plot = tmp_path / "traces", tmp_path / "timeline.png"
    assert cli.main(argv + ["--json", "--no-search", "--trace-dir", str(traces), "--plot", str(plot)]) == 0
    record = json.loads(capsys.readouterr().out)
    assert set(record["modes"]) == {"hf", "hf-checkpointing", "full", "memo"}
    assert record["modes"]["full"]["longest_seq_len"] is None
    assert record["gpu_memory"] == 24 * MiB
    for mode, values in record["modes"].items():
        trace = AllocationTrace.load(traces / f"{mode}.jsonl")
        assert trace.meta["mode"] == mode and trace.meta["layers"] == 6 and trace.meta["seq_len"] == 4096
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
        (["--modes", "hf,fast"], "--modes must be one of hf, hf-checkpointing, none, full, selective, memo, got"),
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
    from hf_memo.estimator.cluster import Cluster

    one = estimate(config_path, 8192, gpu_memory=24 * MiB, modes=["full"], search=False, progress=False)
    with pytest.raises(ValueError, match="sequence_parallel=8 exceeds the model's num_attention_heads=4 .* is 4"):
        estimate(config_path, 8192, 24 * MiB, cluster=Cluster(num_gpus=8, sequence_parallel=8), search=False)
    cluster = Cluster(num_gpus=8, sequence_parallel=4, zero=3, offload_optimizer=True)
    eight = estimate(config_path, 8192, 24 * MiB, host_memory=64 * MiB, modes=["full"], cluster=cluster, progress=False)
    single, rank = one.modes["full"].footprint.device.by_category, eight.modes["full"].footprint.device.by_category
    # every parameter of this tiny model is under ZeRO-3's persistence threshold (1e5 elements): whole on every rank
    assert rank["parameter"] == single["parameter"] and rank["optimizer"] == 0 < single["optimizer"]
    assert rank["activation"] < single["activation"]  # S / 4 tokens per rank
    assert eight.modes["full"].footprint.host.by_category["optimizer"] > 0  # the offloaded optimizer state
    assert eight.modes["full"].binding in ("device", "host", "pinned")
    assert "8 GPUs (8 per node), sequence parallel 4, ZeRO-3, optimizer offloaded to the host" in eight.table()


def test_the_answer_depends_neither_on_the_workers_nor_on_the_order_of_the_modes(config_path, profiled, monkeypatch):
    """Profiles made in the module's 2 worker processes equal the same jobs run again here (a sample of every batch:
    memo's answer is made of such profiles alone), and two modes asked again, in the other order and profiled in
    this process, give the module's answers."""
    from hf_memo.estimator import fit_cache as fits

    result, ran = profiled
    assert len(ran) >= 2 and all(len(jobs) == len(traces) for jobs, traces in ran)
    for jobs, traces in ran:
        for index in sorted({0, len(jobs) // 2, len(jobs) - 1}):
            assert jobs[index]() == traces[index], index
    monkeypatch.setattr(fits, "PROCESS_FITS", {})  # profile everything again
    modes = ("hf-checkpointing", "hf")
    again = estimate(config_path, 4096, gpu_memory=24 * MiB, modes=modes, workers=1, progress=False)
    for mode in modes:
        assert again.modes[mode].to_dict() == result.modes[mode].to_dict(), mode
    assert again.modes["hf-checkpointing"].longest_seq_len > again.modes["hf"].longest_seq_len


# -- first contact: units, the host memory assumed, the search cap, Hub ids, what LoRA trains -----------------------

RECIPE_LORA = ["--lora-rank", "16", "--lora-targets", "q_proj,k_proj,v_proj,o_proj"]
RECIPE_LORA += ["--trainable-modules", "embed_tokens,norm"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--gpu-memory", "80"], "--gpu-memory: 80 has no unit: write 80GiB (binary) or 80GB (decimal)"),
        (["--host-memory", "64"], "--host-memory: 64 has no unit: write 64GiB (binary) or 64GB (decimal)"),
        (["--reserve", "3"], "--reserve: 3 has no unit: write 3GiB"),
        (["--host-reserve", "8"], "--host-reserve: 8 has no unit: write 8GiB"),
        (["--pinned-memory", "512"], "--pinned-memory: 512 has no unit: write 512GiB"),
        (["--lora-rank", "8"], "--lora-rank: only with --trainable lora"),
        (["--trainable", "lora", "--lora-rank", "0"], "--lora-rank must be an integer >= 1"),
        (["--trainable", "lora", "--lora-targets", ","], "--lora-targets must name at least one module"),
        (["--trainable", "lora", "--trainable-modules", "embed"], "trainable_modules embed: no module of Llama"),
    ],
)
def test_cli_refuses_sizes_without_a_unit_and_lora_flags_out_of_place(capsys, argv, message):
    flags = {"--model": "llama-3-8b", "--gpu-memory": "80GiB", "--host-memory": "1TiB", "--modes": "hf"}
    flags.update(zip(argv[::2], argv[1::2]))
    assert cli.main(["estimate", *(item for pair in flags.items() for item in pair)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_lora_settings_need_trainable_lora_in_python_too():
    with pytest.raises(ValueError, match="lora_rank, lora_targets and trainable_modules apply to trainable='lora'"):
        estimate("llama-3-8b", 1024, trainable="full", trainable_modules="embed_tokens", progress=False)


def test_the_recipes_lora_trains_525m_more_parameters_of_llama_3_8b_than_pefts_default():
    import torch

    from hf_memo.estimator.cluster import Cluster
    from hf_memo.estimator.model_states import model_states
    from hf_memo.estimator.question import lora_of
    from hf_memo.profiler.shapes import load_config

    config = load_config("llama-3-8b")
    default = lora_of("lora", None, None, None, "llama")
    recipe = lora_of("lora", 8, "q_proj,k_proj,v_proj,o_proj", ["embed_tokens", "norm"], "llama")
    counts = [model_states(config, torch.bfloat16, "lora", "adamw", Cluster(), lora) for lora in (default, recipe)]
    # k_proj (4096 -> 1024) and o_proj (4096 -> 4096) adapters at rank 8 in 32 layers; a trainable copy of the
    # embeddings (128256 x 4096) and of the 65 RMSNorms (4096 each)
    more = 32 * 8 * ((4096 + 1024) + (4096 + 4096)) + 128256 * 4096 + 65 * 4096
    assert counts[1].trainable - counts[0].trainable == more == 529_010_688
    assert counts[0].trainable == 32 * 8 * ((4096 + 4096) + (4096 + 1024))  # q_proj and v_proj, PEFT's default


def test_cli_prints_the_host_memory_first_and_sizes_the_lora_it_is_told(capsys, config_path):
    from tests.test_estimator_setups import real_trainable
    from tests.test_profiler_step import CONFIGS

    argv = ["estimate", "--model", config_path, "--seq-len", "1k", "--gpu-memory", "24MiB", "--modes", "hf"]
    argv += ["--reserve", "0GiB", "--no-search", "--trainable", "lora", *RECIPE_LORA]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith("WARNING: host memory ") and "THIS machine's RAM (no --host-memory given)" in lines[0]
    assert lines[1].startswith("WARNING: ") and "pass --host-memory with the training node's memory" in lines[1]
    assert "warning" not in err  # the table says it, first
    assert "LoRA r=16 on q_proj, k_proj, v_proj, o_proj; embed_tokens, norm trained in full" in lines[2]

    assert cli.main(argv + ["--json"]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out)  # stdout stays JSON: the warning goes to stderr
    assert record["host_memory_source"] == "this machine" and "warning: host memory" in err
    settings = {"r": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    trained = real_trainable(CONFIGS["llama"](6), modules_to_save=["embed_tokens", "norm"], **settings)
    assert record["trainable_parameters"] == trained
    # the profiled step's AdamW: fp32 moments of the adapters (rank 16 on q, k, v, o of 6 layers), bf16 ones of the
    # trainable copies (embeddings 500 x 64, 13 norms), a 4-byte step per parameter tensor
    adapters, copies = 6 * 16 * (2 * (64 + 64) + 2 * (64 + 32)), 500 * 64 + 13 * 64
    assert adapters + copies == trained
    optimizer = record["modes"]["hf"]["footprint"]["device"]["by_category"]["optimizer"]
    assert optimizer == 2 * 4 * adapters + 2 * 2 * copies + 4 * (6 * 4 * 2 + 1 + 13)

    assert cli.main(argv + ["--host-memory", "64GiB"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "Host memory: 64.00 GiB per node, from --host-memory."


def test_an_answer_at_the_search_cap_says_so_and_names_the_cap():
    from tests.test_profiler_step import CONFIGS

    found = estimate(CONFIGS["gpt2"](2), 512, gpu_memory="80GiB", modes=["hf"], progress=False)
    plain = found.modes["hf"]
    assert plain.longest_seq_len == 4096 and plain.longest_is_search_limit  # gpt2's learned positions
    assert plain.bound_by == plain.to_dict()["binding"] == "search cap"
    table = found.table()
    assert table.splitlines()[0].startswith("Host memory: no limit")
    bound = next(line for line in table.splitlines() if line.startswith("  bound by"))
    assert bound.split() == ["bound", "by", "search", "cap"] and "device" not in bound
    assert "≥ 4,096" in table
    assert (
        "search cap: the search for the longest sequence stops at 4,096 tokens (the model's learned positions)" in table
    )


def test_a_hub_id_neither_here_nor_in_the_cache_is_one_line_that_says_what_to_do(capsys, tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    argv = ["estimate", "--model", "meta-llama/Meta-Llama-3-8B", "--gpu-memory", "80GiB", "--host-memory", "1TiB"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a file here, nor a model in the local Hugging Face cache" in err
    assert "HF_HUB_OFFLINE is set" in err and "hf download meta-llama/Meta-Llama-3-8B config.json" in err


# -- the modes' names: MemoConfig's, the baselines named by what they are, the old names deprecated ----------------


def test_every_mode_of_hf_memo_is_estimated_under_memoconfigs_names(config_path, capsys):
    argv = ["estimate", "--model", config_path, "--seq-len", "4k", "--gpu-memory", "24MiB", "--reserve", "0GiB"]
    assert cli.main(argv + ["--json", "--modes", "selective,full,memo"]) == 0
    modes = json.loads(capsys.readouterr().out)["modes"]
    assert list(modes) == ["selective", "full", "memo"]
    for name, mode in modes.items():
        assert mode["footprint"]["device"]["total"] > 0 and mode["longest_seq_len"] > 0, name
    assert "recompute='selective'" in modes["selective"]["description"]
    assert "recompute='full'" in modes["full"]["description"]
    # selective keeps the matmul and attention outputs full recomputes: more memory, a longest sequence no longer
    selective, full = (modes[name]["footprint"]["device"]["total"] for name in ("selective", "full"))
    assert selective > full
    assert modes["selective"]["longest_seq_len"] <= modes["full"]["longest_seq_len"]


def test_the_old_names_still_answer_with_a_deprecation_note(config_path, capsys, result):
    with pytest.warns(FutureWarning, match="mode 'vanilla' is deprecated: say hf"):
        old = estimate(config_path, 4096, gpu_memory=24 * MiB, modes=["vanilla", "hf"], progress=False)
    assert list(old.modes) == ["hf"] and old.modes["hf"].to_dict() == result.modes["hf"].to_dict()
    argv = ["estimate", "--model", config_path, "--seq-len", "4k", "--gpu-memory", "24MiB", "--reserve", "0GiB"]
    assert cli.main(argv + ["--json", "--no-search", "--modes", "vanilla,minseq"]) == 0
    out = capsys.readouterr()
    assert list(json.loads(out.out)["modes"]) == ["hf", "minseq"]
    assert "warning: --modes 'vanilla' is deprecated: say hf" in out.err
    assert "warning: --modes 'minseq' is deprecated: it is hf_memo.apply(recompute='none') under" in out.err
    with pytest.raises(ValueError, match="modes must be a sequence naming at least one of hf, hf-checkpointing"):
        estimate(config_path, 4096, modes="hf")
