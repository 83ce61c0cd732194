"""The LongAlpaca recipe (examples/longalpaca/): sample data, prompt formats, packing, RoPE scaling, end to end."""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, HfArgumentParser, LlamaConfig, LlamaForCausalLM

import hf_memo
from hf_memo.data import LONGALPACA_DIR, LONGALPACA_SAMPLE, LONGALPACA_TOKENIZER
from hf_memo.integrations.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "longalpaca"
TOKENIZER = LONGALPACA_TOKENIZER


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"longalpaca_{name}", RECIPE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recipe():
    return load_script("train")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def tiny_config(path: Path, **overrides) -> Path:
    config = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=128,
    )
    LlamaConfig(**{**config, **overrides}).to_json_file(path)
    return path


def test_shipped_sample_is_what_the_generator_makes_and_small(tmp_path):
    load_script("make_sample").write_sample(tmp_path)
    assert (tmp_path / "sample.json").read_bytes() == LONGALPACA_SAMPLE.read_bytes()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "sample_tokenizer" / name).read_bytes() == (TOKENIZER / name).read_bytes()
    assert LONGALPACA_SAMPLE.stat().st_size < 400_000
    shipped = sorted(path.relative_to(LONGALPACA_DIR) for path in LONGALPACA_DIR.rglob("*") if path.is_file())
    assert shipped == sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*") if path.is_file())
    assert not list(RECIPE.glob("sample*"))  # one copy: the package's


def test_sample_records_are_longalpaca_format_and_answers_come_from_their_document(tokenizer):
    records = json.loads(LONGALPACA_SAMPLE.read_text())
    assert len(records) == 40
    assert len({record["file"] for record in records}) == 40
    for record in records:
        assert set(record) == {"instruction", "output", "file"}
        document, question = record["instruction"].rsplit("Question: ", 1)
        assert len(tokenizer(document)["input_ids"]) > 1000  # long documents
        for name in re.findall(r"\b[A-Z][a-z]{3,}\b", record["output"]):
            assert name in document, f"{record['file']}: {name} is not in the document"
    assert len(tokenizer) == 4096


def test_llama2_record_masks_the_prompt_and_keeps_the_answer(recipe, tokenizer):
    fmt = recipe.prompt_format("llama2")
    encoded = recipe.encode_record("Read this. What is it?", "A test.", tokenizer, fmt, 64)
    ids, labels = encoded["input_ids"], encoded["labels"]
    answer = tokenizer("A test.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ids[0] == tokenizer.bos_token_id and ids[-len(answer) :] == answer
    assert labels == [-100] * (len(ids) - len(answer)) + answer
    assert tokenizer.decode(ids[: -len(answer)]) == "<s>[INST] Read this. What is it? [/INST] "


def test_llama3_record_uses_the_header_tokens_and_ends_with_eot(recipe, tokenizer):
    fmt = recipe.prompt_format("llama3", system_prompt="Be brief.")
    encoded = recipe.encode_record("Question?", "Answer.", tokenizer, fmt, 64)
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert encoded["input_ids"][-1] == encoded["labels"][-1] == eot
    text = tokenizer.decode(encoded["input_ids"])
    assert text.startswith("<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>")
    assert "<|start_header_id|>assistant<|end_header_id|>\n\nAnswer.<|eot_id|>" in text
    assert tokenizer.decode([t for t in encoded["labels"] if t != -100]) == "Answer.<|eot_id|>"


def test_long_instructions_lose_their_middle_and_answers_that_do_not_fit_drop_the_record(recipe, tokenizer):
    fmt = recipe.prompt_format("llama2")
    instruction = "Task first. " + " ".join(f"filler{i}" for i in range(200)) + " The question last?"
    encoded = recipe.encode_record(instruction, "Short answer.", tokenizer, fmt, 80)
    assert len(encoded["input_ids"]) == 80
    prompt = tokenizer.decode([t for t, label in zip(encoded["input_ids"], encoded["labels"]) if label == -100])
    assert prompt.startswith("<s>[INST] Task first. filler0") and prompt.endswith("The question last? [/INST] ")
    assert "filler100" not in prompt
    assert recipe.encode_record("Q?", " ".join(["word"] * 100), tokenizer, fmt, 50) is None


def test_packing_puts_whole_records_in_order_into_full_rows_with_restarting_positions(recipe, tokenizer):
    records = recipe.load_records(str(LONGALPACA_SAMPLE))
    rows = recipe.training_rows(records, tokenizer, recipe.prompt_format("llama2"), 4096, packing=True, pad_token_id=0)
    encoded = [
        recipe.encode_record(r["instruction"], r["output"], tokenizer, recipe.prompt_format("llama2"), 4096)
        for r in records
    ]
    assert all(len(row) == 4096 for key in ("input_ids", "labels", "position_ids") for row in rows[key])
    samples = []  # each row cut where its positions restart: the records in order, then one filler sample
    for ids, labels, positions in zip(rows["input_ids"], rows["labels"], rows["position_ids"]):
        starts = [t for t, p in enumerate(positions) if p == 0] + [4096]
        row_samples = [(ids[a:b], labels[a:b]) for a, b in zip(starts, starts[1:])]
        assert positions == [p for a, b in zip(starts, starts[1:]) for p in range(b - a)]
        if set(row_samples[-1][0]) == {0}:
            assert set(row_samples[-1][1]) == {-100}
            row_samples.pop()
        assert any(label != -100 for _, labels in row_samples for label in labels)
        samples += row_samples
    assert samples == [(e["input_ids"], e["labels"]) for e in encoded]
    assert len(rows) < len(records)  # several records share a row
    unpacked = recipe.training_rows(records, tokenizer, recipe.prompt_format("llama2"), 4096, packing=False)
    assert len(unpacked) == len(records) and [len(r) for r in unpacked["input_ids"]] == [
        len(e["input_ids"]) for e in encoded
    ]


def test_records_without_the_longalpaca_fields_are_refused(recipe, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"prompt": "x", "output": "y"}]))
    with pytest.raises(ValueError, match="need the fields instruction and output .* missing instruction"):
        recipe.load_records(str(path))


def test_collator_stacks_equal_rows_and_pads_unequal_ones_with_a_mask(recipe):
    collate = recipe.Collator(pad_token_id=0)
    batch = collate([{"input_ids": [5, 6], "labels": [-100, 6]}, {"input_ids": [7, 8], "labels": [7, 8]}])
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].tolist() == [[5, 6], [7, 8]]
    packed = [{"input_ids": [5, 6], "labels": [-100, 6], "position_ids": [0, 0]}] * 2
    assert collate(packed)["position_ids"].tolist() == [[0, 0], [0, 0]]
    batch = collate([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8], "labels": [8]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_rope_scaling_for_a_longer_context(recipe):
    config = LlamaConfig(max_position_embeddings=128, hidden_size=32, num_attention_heads=4)
    plain = LlamaForCausalLM(config).model.rotary_emb.inv_freq
    assert recipe.scale_rope(config, 512, "linear") == 4.0
    assert config.rope_parameters["rope_type"] == "linear" and config.max_position_embeddings == 512
    torch.testing.assert_close(LlamaForCausalLM(config).model.rotary_emb.inv_freq, plain / 4)  # interpolation

    yarn = LlamaConfig(max_position_embeddings=128)
    assert recipe.scale_rope(yarn, 300, "yarn") == 300 / 128
    assert yarn.rope_parameters["original_max_position_embeddings"] == 128
    assert yarn.max_position_embeddings == 300
    dynamic = LlamaConfig(max_position_embeddings=128)
    assert recipe.scale_rope(dynamic, 256, "dynamic", factor=3.0) == 3.0 and dynamic.max_position_embeddings == 128

    unchanged = LlamaConfig(max_position_embeddings=1024)
    assert recipe.scale_rope(unchanged, 512, "linear") is None and recipe.scale_rope(unchanged, 4096, "none") is None
    assert unchanged.rope_parameters["rope_type"] == "default"
    with pytest.raises(ValueError, match=r"already scales RoPE \(linear\)"):
        recipe.scale_rope(config, 4096, "linear")
    with pytest.raises(ValueError, match="model_type 'gpt2' has no rotary embeddings"):
        recipe.scale_rope(GPT2Config(), 4096, "linear")
    with pytest.raises(ValueError, match="--rope_type must be one of none, linear, dynamic, yarn, got 'ntk'"):
        recipe.scale_rope(unchanged, 4096, "ntk")


def run_recipe(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, str(RECIPE / "train.py"), "--use_cpu", "--report_to", "none", *arguments]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def test_recipe_end_to_end_with_lora_memo_packing_and_rope_scaling_then_resumed(tmp_path):
    out = tmp_path / "out"
    arguments = [
        *("--model_config", str(tiny_config(tmp_path / "tiny.json")), "--tokenizer", str(TOKENIZER)),
        *("--max_seq_len", "256", "--per_device_train_batch_size", "2", "--logging_steps", "1"),
        *("--dtype", "float32", "--planner", "greedy", "--save_steps", "3", "--output_dir", str(out)),
    ]
    result = run_recipe(tmp_path, *arguments, "--max_steps", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RoPE: linear scaling by 2 for 256 tokens" in result.stdout
    assert "40 rows of up to 256 tokens from 40 records; hf_memo recompute='memo', planner='greedy'" in result.stdout
    assert f"memory plan (planned): {out / 'hf_memo_plan.json'}" in result.stdout
    assert "trained 3 steps" in result.stdout
    logged = [line for line in result.stdout.splitlines() if "hf_memo/tokens_per_second" in line]
    assert len(logged) == 3 and all("'hf_memo/alpha'" in line for line in logged)
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and set(adapter["modules_to_save"]) == {"embed_tokens", "norm"}
    assert adapter["base_model_name_or_path"] == str(out / "base")
    assert (out / "adapter_model.safetensors").is_file() and (out / "checkpoint-3").is_dir()
    assert (out / "tokenizer.json").is_file() and (out / "base" / "model.safetensors").is_file()
    assert json.loads((out / "base" / "config.json").read_text())["rope_parameters"]["factor"] == 2.0
    assert (
        "Load it with plain Transformers and PEFT (no hf_memo):\n"
        "    from peft import PeftModel; from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(out / 'base')!r}), "
        f"{str(out)!r})\n"
        f"    tokenizer = AutoTokenizer.from_pretrained({str(out)!r})"
    ) in result.stdout
    assert re.search(
        r"the longest --max_seq_len that fits: hf-memo estimate --model \S+tiny.json --trainable lora --lora-rank 8 "
        r"--lora-targets q_proj,k_proj,v_proj,o_proj --trainable-modules embed_tokens,norm --dtype fp32 --seq-len 256 "
        r"--gpu-memory 80GiB --host-memory \d+GiB$",
        result.stdout,
        flags=re.MULTILINE,
    )
    base = (out / "base" / "model.safetensors").read_bytes()

    resumed = run_recipe(tmp_path, *arguments, "--max_steps", "4", "--resume_from_checkpoint", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"memory plan (reused): {out / 'hf_memo_plan.json'}" in resumed.stdout
    assert "trained 4 steps" in resumed.stdout
    assert (out / "base" / "model.safetensors").read_bytes() == base  # the seeded random base the adapter trained on


# Loads both results in a process that never imports hf_memo, with the lines the recipe printed; writes the logits
# of the same tokens (longer than the base's 128-token context: RoPE's scaling shows) and what the configs say.
LOAD_IN_PLAIN_TRANSFORMERS = """
import json, sys
import torch
torch.set_num_threads(1)
ids, results = torch.load(sys.argv[1]), {}
for name, snippet in json.loads(sys.argv[2]).items():
    exec(snippet)
    with torch.no_grad():
        results[name] = {
            "logits": model.eval()(input_ids=ids).logits,
            "rope": model.config.rope_parameters,
            "context": model.config.max_position_embeddings,
            "tokenizer": len(tokenizer),
        }
    if name == "adapter":
        with model.disable_adapter(), torch.no_grad():
            results["base"] = {"logits": model(input_ids=ids).logits}
assert not [module for module in sys.modules if module.split(".")[0] == "hf_memo"]
torch.save(results, sys.argv[3])
"""


def test_recipe_saves_what_reloads_in_plain_transformers_as_adapter_and_merged(recipe, tmp_path):
    arguments = [
        *("--model_config", str(tiny_config(tmp_path / "tiny.json")), "--tokenizer", str(TOKENIZER)),
        *("--max_seq_len", "256", "--max_samples", "8", "--max_steps", "2", "--per_device_train_batch_size", "1"),
        *("--learning_rate", "1e-2", "--dtype", "float32", "--planner", "greedy", "--use_cpu", "--report_to", "none"),
        *("--save_strategy", "no", "--disable_tqdm", "True", "--output_dir", str(tmp_path / "adapter")),
    ]
    parser = HfArgumentParser((recipe.RecipeArguments, recipe.TrainingArguments))
    recipe_args, training = parser.parse_args_into_dataclasses(args=arguments)
    trainer = recipe.setup(recipe_args, training)
    trainer.train()
    ids = torch.randint(4096, (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = hf_memo.revert(trainer.model).eval()(input_ids=ids).logits
    snippets = {"adapter": recipe.save_result(trainer, recipe_args)}
    recipe_args.merge, trainer.args.output_dir = True, str(tmp_path / "merged")
    snippets["merged"] = recipe.save_result(trainer, recipe_args)
    assert "PeftModel" not in snippets["merged"] and not (tmp_path / "merged" / "adapter_config.json").exists()

    torch.save(ids, tmp_path / "ids.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    script = [LOAD_IN_PLAIN_TRANSFORMERS, str(tmp_path / "ids.pt"), json.dumps(snippets), str(tmp_path / "out.pt")]
    loaded = subprocess.run([sys.executable, "-c", *script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    results = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(results["adapter"]["logits"], trained, rtol=0, atol=1e-6)  # the same operations
    torch.testing.assert_close(results["merged"]["logits"], trained, rtol=0, atol=1e-5)  # W + BA folded: rounding
    assert (results["base"]["logits"] - trained).abs().max() > 1e-2  # training moved it: the comparison could fail
    for name in ("adapter", "merged"):
        rope = results[name]["rope"]
        assert (rope["rope_type"], rope["factor"], results[name]["context"]) == ("linear", 2.0, 256)
        assert results[name]["tokenizer"] == 4096


def test_recipe_full_fine_tuning_llama3_one_record_per_row(recipe, tmp_path, capsys):
    out = tmp_path / "out"
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = recipe.main(
            [
                *("--model_config", str(tiny_config(tmp_path / "tiny.json", max_position_embeddings=4096))),
                *("--tokenizer", str(TOKENIZER), "--prompt_format", "llama3", "--packing", "False"),
                *("--lora", "False", "--recompute", "selective", "--max_seq_len", "4096", "--max_samples", "4"),
                *("--max_steps", "2", "--per_device_train_batch_size", "2", "--dtype", "float32", "--use_cpu"),
                *("--report_to", "none", "--save_strategy", "no", "--output_dir", str(out), "--disable_tqdm", "True"),
            ]
        )
    finally:
        torch.set_num_threads(torch_threads)
    assert code == 0
    printed = capsys.readouterr().out
    assert "4 rows of up to 4096 tokens from 4 records; hf_memo recompute='selective'" in printed
    assert "RoPE" not in printed  # the records fit the model's context: rows of their own lengths, padded
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_recipe_refuses_bad_choices(recipe, tmp_path, capsys):
    base = ["--model_config", str(tiny_config(tmp_path / "tiny.json")), "--tokenizer", str(TOKENIZER), "--use_cpu"]
    assert recipe.main([*base, "--prompt_format", "chatml"]) == 2
    assert "--prompt_format must be one of llama2, llama3, got 'chatml'" in capsys.readouterr().err
    assert recipe.main([*base, "--model_name_or_path", "some/model"]) == 2
    assert "give one of --model_name_or_path" in capsys.readouterr().err
    assert recipe.main([*base, "--recompute", "twice"]) == 2
    assert "MemoConfig.recompute must be one of" in capsys.readouterr().err
    assert recipe.main([*base, "--use_hf_memo", "False", "--sequence_parallel_size", "2"]) == 2
    assert "--sequence_parallel_size needs hf_memo" in capsys.readouterr().err
    assert recipe.main([*base, "--lora", "False", "--merge", "True"]) == 2
    assert "--merge merges the LoRA adapters into the model: it needs --lora" in capsys.readouterr().err


def test_recipe_refuses_to_save_whole_weights_that_zero3_partitions(recipe, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(recipe, "is_deepspeed_zero3_enabled", lambda: True)
    base = ["--model_config", str(tiny_config(tmp_path / "tiny.json")), "--tokenizer", str(TOKENIZER), "--use_cpu"]
    assert recipe.main(base) == 2
    assert "LoRA on a randomly initialised base (--model_config) save whole weights, which ZeRO-3" in (
        capsys.readouterr().err
    )


def test_estimate_command_names_the_recipes_trainable_parameters_and_parses(recipe):
    recipe_args = recipe.RecipeArguments(model_name_or_path="meta-llama/Meta-Llama-3-8B", max_seq_len=32768)
    command = recipe.estimate_command(recipe_args, "80GiB", "128GiB")
    assert command == (
        "hf-memo estimate --model meta-llama/Meta-Llama-3-8B --trainable lora --lora-rank 8 "
        "--lora-targets q_proj,k_proj,v_proj,o_proj --trainable-modules embed_tokens,norm --seq-len 32768 "
        "--gpu-memory 80GiB --host-memory 128GiB"
    )
    full = recipe.RecipeArguments(
        model_config="tiny.json", lora=False, dtype="float32", max_seq_len=4096, sequence_parallel_size=4
    )
    assert recipe.estimate_command(full, "139GiB", "64GiB", num_gpus=8) == (
        "hf-memo estimate --model tiny.json --trainable full --dtype fp32 --seq-len 4096 --num-gpus 8 "
        "--sequence-parallel 4 --gpu-memory 139GiB --host-memory 64GiB"
    )
    for line in (command, recipe.estimate_command(full, "139GiB", "64GiB", num_gpus=8)):
        words = shlex.split(line)[1:]
        args = build_parser("estimate").parse_args(words)  # every flag exists (a typo exits with a suggestion)
        assert (args.command, args.seq_len) == ("estimate", words[words.index("--seq-len") + 1])
