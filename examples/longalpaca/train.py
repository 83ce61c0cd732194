"""Long-context instruction fine-tuning on LongAlpaca-format data with hf_memo and the Hugging Face Trainer.

LongLoRA-style: RoPE scaled to the target context, LoRA on the attention projections with the
embeddings and norms trainable (or full fine-tuning), the loss on the answers only. hf_memo runs
the MLP and LM head in mini-sequences and (``--recompute memo``) the MEMO executor; ``MemoCallback``
plans memory before the first step and logs memory, tokens/s, MFU and alpha. Command lines for one
GPU, eight GPUs with sequence parallelism and DeepSpeed ZeRO-2 are in README.md next to this file.

Data: records with ``instruction``, ``output`` and optionally ``file`` (the source document's name,
kept as metadata only), from a local JSON/JSON-lines file or directory, or a dataset on the Hub.
Every record becomes ``prompt(instruction) + answer``; labels are -100 on the prompt. A record
longer than ``--max_seq_len`` loses the middle of its instruction (its beginning, the task, and its
end, the question, are kept); one whose answer alone does not fit is dropped. With ``--packing``
(the default) whole records are packed, in order, into rows of exactly ``--max_seq_len`` tokens
without padding between them: ``position_ids`` restart at 0 with each record, so records never
attend to each other (no attention mask), and the room a row has left becomes one filler sample
without targets: fixed shapes in every recompute mode and under ``--sequence_parallel_size``.
Without packing every record is a row of its own length, padded per batch with an attention mask.

Before training the run prints the ``hf-memo estimate`` command that sizes it (:func:`estimate_command`). After
training it saves what reloads right without hf_memo (:func:`save_result`): with LoRA, the adapter and tokenizer,
and in ``base/`` the base's config with RoPE scaled as trained (and the base's weights if it was randomly
initialised); with ``--merge`` or full fine-tuning, the whole model and tokenizer. It prints the lines that load it.
"""

from __future__ import annotations

import math
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from datasets import Dataset, load_dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
    set_seed,
)
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

import hf_memo
from hf_memo import MemoCallback, MemoConfig
from hf_memo.data import LONGALPACA_SAMPLE, LONGALPACA_TOKENIZER

PROMPT_FORMATS = ("llama2", "llama3")
ROPE_TYPES = ("none", "linear", "dynamic", "yarn")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
IGNORE = -100
BASE_DIR = "base"  # under --output_dir with LoRA: the base model's config (RoPE scaled) and, if random, weights
ESTIMATE_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass
class RecipeArguments:
    """What the recipe adds to ``TrainingArguments`` (``--help`` lists both)."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "pretrained model (Hub name or path)"})
    model_config: str | None = field(
        default=None,
        metadata={"help": "instead of weights: a config.json (or its directory) to build a randomly initialised model"},
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": f"tokenizer (default: the model's); offline: {LONGALPACA_TOKENIZER}"}
    )
    data: str = field(
        default=str(LONGALPACA_SAMPLE),
        metadata={"help": "LongAlpaca JSON file, directory or Hub name (default: the sample shipped with hf_memo)"},
    )
    data_split: str = field(default="train", metadata={"help": "split of a directory or Hub dataset"})
    max_samples: int | None = field(default=None, metadata={"help": "use only the first N records"})
    prompt_format: str = field(default="llama2", metadata={"help": "llama2 ([INST] ... [/INST]) or llama3 (headers)"})
    system_prompt: str = field(default="", metadata={"help": "system prompt (none by default)"})
    max_seq_len: int = field(default=8192, metadata={"help": "tokens per row"})
    packing: bool = field(
        default=True, metadata={"help": "pack whole records into rows of max_seq_len (position_ids restart)"}
    )
    rope_type: str = field(default="linear", metadata={"help": "RoPE scaling: none, linear, dynamic or yarn"})
    rope_factor: float | None = field(
        default=None, metadata={"help": "RoPE scaling factor (default: max_seq_len / the model's context, if > 1)"}
    )
    lora: bool = field(default=True, metadata={"help": "LoRA (else full fine-tuning)"})
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: str = field(default="q_proj,k_proj,v_proj,o_proj", metadata={"help": "comma-separated"})
    trainable_modules: str = field(
        default="embed_tokens,norm",
        metadata={"help": "modules trained in full next to LoRA (comma-separated, '' none)"},
    )
    merge: bool = field(
        default=False,
        metadata={"help": "with LoRA: save the model with the adapters merged in, instead of the adapter and its base"},
    )
    dtype: str = field(default="bfloat16", metadata={"help": "parameter dtype: bfloat16, float16 or float32"})
    use_hf_memo: bool = field(
        default=True, metadata={"help": "False: plain Hugging Face, without hf_memo (the baseline to compare with)"}
    )
    recompute: str = field(default="memo", metadata={"help": "hf_memo recompute: none, full, selective or memo"})
    offload_fraction: str = field(default="auto", metadata={"help": "memo: 'auto' or a fraction of tokens in [0, 1]"})
    host_memory_limit: str = field(default="auto", metadata={"help": "memo: host bytes for offloading, e.g. 64GiB"})
    planner: str = field(default="cpsat", metadata={"help": "memory planner: off, greedy, cpsat, mip or gurobi"})
    sequence_parallel_size: int = field(default=1, metadata={"help": "GPUs each sequence is split over (Ulysses)"})
    peak_tflops: float | None = field(
        default=None, metadata={"help": "peak TFLOP/s per GPU for MFU (default: known GPUs)"}
    )


def _choice(name: str, value: str, accepted: Sequence[str]) -> str:
    if value not in accepted:
        raise ValueError(f"--{name} must be one of {', '.join(accepted)}, got {value!r}")
    return value


def memo_config(recipe: RecipeArguments) -> MemoConfig:
    """The hf_memo config the recipe's flags describe."""
    fraction = recipe.offload_fraction
    try:
        fraction = fraction if fraction == "auto" else float(fraction)
    except ValueError:
        raise ValueError(f"--offload_fraction must be 'auto' or a number in [0, 1], got {fraction!r}") from None
    return MemoConfig(
        recompute=recipe.recompute,
        offload_fraction=fraction,
        host_memory_limit=recipe.host_memory_limit,
        planner=recipe.planner if recipe.recompute == "memo" else "off",  # the planner plans memo's buffers only
        sequence_parallel_size=recipe.sequence_parallel_size,
    )


# -- data ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PromptFormat:
    """Chat template around one instruction: ``head + instruction + tail + answer + end``.

    ``end`` ``None`` means the tokenizer's end-of-sequence token. The beginning-of-sequence token,
    if the tokenizer has one, comes first.
    """

    head: str
    tail: str
    end: str | None


def prompt_format(name: str, system_prompt: str = "") -> PromptFormat:
    """The Llama-2 (``[INST] ... [/INST]``) or Llama-3 (header tokens) chat format."""
    _choice("prompt_format", name, PROMPT_FORMATS)
    if name == "llama2":
        system = f"<<SYS>>\n{system_prompt}\n<</SYS>>\n\n" if system_prompt else ""
        return PromptFormat(head=f"[INST] {system}", tail=" [/INST] ", end=None)
    system = f"<|start_header_id|>system<|end_header_id|>\n\n{system_prompt}<|eot_id|>" if system_prompt else ""
    return PromptFormat(
        head=f"{system}<|start_header_id|>user<|end_header_id|>\n\n",
        tail="<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        end="<|eot_id|>",
    )


def load_records(data: str, split: str = "train") -> Dataset:
    """LongAlpaca records from a JSON / JSON-lines file, a dataset directory or a Hub dataset name."""
    path = Path(data)
    if path.is_file():
        records = load_dataset("json", data_files=str(path), split="train")
    elif path.is_dir():
        records = load_dataset(str(path), split=split)
    else:
        records = load_dataset(data, split=split)
    missing = {"instruction", "output"} - set(records.column_names)
    if missing:
        raise ValueError(
            f"--data {data}: LongAlpaca records need the fields instruction and output (file is optional); "
            f"missing {', '.join(sorted(missing))}, found {', '.join(records.column_names)}"
        )
    return records


def encode_record(
    instruction: str, output: str, tokenizer: PreTrainedTokenizerBase, fmt: PromptFormat, max_seq_len: int
) -> dict[str, list[int]] | None:
    """``input_ids`` and ``labels`` (-100 on the prompt) of one record, at most ``max_seq_len`` tokens.

    Too long: the middle of the instruction is cut. ``None`` if the answer alone does not fit.
    """

    def tokens(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    head, body, tail = bos + tokens(fmt.head), tokens(instruction), tokens(fmt.tail)
    answer = tokens(output) + ([tokenizer.eos_token_id] if fmt.end is None else tokens(fmt.end))
    room = max_seq_len - len(head) - len(tail) - len(answer)
    if room < 0:
        return None
    if len(body) > room:
        body = body[: room // 2] + body[len(body) - (room - room // 2) :]
    prompt = head + body + tail
    return {"input_ids": prompt + answer, "labels": [IGNORE] * len(prompt) + answer}


def pack_rows(encoded: dict[str, list[list[int]]], seq_len: int, pad_token_id: int) -> dict[str, list[list[int]]]:
    """Whole records, in order, into rows of exactly ``seq_len`` tokens with ``position_ids`` restarting per record.

    A record that does not fit in the room its row has left starts the next row; that room becomes a
    filler sample (``pad_token_id``, positions from 0, labels -100). Every record fits a row (at most
    ``seq_len`` tokens, see :func:`encode_record`).
    """
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
    row: dict[str, list[int]] = {key: [] for key in rows}

    def close() -> None:
        room = seq_len - len(row["input_ids"])
        row["input_ids"] += [pad_token_id] * room
        row["labels"] += [IGNORE] * room
        row["position_ids"] += list(range(room))
        for key in rows:
            rows[key].append(row[key])
            row[key] = []

    for ids, labels in zip(encoded["input_ids"], encoded["labels"]):
        if len(row["input_ids"]) + len(ids) > seq_len:
            close()
        row["input_ids"] += ids
        row["labels"] += labels
        row["position_ids"] += list(range(len(ids)))
    if row["input_ids"]:
        close()
    return rows


def training_rows(
    records: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    fmt: PromptFormat,
    max_seq_len: int,
    packing: bool,
    pad_token_id: int = 0,
) -> Dataset:
    """Rows of ``input_ids`` and ``labels``: packed (``position_ids`` too, see :func:`pack_rows`) or one record each."""

    def encode(batch: dict[str, list]) -> dict[str, list]:
        encoded = [
            encode_record(i, o, tokenizer, fmt, max_seq_len) for i, o in zip(batch["instruction"], batch["output"])
        ]
        kept = [e for e in encoded if e is not None]
        return {"input_ids": [e["input_ids"] for e in kept], "labels": [e["labels"] for e in kept]}

    rows = records.map(encode, batched=True, remove_columns=records.column_names, desc="tokenizing")
    if len(rows) < len(records):
        print(f"dropped {len(records) - len(rows)} records whose answer alone exceeds --max_seq_len {max_seq_len}")
    if packing:
        rows = rows.map(
            lambda batch: pack_rows(batch, max_seq_len, pad_token_id), batched=True, batch_size=None, desc="packing"
        )
    if len(rows) == 0:
        raise ValueError(f"no training rows of {max_seq_len} tokens: lower --max_seq_len or add data")
    return rows


@dataclass(frozen=True)
class Collator:
    """Stacks rows into ``(B, S)`` tensors (``position_ids`` too, for packed rows); rows of different lengths
    are padded (and get an attention mask)."""

    pad_token_id: int

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        longest = max(len(row["input_ids"]) for row in rows)
        if all(len(row["input_ids"]) == longest for row in rows):
            return {key: torch.tensor([row[key] for row in rows]) for key in rows[0] if key in _STACKED}
        batch = {"input_ids": [], "labels": [], "attention_mask": []}
        for row in rows:
            pad = longest - len(row["input_ids"])
            batch["input_ids"].append(list(row["input_ids"]) + [self.pad_token_id] * pad)
            batch["labels"].append(list(row["labels"]) + [IGNORE] * pad)
            batch["attention_mask"].append([1] * len(row["input_ids"]) + [0] * pad)
        return {key: torch.tensor(value) for key, value in batch.items()}


_STACKED = ("input_ids", "labels", "position_ids")


# -- model -----------------------------------------------------------------------------------------------------
def scale_rope(config: PretrainedConfig, max_seq_len: int, rope_type: str, factor: float | None = None) -> float | None:
    """Scale the model's RoPE for ``max_seq_len`` tokens in place; the factor used, or ``None`` if unchanged.

    ``factor`` defaults to ``max_seq_len / max_position_embeddings`` (no scaling when that is <= 1).
    ``linear`` is position interpolation (LongLoRA); ``dynamic`` NTK scaling and ``yarn`` are
    Transformers' (``config.rope_parameters``).
    """
    _choice("rope_type", rope_type, ROPE_TYPES)
    if rope_type == "none":
        return None
    params = getattr(config, "rope_parameters", None)
    if not params:
        raise ValueError(f"model_type {config.model_type!r} has no rotary embeddings to scale; use --rope_type none")
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"the model already scales RoPE ({params['rope_type']}); use --rope_type none to keep that")
    original = config.max_position_embeddings
    factor = factor if factor is not None else max_seq_len / original
    if factor <= 1:
        return None
    params = {**params, "rope_type": rope_type, "factor": float(factor)}
    if rope_type == "yarn":
        params["original_max_position_embeddings"] = original
    config.rope_parameters = params
    if rope_type != "dynamic":  # dynamic NTK reads the original context from max_position_embeddings
        config.max_position_embeddings = math.ceil(original * factor)
    return float(factor)


def load_model(recipe: RecipeArguments) -> PreTrainedModel:
    """The model from weights or from a config, RoPE scaled, SDPA attention, in ``--dtype``."""
    if (recipe.model_name_or_path is None) == (recipe.model_config is None):
        raise ValueError("give one of --model_name_or_path (pretrained weights) or --model_config (random init)")
    dtype = DTYPES.get(recipe.dtype)
    if dtype is None:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {recipe.dtype!r}")
    config = AutoConfig.from_pretrained(recipe.model_name_or_path or recipe.model_config)
    factor = scale_rope(config, recipe.max_seq_len, recipe.rope_type, recipe.rope_factor)
    if factor is not None:
        print(f"RoPE: {recipe.rope_type} scaling by {factor:g} for {recipe.max_seq_len} tokens")
    if recipe.model_name_or_path is not None:
        return AutoModelForCausalLM.from_pretrained(
            recipe.model_name_or_path, config=config, dtype=dtype, attn_implementation="sdpa"
        )
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")


def add_lora(model: PreTrainedModel, recipe: RecipeArguments) -> Any:
    """LoRA on ``--lora_target_modules``, with ``--trainable_modules`` trained in full (saved with the adapter)."""
    from peft import LoraConfig, get_peft_model

    trainable = [name for name in recipe.trainable_modules.split(",") if name]
    lora = LoraConfig(
        r=recipe.lora_r,
        lora_alpha=recipe.lora_alpha,
        lora_dropout=recipe.lora_dropout,
        target_modules=[name for name in recipe.lora_target_modules.split(",") if name],
        modules_to_save=trainable or None,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


# -- sizing and saving -----------------------------------------------------------------------------------------
def estimate_command(recipe: RecipeArguments, gpu_memory: str, host_memory: str, num_gpus: int = 1) -> str:
    """The ``hf-memo estimate`` command line that sizes this run: the recipe's model, dtype, trainable parameters
    (LoRA rank, targets and fully trained modules as given), length and parallelism, on ``gpu_memory`` per GPU
    and ``host_memory`` (sizes with a unit, e.g. ``80GiB``). It prints each mode's peak memory at ``--max_seq_len``
    and the longest length that fits."""
    words = ["hf-memo", "estimate", "--model", recipe.model_name_or_path or recipe.model_config]
    if recipe.lora:
        words += ["--trainable", "lora", "--lora-rank", str(recipe.lora_r)]
        words += ["--lora-targets", ",".join(name for name in recipe.lora_target_modules.split(",") if name)]
        modules = ",".join(name for name in recipe.trainable_modules.split(",") if name)
        words += ["--trainable-modules", modules] if modules else []
    else:
        words += ["--trainable", "full"]
    if recipe.dtype != "bfloat16":
        words += ["--dtype", ESTIMATE_DTYPES[recipe.dtype]]
    words += ["--seq-len", str(recipe.max_seq_len)]
    if num_gpus > 1:
        words += ["--num-gpus", str(num_gpus), "--sequence-parallel", str(recipe.sequence_parallel_size)]
    words += ["--gpu-memory", gpu_memory, "--host-memory", host_memory]
    return shlex.join(words)


def machine_memory(recipe: RecipeArguments, training: TrainingArguments) -> tuple[str, str]:
    """``(gpu_memory, host_memory)`` to size this run with: this GPU's memory (80GiB, an H100's, when training on
    CPU) and ``--host_memory_limit``, or this machine's memory when that is ``auto``."""
    gpu = 80 * 2**30
    if torch.cuda.is_available() and not training.use_cpu:
        gpu = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    host = recipe.host_memory_limit
    if host == "auto":
        host = f"{psutil.virtual_memory().total // 2**30}GiB"
    return f"{gpu // 2**30}GiB", host


def save_base(model: PreTrainedModel, recipe: RecipeArguments, folder: Path) -> None:
    """What the LoRA adapter needs beside it to reload right: the base's config, RoPE scaled as trained (loading the
    adapter onto the base's own config would silently use unscaled RoPE), and, for a randomly initialised base
    (``--model_config``), its weights: they exist nowhere else."""
    if recipe.model_config is not None:
        model.save_pretrained(folder)
        model.name_or_path = str(folder)  # the adapter's base_model_name_or_path: where its base now is
    else:
        model.config.save_pretrained(folder)


def load_snippet(recipe: RecipeArguments, output_dir: str) -> str:
    """Python lines that load what :func:`save_result` saved, with plain Transformers (and PEFT for an adapter)."""
    out = repr(str(output_dir))
    if not recipe.lora or recipe.merge:
        return (
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"model, tokenizer = AutoModelForCausalLM.from_pretrained({out}), AutoTokenizer.from_pretrained({out})"
        )
    base = repr(str(Path(output_dir) / BASE_DIR))
    if recipe.model_name_or_path is None:
        imports, base_model = "AutoModelForCausalLM", f"AutoModelForCausalLM.from_pretrained({base})"
    else:
        imports = "AutoConfig, AutoModelForCausalLM"
        base_model = (
            f"AutoModelForCausalLM.from_pretrained({recipe.model_name_or_path!r}, "
            f"config=AutoConfig.from_pretrained({base}))"
        )
    return (
        f"from peft import PeftModel; from transformers import {imports}, AutoTokenizer\n"
        f"model = PeftModel.from_pretrained({base_model}, {out})\n"
        f"tokenizer = AutoTokenizer.from_pretrained({out})"
    )


def save_result(trainer: Trainer, recipe: RecipeArguments) -> str:
    """Save the trained model so that it reloads right without hf_memo; the Python lines that load it.

    Full fine-tuning, or LoRA with ``--merge``: the whole model (its config with RoPE scaled) and the tokenizer in
    ``--output_dir``. LoRA: the adapter (with the ``--trainable_modules`` trained in full) and the tokenizer there,
    beside ``base/`` (:func:`save_base`, written by :func:`setup` before training). hf_memo, which changes no
    weights, is reverted first, and LoRA is merged in place: call this last.
    """
    output_dir = trainer.args.output_dir
    if recipe.use_hf_memo:
        hf_memo.revert(trainer.model)
    if recipe.lora and recipe.merge:
        merged = trainer.model.merge_and_unload()
        if trainer.args.should_save:
            merged.save_pretrained(output_dir)
            trainer.processing_class.save_pretrained(output_dir)
    else:
        trainer.save_model()
    return load_snippet(recipe, output_dir)


# -- main ------------------------------------------------------------------------------------------------------
def setup(recipe: RecipeArguments, training: TrainingArguments) -> Trainer:
    """Data, model, hf_memo and the Trainer; ``ValueError`` for contradictory or bad arguments."""
    config = memo_config(recipe)
    if not recipe.use_hf_memo and config.sequence_parallel_size > 1:
        raise ValueError("--sequence_parallel_size needs hf_memo; drop --use_hf_memo False")
    if recipe.merge and not recipe.lora:
        raise ValueError("--merge merges the LoRA adapters into the model: it needs --lora (the default)")
    if is_deepspeed_zero3_enabled() and recipe.lora and (recipe.merge or recipe.model_config is not None):
        raise ValueError(
            "--merge and LoRA on a randomly initialised base (--model_config) save whole weights, which ZeRO-3 "
            "partitions: save the adapter of a pretrained base, then merge it after training"
        )
    if recipe.max_seq_len < 2:
        raise ValueError(f"--max_seq_len must be >= 2, got {recipe.max_seq_len}")
    fmt = prompt_format(recipe.prompt_format, recipe.system_prompt)
    tokenizer = AutoTokenizer.from_pretrained(recipe.tokenizer or recipe.model_name_or_path or recipe.model_config)
    records = load_records(recipe.data, recipe.data_split)
    if recipe.max_samples is not None:
        records = records.select(range(min(recipe.max_samples, len(records))))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with training.main_process_first(desc="tokenizing"):
        rows = training_rows(records, tokenizer, fmt, recipe.max_seq_len, recipe.packing, pad)
    set_seed(training.seed)  # a randomly initialised base is the same on every rank and on resuming
    model = load_model(recipe)
    if len(tokenizer) > model.config.get_text_config().vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary {model.config.vocab_size}"
        )
    if recipe.lora:
        if not recipe.merge and training.should_save:
            save_base(model, recipe, Path(training.output_dir) / BASE_DIR)
        model = add_lora(model, recipe)
    if recipe.use_hf_memo:
        hf_memo.apply(model, config)
    peak = None if recipe.peak_tflops is None else recipe.peak_tflops * 1e12
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=rows,
        data_collator=Collator(pad),
        processing_class=tokenizer,
        callbacks=[MemoCallback(peak_flops=peak)] if recipe.use_hf_memo else [],
    )
    if config.sequence_parallel_size > 1:
        from hf_memo.integrations.accelerate import attach

        attach(trainer.accelerator, trainer.model)
    what = f"hf_memo recompute={config.recompute!r}, planner={config.planner!r}" if recipe.use_hf_memo else "plain HF"
    print(f"{len(rows)} rows of up to {recipe.max_seq_len} tokens from {len(records)} records; {what}")
    command = estimate_command(recipe, *machine_memory(recipe, training), num_gpus=training.world_size)
    print(f"Memory of this run per mode, and the longest --max_seq_len that fits: {command}")
    return trainer


def main(argv: Sequence[str] | None = None) -> int:
    parser = HfArgumentParser((RecipeArguments, TrainingArguments))
    recipe, training = parser.parse_args_into_dataclasses(args=argv)
    try:
        trainer = setup(recipe, training)
    except (ValueError, FileNotFoundError) as error:
        print(f"train.py: error: {error}", file=sys.stderr)
        return 2
    resume = training.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "last"):
        resume = True  # the last checkpoint in --output_dir
    result = trainer.train(resume_from_checkpoint=resume)
    snippet = save_result(trainer, recipe)
    callback = next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MemoCallback)), None)
    if callback is not None and callback.plan_path is not None:
        print(f"memory plan ({callback.plan_source}): {callback.plan_path}")
    print(f"trained {result.global_step} steps, mean loss {result.training_loss:.4f}; model in {training.output_dir}")
    needs = "Transformers and PEFT" if recipe.lora and not recipe.merge else "Transformers"
    print(f"Load it with plain {needs} (no hf_memo):\n" + "\n".join(f"    {line}" for line in snippet.splitlines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
