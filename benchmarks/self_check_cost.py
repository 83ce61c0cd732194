"""What hf_memo's self-check costs at the first training step of a Llama-3-8B-shaped model.

Two measurements, side by side with the step they precede:

- ``fake`` (no memory, any machine): the whole model (``--layers 32``, bf16) with fake tensors, patched with
  ``--recompute``. The check's two probe passes (unpatched, then patched: forward and one vector-Jacobian product of
  ``PROBE_ROWS`` x ``PROBE_TOKENS`` tokens) and one training step of ``--tokens`` tokens are each counted with
  PyTorch's floating-point operation formulas and recorded by hf_memo's allocation recorder: their operations and
  the peak bytes of what each allocates (beyond the parameters) are reported, with the check's share of the first step's
  operations, which is its share of the step's time on a GPU where both are compute bound (the probe's few tokens
  are not: see the CPU timing).
- ``cpu`` (real tensors): ``--cpu-layers`` decoder layers of the same shapes in fp32 on the CPU, one training step of
  ``--cpu-tokens`` tokens with the check (the first step) and one without (``self_check=False``), in one run, and the
  check's own seconds (its report). The check's values cannot exist under fake tensors (it compares numbers), so this
  is the measured time.

    python benchmarks/self_check_cost.py --out benchmarks/results/2026-11-28-cpu/self_check_cost.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

import hf_memo
from hf_memo.patches import self_check
from hf_memo.patches.patching import patch_state
from hf_memo.profiler.allocations import AllocationRecorder
from hf_memo.profiler.analysis import peak
from hf_memo.profiler.fake_model import fake_causal_lm


def llama3_8b_config(layers: int) -> transformers.LlamaConfig:
    """Llama-3-8B's shapes with ``layers`` decoder layers."""
    return transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    )


class _Flops(TorchDispatchMode):
    """Counts floating-point operations with PyTorch's formulas (``FlopCounterMode``'s, whose module tracking
    refuses ``torch.autograd.grad`` on leaves, which the check takes)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def _counted(fn: Any, model: torch.nn.Module) -> tuple[int, int]:
    """``fn()``'s floating-point operations and the peak bytes of what it allocates beyond ``model``'s parameters and
    buffers (tracked first, so that touching them is no allocation)."""
    counter = _Flops()
    recorder = AllocationRecorder(lambda: "step", lambda: "step")
    with recorder, counter:
        recorder.track(list(model.parameters()), "parameter")
        recorder.track(list(model.buffers()), "buffer")
        fn()
    top = peak(recorder.trace())
    return counter.total, top.total - top.by_category["parameter"] - top.by_category["buffer"]


def fake_cost(layers: int, tokens: int, recompute: str) -> dict[str, Any]:
    """The check's probe passes against one training step of ``tokens`` tokens, with fake tensors."""
    model, session = fake_causal_lm(llama3_8b_config(layers), torch.bfloat16)
    with session:
        hf_memo.apply(model, recompute=recompute, self_check=False)  # the probe is driven by hand below
        state = patch_state(model)
        ids = torch.randint(3, model.config.vocab_size, (1, tokens))
        inputs = self_check.probe_inputs({"input_ids": ids}, {}, None)
        layer_list = state.structure.layers
        probed = self_check.first_of_each_kind(model, layer_list)
        targets = self_check._targets(model, state.structure, probed)
        cotangents: dict[int, torch.Tensor] = {}
        generator = torch.Generator().manual_seed(0)

        def probe() -> None:
            with state.record.suspended():
                self_check._run(model, inputs, layer_list, probed, targets, cotangents, generator)
            self_check._run(model, inputs, layer_list, probed, targets, cotangents, None)

        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        check_flops, check_peak = _counted(probe, model)
        step_flops, step_peak = _counted(step, model)
    return {
        "layers": layers,
        "tokens": tokens,
        "probe_tokens": self_check.PROBE_ROWS * self_check.PROBE_TOKENS,
        "check_flops": check_flops,
        "step_flops": step_flops,
        "check_share_of_first_step_flops": check_flops / (check_flops + step_flops),
        "check_peak_bytes": check_peak,
        "step_peak_bytes": step_peak,
    }


def _step(model: torch.nn.Module, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def cpu_cost(layers: int, tokens: int, recompute: str) -> dict[str, Any]:
    """The first step with the check against a step without it, real fp32 tensors on the CPU."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama3_8b_config(layers)).train()
    ids = torch.randint(3, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    hf_memo.apply(model, recompute=recompute)
    checked = _step(model, ids)
    report = dict(patch_state(model).self_check.report)
    hf_memo.revert(model)
    hf_memo.apply(model, recompute=recompute, self_check=False)
    plain = _step(model, ids)
    return {
        "layers": layers,
        "tokens": tokens,
        "first_step_with_check_s": checked,
        "step_without_check_s": plain,
        "check_s": report["seconds"],
        "check_share_of_first_step": report["seconds"] / checked,
        "worst_relative_difference": report["worst"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--cpu-layers", type=int, default=1)
    parser.add_argument("--cpu-tokens", type=int, default=512)
    parser.add_argument("--recompute", default="selective")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = {
        "model": "Llama-3-8B-shaped (hidden 4096, MLP 14336, 32/8 heads, 128256 vocabulary)",
        "recompute": args.recompute,
        "fake": fake_cost(args.layers, args.tokens, args.recompute),
        "cpu": cpu_cost(args.cpu_layers, args.cpu_tokens, args.recompute),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
