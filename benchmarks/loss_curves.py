"""Training curves: the LongAlpaca recipe with plain Hugging Face beside hf_memo's memo executor at offload
fractions 0, 0.5 and 1. The curves must coincide.

Every configuration runs ``examples/longalpaca/train.py``'s own set-up (``--use_hf_memo False`` for plain HF) in a
process of its own: the sample's packed rows, a Llama built from a config with random weights, the Trainer with seed
0, full fine-tuning, one row a step, a loss logged every step. Each run's losses are compared step by step with
plain HF's and drawn in one plot.

    python benchmarks/loss_curves.py --out DIR            # on a CUDA GPU, 50 steps (default DIR: results/<date>-cuda)
    python benchmarks/loss_curves.py --tiny --out /tmp/x  # seconds-long run on CPU (fp32, 4 steps)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hf_memo.data import LONGALPACA_TOKENIZER

from common import add_out_option, results_folder

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "examples" / "longalpaca"
RUNS = {"hf": None, "memo, offload 0": 0.0, "memo, offload 0.5": 0.5, "memo, offload 1": 1.0}


@dataclass(frozen=True)
class Size:
    """The model and run of one size of the benchmark."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    seq_len: int  # tokens per packed row (one row a step)
    steps: int
    learning_rate: float
    flags: tuple[str, ...]  # the recipe's flags for the device and the memory planner


SIZES = {
    "gpu": Size(2048, 5632, 16, 16, 4, 8192, 50, 3e-4, ("--bf16", "--planner", "cpsat")),
    "tiny": Size(64, 256, 4, 4, 2, 1024, 4, 1e-2, ("--use_cpu", "--planner", "greedy")),
}


def model_config(size: str, folder: Path) -> Path:
    """A Llama ``config.json`` of ``size`` with the sample tokenizer's 4,096 tokens, written under ``folder``."""
    from transformers import LlamaConfig

    shape = SIZES[size]
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.seq_len,
    )
    path = folder / f"llama_{size}.json"
    config.to_json_file(str(path))
    return path


def recipe_flags(size: str, config: Path, fraction: float | None, output_dir: Path) -> list[str]:
    """The recipe's command-line flags for one run (``fraction`` ``None``: plain HF)."""
    shape = SIZES[size]
    flags = [
        "--model_config", str(config), "--tokenizer", str(LONGALPACA_TOKENIZER),
        "--max_seq_len", str(shape.seq_len), "--rope_type", "none", "--lora", "False", "--dtype", "float32",
        "--max_steps", str(shape.steps), "--per_device_train_batch_size", "1",
        "--learning_rate", str(shape.learning_rate),
        "--warmup_steps", "0", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
        "--seed", "0", "--data_seed", "0", "--output_dir", str(output_dir), "--disable_tqdm", "True",
    ]  # fmt: skip
    if fraction is None:
        return [*flags, *shape.flags, "--use_hf_memo", "False"]
    return [*flags, *shape.flags, "--recompute", "memo", "--offload_fraction", str(fraction)]


def train(flags: list[str]) -> dict[str, list[float]]:
    """Runs the recipe's set-up and training in this process: each step's loss as computed (the Trainer logs it
    rounded to four digits) and its gradient norm before clipping."""
    import importlib.util

    from transformers import HfArgumentParser, set_seed

    spec = importlib.util.spec_from_file_location("longalpaca_train", RECIPE / "train.py")
    recipe_module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe_module  # dataclasses look their module up
    spec.loader.exec_module(recipe_module)
    parser = HfArgumentParser((recipe_module.RecipeArguments, recipe_module.TrainingArguments))
    recipe, training = parser.parse_args_into_dataclasses(args=flags)
    set_seed(training.seed)  # the random weights are drawn before the Trainer seeds
    trainer = recipe_module.setup(recipe, training)
    losses, compute_loss = [], trainer.compute_loss

    def recording_loss(*args, **kwargs):
        result = compute_loss(*args, **kwargs)
        losses.append((result[0] if isinstance(result, tuple) else result).detach().double().item())
        return result

    trainer.compute_loss = recording_loss
    trainer.train()
    grad_norms = [float(entry["grad_norm"]) for entry in trainer.state.log_history if "grad_norm" in entry]
    return {"losses": losses, "grad_norms": grad_norms}


def run(size: str, name: str, config: Path, folder: Path) -> dict:
    """One configuration in a fresh process: its losses per step and wall time."""
    flags = recipe_flags(size, config, RUNS[name], folder / "out")
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, __file__, "--train", json.dumps(flags)], capture_output=True, text=True, cwd=ROOT
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-4000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "seconds": time.perf_counter() - start}


def largest_difference(values: list[float], reference: list[float]) -> dict[str, float]:
    """The largest absolute and relative difference of ``values`` from ``reference``, step by step."""
    pairs = list(zip(values, reference, strict=True))
    return {"max_abs": max(abs(a - b) for a, b in pairs), "max_rel": max(abs(a - b) / abs(b) for a, b in pairs)}


def compare(runs: dict[str, dict]) -> dict[str, dict]:
    """Per run: how far its losses and gradient norms are from plain HF's."""
    return {
        name: {key: largest_difference(result[key], runs["hf"][key]) for key in ("losses", "grad_norms")}
        for name, result in runs.items()
    }


def markdown(results: dict) -> str:
    lines = [
        f"Loss per step, LongAlpaca sample, {results['model']}, {results['steps']} steps of one "
        f"{results['seq_len']:,}-token packed row ({results['device']}). Each run's largest difference from plain "
        "Hugging Face:",
        "",
        "| run | final loss | loss: max abs / max relative difference | gradient norm: max relative difference "
        "| wall time |",
        "|---|---|---|---|---|",
    ]
    for name, result in results["runs"].items():
        loss, norm = results["differences"][name]["losses"], results["differences"][name]["grad_norms"]
        lines.append(
            f"| {name} | {result['losses'][-1]:.6f} | {loss['max_abs']:.2e} / {loss['max_rel']:.2e} | "
            f"{norm['max_rel']:.2e} | {result['seconds']:.0f} s |"
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for (name, result), style in zip(results["runs"].items(), ("-", "--", ":", "-.")):
        axis.plot(range(1, len(result["losses"]) + 1), result["losses"], style, label=name)
    axis.set_xlabel("step")
    axis.set_ylabel("training loss")
    axis.set_title(f"{results['model']}, {results['seq_len']:,} tokens a step ({results['device']})")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny Llama on CPU, for a smoke run")
    parser.add_argument("--train", help=argparse.SUPPRESS)  # internal: one run's recipe flags, as JSON
    add_out_option(parser)
    args = parser.parse_args()
    if args.train is not None:
        print(json.dumps(train(json.loads(args.train))))
        return

    import torch

    size = "tiny" if args.tiny else "gpu"
    if size == "gpu" and not torch.cuda.is_available():
        parser.error("the full run needs a CUDA GPU; --tiny runs on CPU")
    device = torch.cuda.get_device_name() if size == "gpu" else "CPU"
    date, out = results_folder(args.out, device="cpu" if size == "tiny" else "cuda")
    shape = SIZES[size]
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        config = model_config(size, Path(scratch))
        for name in RUNS:
            runs[name] = run(size, name, config, Path(scratch))
            print(f"{name}: final loss {runs[name]['losses'][-1]:.4f} ({runs[name]['seconds']:.0f} s)", flush=True)
    results = {
        "date": date,
        "device": device,
        "torch": torch.__version__,
        "model": f"Llama {shape.layers} x {shape.hidden}, random weights",
        "seq_len": shape.seq_len,
        "steps": shape.steps,
        "runs": runs,
        "differences": compare(runs),
    }
    (out / "loss_curves.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (out / "loss_curves.md").write_text(table + "\n")
    plot(results, out / "loss_curves.png")
    print(table)


if __name__ == "__main__":
    main()
