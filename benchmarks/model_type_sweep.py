"""hf_memo on many transformers decoder-only model types, as a user who brings their own model would.

Each model type is built tiny and random from its config class (hidden size 32, 2 layers, 4 attention heads, 2
key/value heads, 128 tokens of vocabulary, 4 experts top-2 for mixture-of-experts types; dropout off; sliding
windows and attention chunks shrunk to ``WINDOW`` tokens so that they cut the batch) in fp64, in training mode. For
every recompute mode and batch layout, a copy patched with ``hf_memo.apply`` (mlp_chunks=3, lm_head_chunks=2, memo
offloading half the tokens) runs one training step, and its loss and every parameter's gradient are compared with
those of the unpatched model. Each (type, mode, layout) is reported as

- EXACT: loss within ``LOSS_TOLERANCE`` and every gradient within ``GRAD_TOLERANCE`` (both relative) of the
  unpatched model's (transformers' loss upcasts to fp32, some families compute norms or softmax in fp32);
- WRONG: silently different (the worst parameter is named), or a gradient present on one side only;
- CRASH: an exception that is not hf_memo's refusal (a hung or killed type's missing runs included);
- REFUSED: hf_memo raised a ``ValueError`` whose message starts with "hf_memo" (at ``apply`` or by its self-check
  on the first training step).

A type whose config or model does not build is BUILD-FAIL; one whose unpatched model fails on a layout is
REF-FAIL there; neither counts. A ``!`` after a status marks a reference whose loss or gradients are not finite
(a comparison of NaN with NaN is no proof). The layouts: "plain" (2 rows x 29 tokens, no attention mask) and
"padded" (the second row right-padded by 7 tokens, its mask 0 and labels -100 there); about 30% of the labels are
-100 in both.

Each type runs in its own Python process (this script with ``--one TYPE``) with a timeout, at most ``--jobs`` at a
time, so that a crash or hang of one type does not stop the sweep.

    python benchmarks/model_type_sweep.py                          # the default types, all modes and layouts
    python benchmarks/model_type_sweep.py --all                    # also every causal-LM model type of transformers
    python benchmarks/model_type_sweep.py --types llama,gpt2 --modes none,memo --layouts plain --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

import hf_memo
from hf_memo.config import RECOMPUTE_MODES, MemoConfigWarning
from hf_memo.patches.registry import TESTED_MODEL_TYPES

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).parent / "results" / "2026-11-29-cpu" / "model_type_sweep.json"
DEFAULT_TYPES = [
    *TESTED_MODEL_TYPES,  # the catalog, then types outside it
    "ernie4_5",
    "ernie4_5_moe",
    "hunyuan_v1_dense",
    "seed_oss",
    "apertus",
    "arcee",
    "phi",
    "gptj",
    "codegen",
    "persimmon",
    "granitemoe",
    "granitemoeshared",
    "glm",
    "qwen3_vl_text",
    "aria_text",
    "helium",
    "falcon",
    "falcon-new",
    "doge",
    "doge-moe",
    "stablelm",
    "nemotron",
    "bloom",
    "olmo",
    "jetmoe",
    "deepseek_v3",
    "deepseek_v2",
    "falcon_h1",
    "llama4_text",
    "llama4_text-nochunk",
    "gemma3n_text",
    "gemma3n_text-noshare",
    "gpt_neox",
    "mpt",
    "dbrx",
    "glm4_moe",
    "hunyuan_v1_moe",
    "dots1",
    "minimax",
    "bitnet",
    # types no issue named, tried as a user bringing one would (2026-11-28, second sweep)
    "vaultgemma",
    "flex_olmo",
    "minimax_m2",
    "phimoe",
    "exaone_moe",
    "cohere2_moe",
    "gpt_bigcode",
    "opt",
    "xglm",
    "biogpt",
    "diffllama",
    "afmoe",
    "glm4_moe_lite",
    "minicpm3",
    "nanochat",
    "ministral3",
    "granite_swa",
    "jais2",
    "solar_open",
    "cwm",
    "hyperclovax",
    "longcat_flash",
    "lfm2",
    "qwen3_next",
    "mellum",
    "olmo_hybrid",
    "laguna",
    "youtu",
    # tried 2026-11-29 (third sweep): Gemma 4 with and without its per-layer inputs
    "gemma4_text",
    "gemma4_text-noperlayer",
]
LAYOUTS = ("plain", "padded")
LOSS_TOLERANCE = 1e-6
GRAD_TOLERANCE = 1e-5
ROWS, TOKENS, PADDING, VOCAB, WINDOW = 2, 29, 7, 128, 8
MAX_PARAMETERS = 5_000_000  # a model this large was not shrunk (a size field the shrinker does not know)
_TINY = 1e-30

# The generic shrink: a config field of one of these names (or an alias that ``attribute_map`` maps to one) is set
# to the value wherever the config class has it; nested configs (text/vision configs, DBRX's attention and FFN
# configs) are shrunk alike.
SIZES: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "n_embd": 32,
    "d_model": 32,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "n_layers": 2,
    "n_layer": 2,
    "depth": 2,
    "num_attention_heads": 4,
    "num_heads": 4,
    "n_heads": 4,
    "n_head": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "n_kv_heads": 2,
    "kv_n_heads": 2,
    "multi_query_group_num": 2,
    "head_dim": 8,
    "rotary_dim": 4,
    "intermediate_size": 48,
    "ffn_hidden_size": 48,
    "n_inner": 48,
    "ffn_dim": 48,
    "d_ff": 48,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "n_ctx": 128,
    "max_seq_len": 128,
    "seq_length": 128,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_top_k": 2,
    "moe_k": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "mamba_d_ssm": 32,
    "mamba_n_heads": 4,
    "mamba_d_head": 8,
    "mamba_d_state": 16,
    "mamba_chunk_size": 16,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
WINDOWED = ("sliding_window", "attention_chunk_size")  # shrunk to WINDOW tokens where the default is an int
# Types (and variants) that need specific config fields to build, or to be what their name says; a nested dict
# holds the fields of a nested config.
OVERRIDES: dict[str, dict[str, Any]] = {
    "falcon-new": {"new_decoder_architecture": True},
    "doge-moe": {"is_moe": True},
    # DbrxAttention reads rope_theta, which the stock DbrxAttentionConfig lacks, and clamps by clip_qkv (None fails)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # multi-head latent attention has as many key/value heads as query heads (SDPA with a mask fails on fewer)
    "deepseek_v2": {"num_key_value_heads": 4},
    "deepseek_v3": {"num_key_value_heads": 4, "first_k_dense_replace": 1},  # else no MoE layer in 2 (3 dense first)
    "dots1": {"n_shared_experts": 1},  # its MoE layers multiply moe_intermediate_size by it (default None)
    # KV sharing of the last layer (2 layers, both sliding: the default 15 shared layers cannot hold); the per-layer
    # input embeddings shrunk (262144 x 256 by default)
    "gemma3n_text": {"num_kv_shared_layers": 1, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8},
    # the rest of Gemma-3n (AltUp, LAuReL, per-layer inputs) without the KV sharing that is refused
    "gemma3n_text-noshare": {
        "num_kv_shared_layers": 0,
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 8,
    },
    "llama4_text-nochunk": {"attention_chunk_size": None},  # Llama 4 with its chunked attention off
    # a heterogeneous config: the full-attention layer's heads twice as wide as the sliding layer's (as Gemma 4's)
    "gemma4_text": {
        "per_layer_config": {1: {"head_dim": 2 * SIZES["head_dim"]}},
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 8,
    },
    # ... and without per-layer input embeddings (Gemma 4's larger models)
    "gemma4_text-noperlayer": {
        "per_layer_config": {1: {"head_dim": 2 * SIZES["head_dim"]}},
        "hidden_size_per_layer_input": 0,
    },
    # one global and one local layer (the default pattern names 24), the local window cutting the rows
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": WINDOW},
    # multi-head latent attention (as DeepSeek-V2 above): as many key/value heads as query heads
    **{
        name: {"num_key_value_heads": 4}
        for name in ("glm4_moe_lite", "minicpm3", "youtu", "axk1", "axk2", "deepseek_v32", "glm_moe_dsa", "sarvam_mla")
    },
    # ... and LongCat-Flash's rotary embedding is head_dim wide, which must be the rotated part of a head
    "longcat_flash": {"num_key_value_heads": 4, "head_dim": SIZES["qk_rope_head_dim"]},
}
# Types whose unpatched model builds tensors of torch's default dtype inside its fp64 forward (XGLM's attention fills
# masked scores with a float64 minimum through ``torch.full``, which overflows fp32): their process runs with fp64 as
# the default dtype.
DEFAULT_FP64 = {"xglm"}
VARIANTS = {
    "falcon-new": "falcon",
    "doge-moe": "doge",
    "llama4_text-nochunk": "llama4_text",
    "gemma3n_text-noshare": "gemma3n_text",
    "gemma4_text-noperlayer": "gemma4_text",
}  # variant -> its model_type
# Text model types without a causal LM class of their own: built as the text config of this multimodal model.
CONTAINERS = {"qwen3_vl_text": "qwen3_vl"}


def model_type_of(name: str) -> str:
    """The transformers ``model_type`` of a sweep entry (itself, or the type a variant varies)."""
    return VARIANTS.get(name, name)


def shrunk_config(config_class: type[PreTrainedConfig], fields: dict[str, Any]) -> PreTrainedConfig:
    """``config_class`` shrunk generically (:data:`SIZES`, dropout 0, windows of ``WINDOW``), then ``fields`` set."""
    default = config_class()
    default.allow_global_per_layer_attribute_access = True  # a heterogeneous config's global values are shrunk too
    aliases = {target: alias for alias, target in config_class.attribute_map.items()}
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(config_class):
        name, value = field.name, getattr(default, field.name, None)
        canonical = name if name in SIZES else aliases.get(name)
        if isinstance(value, PreTrainedConfig):
            kwargs[name] = shrunk_config(type(value), fields.get(name, {}))
        elif canonical in SIZES:
            kwargs[name] = SIZES[canonical]
        elif ("dropout" in name or "pdrop" in name) and isinstance(value, float):
            kwargs[name] = 0.0
        elif name in WINDOWED and isinstance(value, int):
            kwargs[name] = WINDOW
    kwargs.update({name: value for name, value in fields.items() if not isinstance(value, dict)})
    config = config_class(**kwargs)
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"  # grouped_mm has no fp64 kernel on the CPU
    return config


def build_model(name: str) -> PreTrainedModel:
    """The tiny fp64 model of sweep entry ``name``, its weights drawn from seed 0, in training mode."""
    model_type = model_type_of(name)
    fields = OVERRIDES.get(name, {})
    if model_type in CONTAINERS:
        model_type, fields = CONTAINERS[model_type], {"text_config": fields}
    config = shrunk_config(CONFIG_MAPPING[model_type], fields)
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(
        model_type
    )
    if class_name is None:
        raise ValueError(f"no causal LM class for model_type {model_type!r}")
    model_class = getattr(transformers, class_name)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in model_class(config).parameters())
    if parameters > MAX_PARAMETERS:
        raise ValueError(f"{parameters:,} parameters: a size field of {type(config).__name__} was not shrunk")
    if model_type in DEFAULT_FP64:
        torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    return model_class(config).double().train()


def make_batch(layout: str) -> dict[str, torch.Tensor]:
    """The batch of ``layout``: ``ROWS x TOKENS`` ids in ``[3, VOCAB)``, ~30% of the labels -100; "padded" right-pads
    the last row by ``PADDING`` tokens (pad id 0, mask 0, labels -100)."""
    generator = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(3, VOCAB, (ROWS, TOKENS), generator=generator)
    labels = input_ids.clone()
    labels[torch.rand(ROWS, TOKENS, generator=generator) < 0.3] = -100
    batch = {"input_ids": input_ids, "labels": labels}
    if layout == "padded":
        mask = torch.ones(ROWS, TOKENS, dtype=torch.long)
        mask[-1, TOKENS - PADDING :] = 0
        input_ids[-1, TOKENS - PADDING :] = 0
        labels[-1, TOKENS - PADDING :] = -100
        batch["attention_mask"] = mask
    return batch


def training_step(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    """The loss of one forward of ``model`` on ``batch`` and every parameter's gradient after its backward."""
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    grads = {name: None if p.grad is None else p.grad.detach() for name, p in model.named_parameters()}
    return loss.detach(), grads


def relative_difference(reference: torch.Tensor, patched: torch.Tensor) -> float:
    """Max ``|patched - reference|`` over max ``|reference|``, on the finite elements; inf where finiteness differs."""
    finite = torch.isfinite(reference)
    if not torch.equal(finite, torch.isfinite(patched)):
        return math.inf
    if not finite.any():
        return 0.0
    difference = (patched - reference)[finite].abs().max().item()
    return difference / max(_TINY, reference[finite].abs().max().item())


def compare(reference: tuple[torch.Tensor, dict[str, Any]], patched: tuple[torch.Tensor, dict[str, Any]]) -> dict:
    """The status of a patched step against the unpatched one (EXACT or WRONG) and the differences."""
    (loss, grads), (patched_loss, patched_grads) = reference, patched
    loss_rel = relative_difference(loss, patched_loss)
    worst, grad_rel, missing = "", 0.0, []
    for name, grad in grads.items():
        other = patched_grads.get(name)
        if (grad is None) != (other is None):
            missing.append(f"{name} ({'patched' if other is None else 'unpatched'} has none)")
        elif grad is not None and (difference := relative_difference(grad, other)) > grad_rel:
            worst, grad_rel = name, difference
    exact = not missing and loss_rel <= LOSS_TOLERANCE and grad_rel <= GRAD_TOLERANCE
    message = f"loss rel {loss_rel:.1e}, worst grad rel {grad_rel:.1e}" + (f" ({worst})" if worst else "")
    if missing:
        message = f"gradient on one side only: {', '.join(missing[:3])}; {message}"
    return {
        "status": "EXACT" if exact else "WRONG",
        "message": message,
        "loss_rel": loss_rel,
        "grad_rel": grad_rel,
        "worst_param": worst,
    }


def is_refusal(error: BaseException) -> bool:
    """Whether ``error`` is hf_memo refusing the model (a ``ValueError`` whose message starts with "hf_memo")."""
    return isinstance(error, ValueError) and str(error).startswith("hf_memo")


def memo_config(mode: str) -> hf_memo.MemoConfig:
    """The settings of the sweep in recompute mode ``mode`` (small chunks, so that every chunked path runs)."""
    offload = {"offload_fraction": 0.5} if mode == "memo" else {}
    return hf_memo.MemoConfig(recompute=mode, mlp_chunks=3, lm_head_chunks=2, min_chunk_tokens=1, **offload)


def error_text(error: BaseException) -> str:
    """``Type: message`` of an exception, its first line."""
    text = f"{type(error).__name__}: {error}"
    return text.splitlines()[0] if text.strip() else type(error).__name__


def emit(kind: str, record: dict) -> None:
    """One line of the child's report to the sweep: ``KIND {json}``."""
    print(kind, json.dumps(record), flush=True)


def run_one(name: str, modes: list[str], layouts: list[str]) -> None:
    """Child process: build ``name``, emit its build record, then one record per (mode, layout) as it finishes."""
    try:
        model = build_model(name)
    except Exception as error:
        emit("BUILD", {"ok": False, "message": error_text(error), "traceback": traceback.format_exc()})
        return
    config = model.config.get_text_config()
    emit(
        "BUILD",
        {
            "ok": True,
            "class": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "attn_implementation": config._attn_implementation,
        },
    )
    references: dict[str, Any] = {}
    for layout in layouts:
        batch = make_batch(layout)
        try:
            references[layout] = training_step(copy.deepcopy(model), batch)
        except Exception as error:
            references[layout] = error
    for mode in modes:
        for layout in layouts:
            reference, started = references[layout], time.perf_counter()
            record: dict[str, Any] = {"mode": mode, "layout": layout}
            if isinstance(reference, Exception):
                emit("RESULT", {**record, "status": "REF-FAIL", "message": error_text(reference), "seconds": 0.0})
                continue
            patched = copy.deepcopy(model)
            try:
                hf_memo.apply(patched, memo_config(mode))
                record.update(compare(reference, training_step(patched, make_batch(layout))))
            except Exception as error:
                if is_refusal(error):
                    record.update(status="REFUSED", message=str(error))
                else:
                    record.update(status="CRASH", message=error_text(error), traceback=traceback.format_exc())
            loss, grads = reference
            record["reference_finite"] = bool(torch.isfinite(loss)) and all(
                g is None or bool(torch.isfinite(g).all()) for g in grads.values()
            )
            emit("RESULT", {**record, "seconds": round(time.perf_counter() - started, 2)})


def sweep_one(name: str, modes: list[str], layouts: list[str], timeout: float, threads: int) -> dict:
    """Run ``name`` in a child process (``--one``); its build record and results, hung or crashed runs as CRASH."""
    started = time.perf_counter()
    command = [sys.executable, __file__, "--one", name, "--modes", ",".join(modes), "--layouts", ",".join(layouts)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
        stdout, last_error = done.stdout, (done.stderr.strip().splitlines() or [""])[-1]
        ending = f"the process exited with code {done.returncode}" + (f": {last_error}" if last_error else "")
    except subprocess.TimeoutExpired as expired:  # on POSIX its output is the bytes read before the kill
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
        ending = f"timed out after {timeout:.0f} s (the process was killed)"
    records = [line.split(" ", 1) for line in stdout.splitlines() if line.startswith(("BUILD ", "RESULT "))]
    build = next((json.loads(text) for kind, text in records if kind == "BUILD"), {"ok": False, "message": ending})
    results = [json.loads(text) for kind, text in records if kind == "RESULT"]
    if build["ok"]:
        done_runs = {(r["mode"], r["layout"]) for r in results}
        results += [
            {"mode": mode, "layout": layout, "status": "CRASH", "message": ending}
            for mode in modes
            for layout in layouts
            if (mode, layout) not in done_runs
        ]
    entry = {"name": name, "model_type": model_type_of(name), "overrides": OVERRIDES.get(name, {})}
    return {**entry, "build": build, "results": results, "seconds": round(time.perf_counter() - started, 1)}


def cell(result: dict) -> str:
    """A result's status as a table cell (``!`` where the unpatched model is not finite)."""
    return result["status"] + ("" if result.get("reference_finite", True) else "!")


def summarize(entries: list[dict]) -> dict[str, Any]:
    """Counts of the sweep: types built, types exact everywhere, types with any WRONG / CRASH / REFUSED, cells."""
    built = [e for e in entries if e["build"]["ok"]]
    summary: dict[str, Any] = {
        "types": len(entries),
        "built": len(built),
        "build_fail": sorted(e["name"] for e in entries if not e["build"]["ok"]),
        "exact_everywhere": sorted(
            e["name"] for e in built if all(r["status"] == "EXACT" for r in e["results"]) and e["results"]
        ),
        "cells": dict(Counter(r["status"] for e in built for r in e["results"])),
    }
    for status in ("WRONG", "CRASH", "REFUSED", "REF-FAIL"):
        summary[status.lower().replace("-", "_")] = sorted(
            e["name"] for e in built if any(r["status"] == status for r in e["results"])
        )
    return summary


def print_report(entries: list[dict], modes: list[str], layouts: list[str], summary: dict[str, Any]) -> None:
    """The table (a row per type, a column per mode and layout), the messages of the cells not EXACT, the counts."""
    columns = [f"{mode}/{layout}" for mode in modes for layout in layouts]
    width, column = max(len(e["name"]) for e in entries), max(len(c) for c in columns)
    print((f"\n{'type':<{width}}  " + "  ".join(f"{c:<{column}}" for c in columns)).rstrip())
    for entry in entries:
        if not entry["build"]["ok"]:
            print(f"{entry['name']:<{width}}  BUILD-FAIL: {entry['build']['message'][:100]}")
            continue
        by_column = {f"{r['mode']}/{r['layout']}": r for r in entry["results"]}
        print((f"{entry['name']:<{width}}  " + "  ".join(f"{cell(by_column[c]):<{column}}" for c in columns)).rstrip())
    print("\nNot EXACT (cells with the same status and message grouped):")
    for entry in entries:
        groups: dict[tuple[str, str], list[str]] = {}
        for result in entry["results"]:
            if result["status"] != "EXACT":
                key = (cell(result), result["message"].splitlines()[0])
                groups.setdefault(key, []).append(f"{result['mode']}/{result['layout']}")
        for (status, message), where in groups.items():
            print(f"  {entry['name']} [{', '.join(where)}] {status}: {message[:160]}")
    print(
        f"\n{summary['types']} types, {summary['built']} built; exact in every mode and layout: "
        f"{len(summary['exact_everywhere'])}; with WRONG: {len(summary['wrong'])}; with CRASH: "
        f"{len(summary['crash'])}; with REFUSED: {len(summary['refused'])}; BUILD-FAIL: {len(summary['build_fail'])}; "
        f"cells: {summary['cells']}"
    )


def names_to_run(args: argparse.Namespace) -> list[str]:
    """The sweep entries: ``--types``, else the default set (with ``--all``, every causal-LM model type besides)."""
    if args.types:
        return args.types.split(",")
    names = list(DEFAULT_TYPES)
    if args.all:
        names += sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(names))
    return names


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types or variants (default: the default set)")
    parser.add_argument("--all", action="store_true", help="also every model type of MODEL_FOR_CAUSAL_LM_MAPPING")
    parser.add_argument("--modes", default=",".join(RECOMPUTE_MODES), help="comma-separated recompute modes")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated batch layouts: plain, padded")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds one type may take (default 240)")
    parser.add_argument("--jobs", type=int, default=2, help="types run at once (default 2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results (default {DEFAULT_OUT})")
    parser.add_argument("--one", metavar="TYPE", help=argparse.SUPPRESS)  # child process: run one type, print JSON
    args = parser.parse_args()
    for option, allowed in (("modes", RECOMPUTE_MODES), ("layouts", LAYOUTS)):
        unknown = set(getattr(args, option).split(",")) - set(allowed)
        if unknown:
            parser.error(f"--{option}: unknown {', '.join(sorted(unknown))} (accepted: {', '.join(allowed)})")
    return args


def main() -> None:
    args = parse_args()
    # min_chunk_tokens=1 is inert beside fixed chunk counts; it is set as the sweep's brief asks, without the warning
    warnings.filterwarnings("ignore", category=MemoConfigWarning)
    modes, layouts = args.modes.split(","), args.layouts.split(",")
    if args.one:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        run_one(args.one, modes, layouts)
        return
    names = names_to_run(args)
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    started, entries = time.perf_counter(), []
    print(f"{len(names)} types, modes {modes}, layouts {layouts}, {args.jobs} at a time", flush=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(sweep_one, name, modes, layouts, args.timeout, threads) for name in names]
        for done, future in enumerate(as_completed(futures), 1):
            entry = future.result()
            entries.append(entry)
            counts = Counter(r["status"] for r in entry["results"]) if entry["build"]["ok"] else {"BUILD-FAIL": 1}
            status = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
            print(f"[{done}/{len(names)}] {entry['name']}: {status} ({entry['seconds']:.0f} s)", flush=True)
    entries.sort(key=lambda e: names.index(e["name"]))
    summary = summarize(entries)
    print_report(entries, modes, layouts, summary)
    total = time.perf_counter() - started
    print(f"total {total:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "what": "hf_memo against the unpatched model, per model type, recompute mode and batch layout",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_memo": hf_memo.__version__,
        "python": platform.python_version(),
        "settings": {
            "modes": modes,
            "layouts": layouts,
            "memo_config": {mode: memo_config(mode).to_dict() for mode in modes},
            "sizes": SIZES,
            "window": WINDOW,
            "batch": {"rows": ROWS, "tokens": TOKENS, "padding": PADDING},
            "loss_tolerance": LOSS_TOLERANCE,
            "grad_tolerance": GRAD_TOLERANCE,
            "timeout_s": args.timeout,
            "jobs": args.jobs,
        },
        "summary": summary,
        "total_seconds": round(total, 1),
        "types": entries,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
