"""Tiny models of every supported family, built from configs (no downloads), and comparison helpers."""

from __future__ import annotations

import atexit
import copy
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()

# The suite runs as two xdist workers on two cores: one thread each (and in the processes tests start)
# avoids oversubscribing them, which slowed small tests down tenfold.
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"

# The estimator's on-disk cache of fits (hf_memo.estimator.fit_cache): a fresh folder for each test process (and
# the commands it starts), removed at its end; never the user's, so no test reads a fit that another run wrote.
os.environ["HF_MEMO_CACHE_DIR"] = tempfile.mkdtemp(prefix="hf_memo_test_cache_")
atexit.register(shutil.rmtree, os.environ["HF_MEMO_CACHE_DIR"], True)

VOCAB = 101
TINY_LAYOUT = dict(  # a tiny Llama layout; other families' configs take the same fields
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=72,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

FAMILY_BUILDERS = {
    "llama": lambda **kw: LlamaForCausalLM(LlamaConfig(**{**TINY_LAYOUT, **kw})),
    "mistral": lambda **kw: MistralForCausalLM(MistralConfig(**{**TINY_LAYOUT, **kw})),
    "qwen2": lambda **kw: Qwen2ForCausalLM(Qwen2Config(**{**TINY_LAYOUT, **kw})),
    "qwen3": lambda **kw: Qwen3ForCausalLM(Qwen3Config(**{**TINY_LAYOUT, "head_dim": 8, **kw})),
    "gpt2": lambda **kw: GPT2LMHeadModel(
        GPT2Config(
            **{
                "vocab_size": VOCAB,
                "n_embd": 32,
                "n_layer": 2,
                "n_head": 4,
                "n_positions": 512,
                "resid_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "attn_pdrop": 0.0,
                "bos_token_id": 1,
                "eos_token_id": 2,
                **kw,
            }
        )
    ),
}
FAMILIES = sorted(FAMILY_BUILDERS)


ROOT = Path(__file__).resolve().parents[1]


def run_command(command: list[str], env: dict | None = None) -> None:
    """Run ``command``; on failure, the assertion message carries the end of its output."""
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"exit {done.returncode}: {' '.join(command)}\n{(done.stdout + done.stderr)[-4000:]}"


def run_benchmark(script: str, out: Path, *args: str) -> dict:
    """Run ``benchmarks/<script>.py --tiny --out out *args`` in its own process; return its ``<script>.json``."""
    run_command([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--tiny", "--out", str(out), *args])
    return json.loads((out / f"{script}.json").read_text())


def build_model(family: str, dtype: torch.dtype = torch.float64, seed: int = 0, **config_overrides) -> torch.nn.Module:
    """A tiny randomly initialised ``*ForCausalLM`` of ``family`` in train mode."""
    torch.manual_seed(seed)
    return FAMILY_BUILDERS[family](**config_overrides).to(dtype).train()


def model_pair(family: str, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two identical copies: (to be patched, unpatched reference)."""
    model = build_model(family, **kwargs)
    return model, copy.deepcopy(model)


def make_batch(batch: int, seq: int, masked_fraction: float = 0.3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of shape ``(batch, seq)``; about ``masked_fraction`` labels are -100."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=gen)
    labels = ids.clone()
    labels[torch.rand(batch, seq, generator=gen) < masked_fraction] = -100
    return ids, labels


def assert_same_grads(
    model: torch.nn.Module, reference: torch.nn.Module, rtol: float = 1e-9, atol: float = 1e-12
) -> None:
    """Every parameter gradient of ``model`` equals the reference's (both present or both absent)."""
    ref_params = dict(reference.named_parameters())
    checked = 0
    for name, param in model.named_parameters():
        ref = ref_params[name]
        assert (param.grad is None) == (ref.grad is None), f"{name}: gradient present in only one model"
        if param.grad is not None:
            torch.testing.assert_close(param.grad, ref.grad, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
            checked += 1
    assert checked > 0, "no gradients were compared"


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


class ShapeRecorder:
    """Records the shape of every tensor any op produces while active (a ``TorchDispatchMode``)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        shapes = self.shapes = []

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        shapes.append(tuple(t.shape))
                return out

        self._mode = _Mode()

    def __enter__(self) -> ShapeRecorder:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def largest(self) -> int:
        """Element count of the largest tensor produced."""
        return max((int(torch.Size(s).numel()) for s in self.shapes), default=0)


@pytest.fixture
def fake_world():
    """A fake process group of any size in this process (as rank ``rank``, 0 unless given): collectives move
    nothing, tensors keep their shapes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    sizes = []

    def world(size, rank=0):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
        sizes.append(size)
        return dist.group.WORLD

    yield world
    if sizes:
        dist.destroy_process_group()


# The longest modules first (seconds on 2 cores, most first): with ``--dist loadscope`` each module goes whole to the
# next free worker, so the run ends on short modules instead of one worker waiting for the other's long one
# (``--no-loadscope-reorder`` keeps this order; xdist would otherwise order modules by their number of tests).
LONGEST_FIRST = (  # measured 2026-11-29: every module whose tests took 35 s or more in all
    "test_estimator_policy_footprint.py",
    "test_estimator_fitted.py",
    "test_integrations_policy_sizing.py",
    "test_benchmarks_suite.py",
    "test_estimator_estimate.py",
    "test_parallel_zero3.py",
    "test_estimator_fit_cache.py",
    "test_benchmarks.py",
    "test_parallel_causal_lm.py",
    "test_benchmarks_loss_curves.py",
    "test_integrations_planning.py",
    "test_patches_forwards_fsdp.py",
    "test_integrations_trainer.py",
    "test_runtime_memo.py",
    "test_integrations_accelerate.py",
    "test_runtime_memo_live_graphs.py",
    "test_examples_longalpaca.py",
    "test_benchmarks_packed_vs_padded.py",
    "test_benchmarks_planner.py",
    "test_packaging.py",
    "test_patches_self_check_sharding.py",
    "test_profiler_footprint.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: every module keeps its own order


@pytest.fixture
def deferred_copies(monkeypatch):
    """The memo runtime's copies carried out late, as CUDA's streams may (hf_memo/runtime/deferred_copies.py): a read
    before its wait is garbage, and a destination freed or a host buffer handed on with a copy pending fails the
    test (at its teardown, where nothing raised it before)."""
    from hf_memo.runtime import deferred_copies

    monkeypatch.setenv("HF_MEMO_COPY_ENGINE", "deferred")
    deferred_copies.faults()  # none of another test's
    yield
    gc.collect()
    found = deferred_copies.faults()
    assert not found, found


@pytest.fixture
def self_check_off(monkeypatch):
    """hf_memo's self-check never runs: for tests that count what a training step runs (kernel calls, checkpointed
    layers, stashes, plans), which the check's probe passes on the first step would add to."""
    from hf_memo.patches.self_check import SelfCheck

    monkeypatch.setattr(SelfCheck, "due", lambda self, model, sample: False)
