"""Memory-planner benchmark: CP-SAT vs greedy vs MEMO's big-M MIP on decoder-layer traces, and whole-step plans.

For every step trace (synthetic, or profiler trace files given with ``--trace``) it reports:

* **layer traces** — the device tensors allocated and freed inside one decoder layer's forward and
  backward (MEMO's level-1 problem for a layer, saved activations included), one per distinct
  layer (identical layers have equal fingerprints): tensors, lower bound (most bytes live), and
  peak / lower bound, proven optimality and seconds of: the planner (``solve_dsa`` with CP-SAT:
  reductions, greedy first, CP-SAT only when the greedy misses the bound), the greedy alone, and
  the two exact models *alone* (no reductions, no greedy bound: CP-SAT, and MEMO's big-M MIP in
  HiGHS as the paper ran it with Gurobi);
* **whole step** — the bi-level plan (:func:`hf_memo.planner.bilevel.plan_memory`): seconds, peak
  against the step's lower bound, its level-1 and level-2 problems;
* **caching allocator** — the same step replayed through the simulated PyTorch CUDA caching
  allocator: peak reserved against peak requested without a plan, with hf_memo's own buffers served
  from the plan's arena (what the runtime does), and the plan's peak (every tensor at its offset).

Synthetic traces are written by a small autograd simulator from the operator sequence of a
Hugging Face decoder layer in bf16, batch 1 (see ``llama_layer`` / ``gpt_layer``): every op
allocates its output, keeps what autograd saves, and frees a tensor when its last forward use
and its last saving op's backward are done; backward allocates input gradients (a new tensor
when two gradients are summed), weight gradients (alive until the optimizer) and workspaces.
They follow PyTorch's rules, not a measurement: profiler traces replace them with ``--profile``
(whole steps profiled on fake tensors, every layer, as ``hf-memo plan`` does) or ``--trace``.

    python benchmarks/planner_dsa.py                        # Llama-3-8B and GPT-7B, S = 32K and 128K, MIP 60 s
    python benchmarks/planner_dsa.py --quick                # MIP limited to 5 s
    python benchmarks/planner_dsa.py --profile llama-3-8b gpt-7b --seq-lens 32k 128k \
        --modes hf-checkpointing memo --save-traces /tmp/traces   # profiler traces, also written as JSON lines
    python benchmarks/planner_dsa.py --trace a.jsonl b.jsonl  # profiler trace files of whole steps
    python benchmarks/planner_dsa.py --tiny --out /tmp/x    # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hf_memo.integrations.plan import profile_step
from hf_memo.planner.bilevel import LAYER_PHASE, plan_memory
from hf_memo.planner.caching_allocator import replay, replay_with_arena
from hf_memo.planner.cpsat import cpsat_offsets
from hf_memo.planner.dsa import PlannerWarning, max_live, solve_dsa
from hf_memo.planner.lifetimes import Trace
from hf_memo.planner.mip import milp_offsets
from hf_memo.planner.solution import find_conflict
from hf_memo.profiler.trace import AllocationEvent, AllocationTrace
from hf_memo.units import format_bytes, format_tokens, parse_bytes, parse_tokens

from common import add_out_option, results_folder

BF16, FP32 = 2, 4
# Greedy places this in 6 units, the optimum is 5: solved once before timing anything.
GREEDY_MISSES_THE_OPTIMUM = [("malloc", 0, 1), ("malloc", 1, 3), ("free", 1, 3), ("malloc", 2, 2), ("free", 0, 1)]
GREEDY_MISSES_THE_OPTIMUM += [("malloc", 3, 3), ("free", 3, 3), ("free", 2, 2)]
MODELS = {
    # name: (family, hidden, intermediate, heads, kv heads, vocab, layers)
    "llama-3-8b": ("llama", 4096, 14336, 32, 8, 128256, 32),
    "gpt-7b": ("gpt", 4096, 16384, 32, 32, 50257, 32),
    "tiny-llama": ("llama", 64, 224, 4, 2, 1000, 4),
}


@dataclass(frozen=True)
class Op:
    """One forward op of the simulated autograd graph.

    ``out`` (``nbytes``) is computed from ``inputs``; ``saves`` are kept for backward (inputs or
    ``out``), plus ``aux`` bytes of extra outputs only backward reads (softmax statistics, norm
    statistics). Backward allocates a gradient for each input (``alias``: the output's gradient is
    passed on unchanged, as for additions and views), ``param_grads`` and, for the time of the op,
    ``workspace`` bytes; forward uses ``scratch`` bytes for the time of the op.
    """

    out: str
    nbytes: int
    inputs: tuple[str, ...] = ()
    saves: tuple[str, ...] = ()
    alias: bool = False
    aux: int = 0
    param_grads: tuple[int, ...] = ()
    workspace: tuple[int, ...] = ()
    scratch: tuple[int, ...] = ()


def rms_norm(p: str, x: str, s: int, h: int) -> list[Op]:
    """``LlamaRMSNorm``: upcast to fp32, mean of squares, rsqrt, scale, downcast, times weight."""
    return [
        Op(f"{p}.f32", s * h * FP32, (x,)),
        Op(f"{p}.pow", s * h * FP32, (f"{p}.f32",), saves=(f"{p}.f32",)),
        Op(f"{p}.var", s * FP32, (f"{p}.pow",)),
        Op(f"{p}.eps", s * FP32, (f"{p}.var",), alias=True),
        Op(f"{p}.rs", s * FP32, (f"{p}.eps",), saves=(f"{p}.rs",)),
        Op(
            f"{p}.norm", s * h * FP32, (f"{p}.f32", f"{p}.rs"), saves=(f"{p}.f32", f"{p}.rs"), workspace=(s * h * FP32,)
        ),
        Op(f"{p}.bf", s * h * BF16, (f"{p}.norm",)),
        Op(
            f"{p}.out",
            s * h * BF16,
            (f"{p}.bf",),
            saves=(f"{p}.bf",),
            param_grads=(h * BF16,),
            workspace=(s * h * BF16,),
        ),
    ]


def layer_norm(p: str, x: str, s: int, h: int) -> list[Op]:
    """``nn.LayerNorm`` (one fused kernel): saves its input and per-row mean and rstd."""
    return [Op(f"{p}.out", s * h * BF16, (x,), saves=(x,), aux=2 * s * FP32, param_grads=(h * BF16, h * BF16))]


def linear(p: str, x: str, s: int, n_in: int, n_out: int, bias: bool = False) -> Op:
    weights = (n_in * n_out * BF16,) + ((n_out * BF16,) if bias else ())
    return Op(p, s * n_out * BF16, (x,), saves=(x,), param_grads=weights)


def rope(p: str, x: str, s: int, width: int) -> list[Op]:
    """``x * cos + rotate_half(x) * sin``; ``rotate_half`` negates one half and concatenates."""
    return [
        Op(f"{p}.cos", s * width * BF16, (x,)),
        Op(f"{p}.rot", s * width * BF16, (x,), scratch=(s * width * BF16 // 2,), workspace=(s * width * BF16 // 2,)),
        Op(f"{p}.sin", s * width * BF16, (f"{p}.rot",)),
        Op(f"{p}.emb", s * width * BF16, (f"{p}.cos", f"{p}.sin"), alias=True),
    ]


def attention(p: str, q: str, k: str, v: str, s: int, heads: int, head_dim: int) -> Op:
    """Flash SDPA: saves q, k, v, its output and the log-sum-exp; backward needs a contiguous
    output gradient, an fp32 dq accumulator and the softmax row sums."""
    out = s * heads * head_dim * BF16
    workspace = (out, s * heads * head_dim * FP32, heads * s * FP32)
    inputs = tuple(dict.fromkeys((q, k, v)))
    return Op(p, out, inputs, saves=(*inputs, p), aux=heads * s * FP32, workspace=workspace)


def llama_layer(p: str, x: str, s: int, h: int, i: int, heads: int, kv_heads: int) -> list[Op]:
    """A Hugging Face Llama decoder layer with SDPA (GQA inside SDPA, no K/V repeat)."""
    d = h // heads
    ops = rms_norm(f"{p}.ln1", x, s, h)
    ops += [
        linear(f"{p}.{n}", f"{p}.ln1.out", s, h, w * d) for n, w in (("q", heads), ("k", kv_heads), ("v", kv_heads))
    ]
    ops += rope(f"{p}.q", f"{p}.q", s, heads * d) + rope(f"{p}.k", f"{p}.k", s, kv_heads * d)
    ops.append(attention(f"{p}.attn", f"{p}.q.emb", f"{p}.k.emb", f"{p}.v", s, heads, d))
    ops.append(Op(f"{p}.attn.t", s * h * BF16, (f"{p}.attn",), alias=True))  # transpose(1, 2).contiguous()
    ops.append(linear(f"{p}.o", f"{p}.attn.t", s, h, h))
    ops.append(Op(f"{p}.h1", s * h * BF16, (x, f"{p}.o"), alias=True))
    ops += rms_norm(f"{p}.ln2", f"{p}.h1", s, h)
    ops += [linear(f"{p}.gate", f"{p}.ln2.out", s, h, i), linear(f"{p}.up", f"{p}.ln2.out", s, h, i)]
    ops.append(Op(f"{p}.act", s * i * BF16, (f"{p}.gate",), saves=(f"{p}.gate",)))
    ops.append(Op(f"{p}.prod", s * i * BF16, (f"{p}.act", f"{p}.up"), saves=(f"{p}.act", f"{p}.up")))
    ops.append(linear(f"{p}.down", f"{p}.prod", s, i, h))
    ops.append(Op(f"{p}.out", s * h * BF16, (f"{p}.h1", f"{p}.down"), alias=True))
    return ops


def gpt_layer(p: str, x: str, s: int, h: int, i: int, heads: int, kv_heads: int) -> list[Op]:
    """A GPT decoder layer (MEMO's GPT-7B): LayerNorm, fused QKV with bias, SDPA, fused tanh-GELU MLP."""
    ops = layer_norm(f"{p}.ln1", x, s, h)
    ops.append(linear(f"{p}.qkv", f"{p}.ln1.out", s, h, 3 * h, bias=True))
    attn = attention(f"{p}.attn", f"{p}.qkv", f"{p}.qkv", f"{p}.qkv", s, heads, h // heads)
    split_grads = (3 * s * h * BF16,)  # dq, dk, dv before they are concatenated into the QKV gradient
    ops.append(Op(attn.out, attn.nbytes, attn.inputs, attn.saves, aux=attn.aux, workspace=attn.workspace + split_grads))
    ops.append(Op(f"{p}.attn.t", s * h * BF16, (f"{p}.attn",), alias=True))
    ops.append(linear(f"{p}.proj", f"{p}.attn.t", s, h, h, bias=True))
    ops.append(Op(f"{p}.h1", s * h * BF16, (x, f"{p}.proj"), alias=True))
    ops += layer_norm(f"{p}.ln2", f"{p}.h1", s, h)
    ops.append(linear(f"{p}.fc", f"{p}.ln2.out", s, h, i, bias=True))
    ops.append(Op(f"{p}.gelu", s * i * BF16, (f"{p}.fc",), saves=(f"{p}.fc",)))
    ops.append(linear(f"{p}.fc2", f"{p}.gelu", s, i, h, bias=True))
    ops.append(Op(f"{p}.out", s * h * BF16, (f"{p}.h1", f"{p}.fc2"), alias=True))
    return ops


class AutogradSimulator:
    """Runs forward ops, then backward in reverse, writing MEMO malloc/free events tagged with their phase.

    A *block* is a run of ops with one phase. Blocks in ``checkpointed`` keep nothing for backward but
    their input (as ``torch.utils.checkpoint`` does); their backward starts by recomputing them.
    """

    def __init__(self) -> None:
        self.events: list[AllocationEvent] = []
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.phase = "other"

    def malloc(self, nbytes: int, category: str = "activation") -> int:
        tensor_id = len(self.sizes)
        self.sizes[tensor_id], self.refs[tensor_id] = nbytes, 1
        self.events.append(AllocationEvent("malloc", tensor_id, nbytes, self.phase, category))
        return tensor_id

    def ref(self, tensor_id: int) -> None:
        self.refs[tensor_id] += 1

    def unref(self, tensor_id: int) -> None:
        self.refs[tensor_id] -= 1
        assert self.refs[tensor_id] >= 0, f"tensor {tensor_id} released once too often"
        if self.refs[tensor_id] == 0:
            self.events.append(AllocationEvent("free", tensor_id, self.sizes[tensor_id], self.phase))

    def scratch(self, sizes: tuple[int, ...]) -> None:
        ids = [self.malloc(n, "temporary") for n in sizes]
        for tensor_id in ids:
            self.unref(tensor_id)

    def forward(self, ops: list[Op], env: dict[str, int], save: bool, keep: tuple[str, ...] = ()) -> list[list[int]]:
        """Run ``ops``; a tensor dies after its last use among them unless named in ``keep``.

        Returns, per op, the ids it saved for backward."""
        last_use = {name: k for k, op in enumerate(ops) for name in op.inputs}
        kept = []
        for k, op in enumerate(ops):
            env[op.out] = self.malloc(op.nbytes)
            self.scratch(op.scratch)
            saved = [env[name] for name in op.saves] if save else []
            for tensor_id in saved:
                self.ref(tensor_id)
            if save and op.aux:
                saved.append(self.malloc(op.aux))
            kept.append(saved)
            for name in dict.fromkeys(op.inputs):
                if last_use[name] == k and name not in keep:
                    self.unref(env[name])
            if op.out not in last_use and op.out not in keep:
                self.unref(env[op.out])
        return kept

    def backward(self, ops: list[Op], env: dict[str, int], kept: list[list[int]], grads: dict[str, int]) -> list[int]:
        """Backward of ``ops`` in reverse, consuming ``grads`` (name -> gradient id); returns weight gradient ids."""
        weights = []
        for k in reversed(range(len(ops))):
            op = ops[k]
            grad = grads.pop(op.out, None)
            if grad is not None:
                workspace = [self.malloc(n, "temporary") for n in op.workspace]
                for name in dict.fromkeys(op.inputs):
                    if op.alias:
                        self.ref(grad)
                        new = grad
                    else:
                        new = self.malloc(self.sizes[env[name]], "temporary")
                    if name in grads:  # two gradients meet: autograd sums them into a new tensor
                        total = self.malloc(self.sizes[env[name]], "temporary")
                        self.unref(grads[name])
                        self.unref(new)
                        new = total
                    grads[name] = new
                weights += [self.malloc(n, "gradient") for n in op.param_grads]
                for tensor_id in workspace:
                    self.unref(tensor_id)
                self.unref(grad)
            for tensor_id in kept[k]:
                self.unref(tensor_id)
        return weights

    def run(self, blocks: list[tuple[str, list[Op]]], checkpointed: set[str]) -> list[int]:
        """Forward then backward of ``blocks`` (``(phase, ops)``, the last op the loss); returns weight gradient ids."""
        env: dict[str, int] = {}
        uses = [{name for op in ops for name in op.inputs} for _, ops in blocks]
        kept, inputs = [], []
        for b, (phase, ops) in enumerate(blocks):
            self.phase = phase
            later = set().union(*uses[b + 1 :])
            outer = tuple(dict.fromkeys(n for op in ops for n in op.inputs if n in env))  # from earlier blocks
            inputs.append(outer)
            if phase in checkpointed:
                for name in outer:
                    self.ref(env[name])  # the checkpoint keeps its inputs
            keep = tuple(op.out for op in ops if op.out in later) + outer
            keep += (ops[-1].out,) if b == len(blocks) - 1 else ()
            kept.append(self.forward(ops, env, phase not in checkpointed, keep))
            for name in outer:  # inputs from earlier blocks that no later block reads die here
                if name not in later:
                    self.unref(env[name])
        loss = blocks[-1][1][-1].out
        grads = {loss: self.malloc(FP32, "temporary")}
        self.unref(env[loss])
        weights = []
        for b in reversed(range(len(blocks))):
            phase, ops = blocks[b]
            self.phase = phase.replace("forward", "backward")
            if phase in checkpointed:  # recompute the block, keeping what backward needs
                local = {name: env[name] for name in inputs[b]}
                kept[b] = self.forward(ops, local, save=True, keep=inputs[b])
                weights += self.backward(ops, {**env, **local}, kept[b], grads)
                for name in inputs[b]:
                    self.unref(env[name])
            else:
                weights += self.backward(ops, env, kept[b], grads)
        for grad in grads.values():
            self.unref(grad)
        return weights


def synthetic_step(model: str, seq_len: int, layers: int | None = None, checkpointing: bool = False) -> AllocationTrace:
    """The device trace of one training step of ``model`` (a key of ``MODELS``) at ``seq_len`` tokens.

    ``checkpointing``: Hugging Face gradient checkpointing of every decoder layer.
    """
    family, h, i, heads, kv_heads, vocab, default_layers = MODELS[model]
    layers = layers or default_layers
    s = seq_len
    make_layer = llama_layer if family == "llama" else gpt_layer
    blocks = [("embedding", [Op("emb", s * h * BF16, param_grads=(vocab * h * BF16,))])]
    x = "emb"
    for n in range(layers):
        blocks.append((f"layer {n} forward", make_layer(f"l{n}", x, s, h, i, heads, kv_heads)))
        x = f"l{n}.out"
    head = rms_norm("final", x, s, h) if family == "llama" else layer_norm("final", x, s, h)
    head += [
        linear("logits", "final.out", s, h, vocab),
        Op("logits.f32", s * vocab * FP32, ("logits",)),
        Op("logp", s * vocab * FP32, ("logits.f32",), saves=("logp",)),
        Op("loss", FP32, ("logp",)),
    ]
    blocks.append(("head", head))
    simulator = AutogradSimulator()
    checkpointed = {f"layer {n} forward" for n in range(layers)} if checkpointing else set()
    weights = simulator.run(blocks, checkpointed)
    simulator.phase = "optimizer"
    for grad in weights:  # Adam's fp32 temporaries, then zero_grad(set_to_none=True)
        simulator.scratch((2 * simulator.sizes[grad],))
        simulator.unref(grad)
    meta = {
        "model": model,
        "seq_len": seq_len,
        "layers": layers,
        "checkpointing": checkpointing,
        "source": "synthetic (benchmarks/planner_dsa.py)",
    }
    return AllocationTrace(simulator.events, meta)


def irregular_trace(seed: int, tensors: int = 150) -> Trace:
    """A stress case unlike a layer: frees in random order (not last-in first-out), sizes 0.5 KiB to 52 KiB."""
    rng = random.Random(seed)
    events, live = [], []
    for tensor_id in range(tensors):
        while live and rng.random() < 0.45:
            events.append(("free", *live.pop(rng.randrange(len(live)))))
        size = 512 * rng.choice([1, 2, 3, 5, 8, 13]) * rng.randint(1, 8)
        events.append(("malloc", tensor_id, size))
        live.append((tensor_id, size))
    events += [("free", tensor_id, size) for tensor_id, size in live]
    return Trace.from_events(events)


def layer_trace(step: AllocationTrace, layer: int) -> Trace:
    """Device tensors allocated and freed within layer ``layer``'s forward and backward, over those events."""
    phases = {f"layer {layer} forward", f"layer {layer} backward"}
    events = [e for e in step.events if e.location == "device" and e.phase in phases]
    mallocs = {e.tensor_id for e in events if e.op == "malloc"}
    frees = {e.tensor_id for e in events if e.op == "free"}
    inside = mallocs & frees
    return Trace.from_events([(e.op, e.tensor_id, e.size) for e in events if e.tensor_id in inside])


def solve(trace: Trace, solver: str, time_limit: float, workers: int, alignment: int = 512) -> dict:
    """The planner's own path (:func:`solve_dsa`: reductions, greedy first, exact solver only if needed)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlannerWarning)
        solution = solve_dsa(trace, solver, time_limit=time_limit, alignment=alignment, workers=workers)
    finest = trace.lower_bound(512)
    return {
        **solution.stats(),
        "peak_over_512_lower_bound": round(solution.peak / finest, 6) if finest else 1.0,
        "warnings": [str(w.message) for w in caught],
    }


def solve_alone(trace: Trace, solver: str, time_limit: float, workers: int, alignment: int = 512) -> dict:
    """The exact model by itself, as MEMO ran its MIP: no reductions, no greedy; its upper bound is all
    tensors stacked on each other (``M`` of the big-M model)."""
    start = np.array([life.start for life in trace.lifetimes], dtype=np.int64)
    end = np.array([life.end for life in trace.lifetimes], dtype=np.int64)
    size = np.array([-(-life.size // alignment) for life in trace.lifetimes], dtype=np.int64)
    stacked = np.concatenate(([0], np.cumsum(size)[:-1]))
    lower = max_live(start, end, size)
    began = time.perf_counter()
    if solver == "cpsat":
        result = cpsat_offsets(start, end, size, stacked, lower, time_limit, workers)
    else:
        result = milp_offsets(start, end, size, stacked, lower, time_limit)
    seconds = round(time.perf_counter() - began, 3)
    if result.offsets is None:
        return {"found": False, "seconds": seconds, "status": str(result.status)}
    conflict = find_conflict(start, end, size, result.offsets)
    if conflict is not None:  # big-M numerics: an "optimal" answer whose rounded offsets overlap
        return {
            "found": False,
            "invalid": True,
            "seconds": seconds,
            "status": f"{result.status}; tensors {conflict} overlap",
        }
    ratio = round(int((result.offsets + size).max()) / lower, 6)
    return {"found": True, "ratio": ratio, "optimal": result.proven, "seconds": seconds, "status": str(result.status)}


def compare_solvers(trace: Trace, time_limit: float, mip_limit: float, workers: int, alignment: int = 512) -> dict:
    """The planner, the greedy, and CP-SAT and the MIP alone on one trace (sizes in units of ``alignment``)."""
    row = {"tensors": len(trace), "lower_bound": trace.lower_bound(alignment)}
    row["planner"] = solve(trace, "cpsat", time_limit, workers, alignment)
    row["greedy"] = solve(trace, "greedy", time_limit, workers, alignment)
    row["cpsat_alone"] = solve_alone(trace, "cpsat", time_limit, workers, alignment)
    row["mip_alone"] = solve_alone(trace, "mip", mip_limit, workers, alignment) if mip_limit > 0 else None
    return row


def benchmark_step(
    step: AllocationTrace, mip_limit: float, time_limit: float, workers: int, alignment: int = 512
) -> dict:
    layer_ids = sorted({int(m.group(1)) for e in step.events if (m := LAYER_PHASE.match(e.phase))})
    distinct: dict[str, list[int]] = {}
    traces = {}
    for layer in layer_ids:
        trace = layer_trace(step, layer)
        traces[layer] = trace
        distinct.setdefault(trace.fingerprint(), []).append(layer)
    layers = []
    for members in distinct.values():
        row = {"layers": members, **compare_solvers(traces[members[0]], time_limit, mip_limit, workers, alignment)}
        layers.append(row)
        print(f"  layers {members[0]}..{members[-1]}: {_summary_line(row)}", flush=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlannerWarning)
        plan = plan_memory(step, time_limit=time_limit, alignment=alignment, workers=workers, progress=False)
    device = Trace.from_allocations(step)
    allocator = replay(device).summary()
    with_arena = replay_with_arena(device, plan.arena_size).summary()
    print(f"  step: {plan.summary()}".replace("\n", "\n  "), flush=True)
    return {
        "meta": step.meta,
        "events": len(device.events()),
        "layer_traces": layers,
        "plan": {
            "seconds": plan.stats["seconds"],
            "peak": plan.peak,
            "lower_bound": plan.lower_bound,
            "ratio": plan.peak / plan.lower_bound,
            "peak_over_512_lower_bound": plan.peak / device.lower_bound(512),
            "tensors": plan.stats["tensors"],
            "local_tensors": plan.stats["local_tensors"],
            "segments": plan.stats["segments"],
            "arena_size": plan.arena_size,
            "arena": plan.stats["arena"],
            "level1": plan.stats["level1"],
            "level2": plan.stats["level2"],
            "warnings": [str(w.message) for w in caught],
        },
        "caching_allocator": {
            **allocator,
            "reserved_over_plan_peak": allocator["peak_reserved"] / plan.peak,
            "plan_peak_over_requested": plan.peak / allocator["peak_requested"],
            "with_arena": with_arena,
        },
    }


def _trace_name(meta: dict, fallback: str) -> str:
    """``"llama-3-8b S=128K memo"`` for a profiled step (its meta names model, length and mode), else ``fallback``."""
    if not {"model", "seq_len", "mode"} <= set(meta):
        return fallback
    return f"{meta['model']} S={format_tokens(int(meta['seq_len']))} {meta['mode']}"


def _summary_line(row: dict) -> str:
    p, alone, mip = row["planner"], row["cpsat_alone"], row["mip_alone"]
    line = f"{row['tensors']} tensors, planner x{p['ratio']:.4f} {'optimal' if p['optimal'] else 'NOT PROVEN'} "
    line += f"in {p['seconds']:.2f} s, greedy x{row['greedy']['ratio']:.4f}, CP-SAT alone {_alone(alone)}"
    return line + (f", MIP alone {_alone(mip)}" if mip else "")


def _alone(result: dict) -> str:
    if not result["found"]:
        return f"{'an invalid answer' if result.get('invalid') else 'nothing found'} in {result['seconds']:.1f} s"
    proven = "proven" if result["optimal"] else "not proven"
    return f"x{result['ratio']:.4f} {proven} in {result['seconds']:.2f} s"


def _solver_cells(row: dict) -> str:
    p, g = row["planner"], row["greedy"]
    cells = [f"{p['ratio']:.4f}", str(p["optimal"]), f"{p['seconds']:.2f}"]
    cells += [f"{p.get('peak_over_512_lower_bound', p['ratio']):.4f}", f"{g['ratio']:.4f}", f"{g['seconds']:.3f}"]
    for alone in (row["cpsat_alone"], row["mip_alone"]):
        if alone is None:
            cells += ["-", "-", "-"]
        elif not alone["found"]:
            cells += ["invalid answer" if alone.get("invalid") else "none found", "-", f"{alone['seconds']:.1f}"]
        else:
            cells += [f"{alone['ratio']:.4f}", str(alone["optimal"]), f"{alone['seconds']:.2f}"]
    return " | ".join(cells)


SOLVER_HEADER = (
    "planner peak/LB | proven | planner s | planner peak/512-B LB | greedy peak/LB | greedy s | "
    "CP-SAT alone peak/LB | proven | "
    "CP-SAT alone s | MIP alone peak/LB | proven | MIP alone s"
)


def markdown(results: dict) -> str:
    gib = 2**30
    lines = [
        f"Source: {results['source']}. Machine: {results['machine']}, {results['cpus']} CPUs; CP-SAT with "
        f"{results['workers']} workers and {results['time_limit']} s per problem; MIP (HiGHS, big-M) "
        f"{results['mip_limit']} s. Sizes rounded up to {format_bytes(results.get('alignment', 512))}; LB = most "
        "bytes live at once (at that rounding); 512-B LB = the same with sizes rounded up to 512 B. The first CP-SAT "
        f"solve of a process loads OR-Tools ({results['ortools_first_solve_seconds']} s, not in the times below).",
        "",
        "**Layer traces**: one decoder layer's forward + backward (tensors allocated and freed inside it, "
        "saved activations included); identical layers are solved once.",
        "",
        f"| trace | layers | tensors | LB (GiB) | {SOLVER_HEADER} |",
        "|---|---|---|---|" + "---|" * 12,
    ]
    for name, run in results["runs"].items():
        for row in run["layer_traces"]:
            members = row["layers"]
            lines.append(
                f"| {name} | {members[0]}-{members[-1]} ({len(members)}) | {row['tensors']} | "
                f"{row['lower_bound'] / gib:.2f} | {_solver_cells(row)} |"
            )
    lines += [
        "",
        "**Whole step**: the bi-level plan, and the simulated PyTorch CUDA caching allocator on the same trace.",
        "",
        "| trace | tensors | plan s | plan peak (GiB) | step LB (GiB) | plan/LB | plan/512-B LB | level-1 problems | "
        "level-1 max s | level-2 tensors | level-2 peak/LB | level-2 proven | level-2 s | arena (GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in results["runs"].items():
        plan = run["plan"]
        level1_max = max((level["seconds"] for level in plan["level1"]), default=0.0)
        all_optimal = all(level["optimal"] for level in plan["level1"])
        lines.append(
            f"| {name} | {plan['tensors']} | {plan['seconds']:.2f} | {plan['peak'] / gib:.2f} | "
            f"{plan['lower_bound'] / gib:.2f} | {plan['ratio']:.4f} | "
            f"{plan.get('peak_over_512_lower_bound', plan['ratio']):.4f} | {len(plan['level1'])} "
            f"({'all proven optimal' if all_optimal else 'not all proven'}) | {level1_max:.2f} | "
            f"{plan['level2']['tensors']} | {plan['level2']['ratio']:.4f} | {plan['level2']['optimal']} | "
            f"{plan['level2']['seconds']:.2f} | {plan.get('arena_size', 0) / gib:.2f} |"
        )
    lines += [
        "",
        "**Caching allocator** (simulated replay of PyTorch's CUDA caching allocator, default settings) on the "
        "same trace: peak reserved / peak requested without a plan; with hf_memo's own buffers served from the "
        "plan's arena and every other tensor from the caching allocator (what the runtime does); and the plan's "
        "peak / peak requested if every tensor sat at its planned offset.",
        "",
        "| trace | requested (GiB) | reserved, no plan (GiB) | reserved/requested, no plan | segments, no plan | "
        "reserved, arena (GiB) | reserved/requested, arena | plan peak/requested |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, run in results["runs"].items():
        alloc = run["caching_allocator"]
        arena = alloc.get("with_arena")
        arena_cells = (
            "- | -"
            if arena is None
            else (f"{arena['peak_reserved'] / gib:.2f} | {arena['reserved_over_requested']:.4f}")
        )
        plan_over = alloc.get("plan_peak_over_requested", run["plan"]["peak"] / alloc["peak_requested"])
        lines.append(
            f"| {name} | {alloc['peak_requested'] / gib:.2f} | {alloc['peak_reserved'] / gib:.2f} | "
            f"{alloc['reserved_over_requested']:.4f} | {alloc['segment_allocations']} | {arena_cells} | "
            f"{plan_over:.4f} |"
        )
    if results.get("irregular"):
        lines += [
            "",
            "**Irregular traces** (stress case, not layer-like: frees in random order; `irregular_trace`).",
            "",
            f"| seed | tensors | LB (KiB) | {SOLVER_HEADER} | planner, 2 workers: s |",
            "|---|---|---|" + "---|" * 13,
        ]
        for row in results["irregular"]:
            two = row["planner_2_workers"]
            lines.append(
                f"| {row['seed']} | {row['tensors']} | {row['lower_bound'] / 1024:.1f} | {_solver_cells(row)} | "
                f"{two['seconds']:.2f}{'' if two['optimal'] else ' (not proven)'} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, nargs="+", help="profiler trace files (JSON lines) of whole steps")
    parser.add_argument("--profile", nargs="+", help="profile whole steps of these models (built-in names) instead")
    parser.add_argument("--seq-lens", nargs="+", default=["32k", "128k"], help="with --profile (default 32k 128k)")
    parser.add_argument(
        "--modes", nargs="+", default=["hf-checkpointing", "memo"], help="with --profile: hf-memo estimate modes"
    )
    parser.add_argument("--quick", action="store_true", help="MIP limited to 5 s per layer trace instead of 60 s")
    parser.add_argument("--tiny", action="store_true", help="tiny synthetic model, seconds-long smoke run")
    parser.add_argument("--mip-limit", type=float, default=None, help="seconds for the MIP (0 skips it)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds per CP-SAT problem")
    parser.add_argument("--workers", type=int, default=1, help="CP-SAT threads")
    parser.add_argument("--alignment", default="512B", help="bytes sizes are rounded up to (default 512), e.g. 1MiB")
    parser.add_argument("--save-traces", type=Path, default=None, help="also write the synthetic/profiled traces here")
    add_out_option(parser)
    args = parser.parse_args()

    date, out = results_folder(args.out)
    alignment = parse_bytes(args.alignment)
    mip_limit = args.mip_limit if args.mip_limit is not None else (5.0 if args.quick or args.tiny else 60.0)
    source = "synthetic traces (see the script's docstring)"
    if args.trace:
        source = "profiler trace files"
        steps = {}
        for path in args.trace:
            trace = AllocationTrace.load(path)
            steps[_trace_name(trace.meta, path.stem)] = trace
    elif args.profile:
        source = "profiler traces (every layer profiled on fake tensors, hf_memo.integrations.plan.profile_step)"
        steps, profile_seconds = {}, {}
        for model in args.profile:
            for seq_len in map(parse_tokens, args.seq_lens):
                for mode in args.modes:
                    began = time.perf_counter()
                    trace = profile_step(model, seq_len, mode=mode)
                    name = _trace_name(trace.meta, model)
                    profile_seconds[name] = round(time.perf_counter() - began, 2)
                    print(f"profiled {name} in {profile_seconds[name]} s ({len(trace.events)} events)", flush=True)
                    steps[name] = trace
        if args.save_traces:
            args.save_traces.mkdir(parents=True, exist_ok=True)
            for name, step in steps.items():
                step.save(args.save_traces / f"{name.replace(' ', '_').replace('=', '')}.jsonl")
    else:
        models, seq_lens = (["tiny-llama"], [512]) if args.tiny else (["llama-3-8b", "gpt-7b"], [32768, 131072])
        steps = {
            f"{m} S={format_tokens(s)}{' ckpt' if c else ''}": synthetic_step(m, s, checkpointing=c)
            for m in models
            for s in seq_lens
            for c in (False, True)
        }
        if args.save_traces:
            args.save_traces.mkdir(parents=True, exist_ok=True)
            for name, step in steps.items():
                step.save(args.save_traces / f"{name.replace(' ', '_').replace('=', '')}.jsonl")
    results = {
        "date": date,
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "workers": args.workers,
        "time_limit": args.time_limit,
        "mip_limit": mip_limit,
        "alignment": alignment,
        "source": source,
        "runs": {},
    }
    began = time.perf_counter()  # the first CP-SAT solve of a process loads OR-Tools: timed apart
    solve_dsa(Trace.from_events(GREEDY_MISSES_THE_OPTIMUM), "cpsat", alignment=1)
    results["ortools_first_solve_seconds"] = round(time.perf_counter() - began, 3)
    for name, step in steps.items():
        print(name, flush=True)
        results["runs"][name] = benchmark_step(step, mip_limit, args.time_limit, args.workers, alignment)
        if args.profile:
            results["runs"][name]["profile_seconds"] = profile_seconds[name]
    if not (args.trace or args.profile):
        results["irregular"] = []
        for seed in range(2 if args.tiny else 5):
            trace = irregular_trace(seed, 40 if args.tiny else 150)
            row = {"seed": seed, **compare_solvers(trace, args.time_limit, mip_limit, args.workers)}
            row["planner_2_workers"] = solve(trace, "cpsat", args.time_limit, 2)
            print(f"irregular {seed}: {_summary_line(row)}", flush=True)
            results["irregular"].append(row)
    stem = "planner_dsa" + ("_traces" if args.trace else "_profiled" if args.profile else "")
    stem += "" if alignment == 512 else f"_align{format_bytes(alignment).replace(' ', '').replace('.00', '')}"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    (out / f"{stem}.md").write_text(markdown(results))
    print(f"wrote {out / stem}.json and .md")


if __name__ == "__main__":
    main()
