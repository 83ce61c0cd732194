"""Decoder-layer recompute modes (full, selective, memo) against the unpatched Hugging Face model."""

import contextlib
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode

import hf_memo
from hf_memo.patches.patching import patch_state
from tests.conftest import assert_same_grads, build_model, make_batch

# Each test compares the patched model with the unpatched one itself: the self-check would repeat that comparison at
# every first step (tests/test_patches_self_check.py checks it over the catalog).
pytestmark = pytest.mark.usefixtures("self_check_off")

LAYERS = 5  # the last two layers stay on the device; three are swapped to the host
MODES = [
    ("full", None),
    ("selective", None),
    ("memo", 0.0),
    ("memo", 1 / 8),
    ("memo", 1 / 4),
    ("memo", 1 / 2),
    ("memo", 1.0),
]


def _build(family, **kw):
    layers = {"n_layer": LAYERS} if family == "gpt2" else {"num_hidden_layers": LAYERS}
    return build_model(family, **layers, **kw)


CHUNKS = 8


def _apply(model, recompute, alpha, **kw):
    extra = {} if alpha is None else {"offload_fraction": alpha}
    return hf_memo.apply(model, recompute=recompute, mlp_chunks=CHUNKS, lm_head_chunks=3, **extra, **kw)


def _step(model, ids, labels, **kwargs):
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out.loss.detach()


class OpCounter(TorchDispatchMode):
    def __init__(self, *ops):
        super().__init__()
        self.ops, self.counts = ops, {op: 0 for op in ops}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.counts:
            self.counts[func] += 1
        return func(*args, **(kwargs or {}))


CASES = [(family, *mode) for family in ("llama", "gpt2") for mode in MODES] + [
    (family, *mode) for family in ("mistral", "qwen2", "qwen3") for mode in (("selective", None), ("memo", 0.5))
]


@pytest.mark.parametrize("family,recompute,alpha", CASES, ids=[f"{f}-{m}-{a}" for f, m, a in CASES])
def test_loss_and_every_gradient_match_unpatched(family, recompute, alpha):
    model = _build(family)
    reference = copy.deepcopy(model)
    _apply(model, recompute, alpha)
    ids, labels = make_batch(2, 19)
    torch.testing.assert_close(_step(model, ids, labels), _step(reference, ids, labels), rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


def test_memo_swaps_the_lower_layers_and_offloads_the_requested_fraction():
    model = _apply(_build("llama"), "memo", 0.5)
    _step(model, *make_batch(2, 16))
    runtime = patch_state(model).runtime
    assert [layer.on_host for layer in runtime.plan.layers] == [True] * (LAYERS - 2) + [False, False]
    assert {layer.alpha for layer in runtime.plan.layers} == {0.5}
    assert runtime.host_reserved_bytes > 0


def test_memo_runs_attention_once_per_layer_and_never_in_backward():
    model = _apply(_build("qwen3"), "memo", 0.25)
    _step(model, *make_batch(2, 16, seed=1))  # first step: calibration probe
    runtime = patch_state(model).runtime
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    before = runtime.attention_calls
    for seed in (2, 3):
        with OpCounter(flash, flash_backward) as counter:
            out = model(input_ids=make_batch(2, 16, seed=seed)[0], labels=make_batch(2, 16, seed=seed)[1])
            assert counter.counts[flash] == LAYERS
            out.loss.backward()
        # backward: attention in query blocks, one per chunk, each block's own keys and (but the first) the keys
        # before it: two kernel calls per block but one, and no forward call (attention is never recomputed)
        assert counter.counts == {flash: LAYERS, flash_backward: LAYERS * (2 * CHUNKS - 1)}
    assert runtime.attention_calls - before == 2 * LAYERS


@pytest.mark.usefixtures("self_check_off")
def test_full_recompute_runs_attention_twice_per_layer():
    model = _apply(_build("llama"), "full", None)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    with OpCounter(flash) as counter:
        _step(model, *make_batch(1, 16))
    assert counter.counts[flash] == 2 * LAYERS


@pytest.mark.parametrize("mlp_chunks,kept_per_layer", [(1, 6), (8, 4)])
def test_selective_keeps_matmul_outputs_and_recomputes_the_rest(mlp_chunks, kept_per_layer):
    counts = {}
    for recompute in ("full", "selective"):
        model = hf_memo.apply(_build("llama"), recompute=recompute, mlp_chunks=mlp_chunks)
        ids, labels = make_batch(1, 16)
        loss = model(input_ids=ids, labels=labels).loss
        mm, rsqrt = torch.ops.aten.mm.default, torch.ops.aten.rsqrt.default
        with OpCounter(mm, rsqrt) as counter:
            loss.backward()
        counts[recompute] = counter.counts
    # Per layer, full recomputation repeats the projections selective kept: q, k, v, o and, unless the MLP runs
    # in mini-sequences (whose intermediates are never kept), gate and up (down's output is saved by nothing,
    # so neither mode recomputes it)...
    mm = torch.ops.aten.mm.default
    assert counts["full"][mm] - counts["selective"][mm] == kept_per_layer * LAYERS
    # ...while both recompute the two RMSNorms of every layer.
    assert counts["full"][torch.ops.aten.rsqrt.default] == counts["selective"][torch.ops.aten.rsqrt.default] > 0


def test_memo_host_pool_does_not_grow_across_steps():
    model = _apply(_build("gpt2"), "memo", 0.5)
    runtime = patch_state(model).runtime
    sizes = []
    for seed in range(4):
        model.zero_grad()
        _step(model, *make_batch(2, 16, seed=seed))
        sizes.append((runtime.host_reserved_bytes, runtime.device_buffer_bytes))
    assert sizes[0][0] > 0 and len(set(sizes)) == 1


def test_memo_with_lora_matches_unpatched_lora():
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], lora_dropout=0.0)
    model, reference = _build("llama"), None
    reference = copy.deepcopy(model)
    torch.manual_seed(3)
    model = get_peft_model(model, lora)
    torch.manual_seed(3)
    reference = get_peft_model(reference, lora)
    for m in (model, reference):
        for name, p in m.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
    _apply(model, "memo", 0.5)
    ids, labels = make_batch(2, 17)
    torch.testing.assert_close(_step(model, ids, labels), _step(reference, ids, labels), rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


def test_memo_under_bf16_autocast_tracks_unpatched_autocast():
    model = _build("llama", dtype=torch.float32)
    reference = copy.deepcopy(model)
    _apply(model, "memo", 0.5)
    ids, labels = make_batch(2, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(input_ids=ids, labels=labels).loss
        want = reference(input_ids=ids, labels=labels).loss
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        cosine = torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), dim=0)
        assert cosine > 0.99, name


def test_memo_gradient_accumulation_with_num_items(family):
    model = _build(family)
    reference = copy.deepcopy(model)
    _apply(model, "memo", 0.5)
    batches = [make_batch(2, 13, seed=s) for s in (4, 5)]
    num_items = torch.tensor(sum(int((labels[:, 1:] != -100).sum()) for _, labels in batches))
    for ids, labels in batches:
        _step(model, ids, labels, num_items_in_batch=num_items)
        _step(reference, ids, labels, num_items_in_batch=num_items)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


class StandInDeviceRng:
    """A CPU generator that ``torch.utils.checkpoint`` takes for the RNG of device 0 of type ``"privateuseone"``.

    Installed as ``torch.privateuseone`` (the device module checkpoint looks up), with checkpoint's lookup of the
    devices of its *positional* tensor arguments redirected to it, as it finds a GPU's RNG on a GPU.
    """

    _initialized = True

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def device(self, _index):
        return contextlib.nullcontext()

    def device_count(self) -> int:
        return 1

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.bfloat16]

    def get_rng_state(self, _device=None) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor, _device=None) -> None:
        self.generator.set_state(state)

    def install(self, monkeypatch) -> None:
        def positional_tensors(args) -> bool:
            return any(isinstance(a, torch.Tensor) for a in torch.utils._pytree.tree_leaves(args))

        monkeypatch.setattr(torch, "privateuseone", self, raising=False)
        monkeypatch.setattr(
            torch.utils.checkpoint, "_infer_device_type", lambda *a: "privateuseone" if positional_tensors(a) else "cpu"
        )
        monkeypatch.setattr(
            torch.utils.checkpoint,
            "get_device_states",
            lambda *a: ([0], [self.get_rng_state()]) if positional_tensors(a) else ([], []),
        )


class DeviceRngDropout(torch.nn.Module):
    """Dropout drawing its mask from a :class:`StandInDeviceRng`, as dropout on a GPU draws from the GPU's RNG."""

    def __init__(self, p: float, rng: StandInDeviceRng) -> None:
        super().__init__()
        self.p, self.rng = p, rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = torch.rand(x.shape, generator=self.rng.generator, dtype=x.dtype) >= self.p
        return x * keep / (1 - self.p)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_checkpointed_recomputation_replays_device_rng_dropout(recompute, monkeypatch):
    rng, reference_rng = StandInDeviceRng(seed=5), StandInDeviceRng(seed=5)
    model = _build("gpt2")
    reference = copy.deepcopy(model)
    rng.install(monkeypatch)
    for m, generator in ((model, rng), (reference, reference_rng)):
        for block in m.transformer.h:
            block.attn.resid_dropout = DeviceRngDropout(0.3, generator)
    _apply(model, recompute, None)
    ids, labels = make_batch(2, 15)
    torch.testing.assert_close(_step(model, ids, labels), _step(reference, ids, labels), rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)


def test_memo_refuses_4d_masks():
    model = _apply(_build("llama"), "memo", 0.0)
    ids, labels = make_batch(2, 12)
    mask = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="takes the samples of a batch from the model's training forward.*4-D"):
        model(input_ids=ids, labels=labels, attention_mask=mask)


GEMMA_RTOL = 1e-5


def _assert_grads_near(model, reference) -> None:
    """Every gradient of ``model`` within ``GEMMA_RTOL`` of the reference's, relative to the reference's norm."""
    pairs = [(n, p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), reference.parameters())]
    assert all((mine is None) == (theirs is None) for _, mine, theirs in pairs)
    worst = max(((mine - theirs).norm() / theirs.norm()).item() for _, mine, theirs in pairs if theirs is not None)
    assert worst <= GEMMA_RTOL


def _gemma4(per_layer_inputs: bool):
    """A tiny fp64 Gemma 4 (a heterogeneous config: its full-attention layer's heads twice as wide as its sliding
    layer's), with or without per-layer input embeddings (passed to each layer beside its hidden states). Its norms
    compute in float32 whatever the dtype, so chunked rows round differently there: each gradient agrees to
    ``GEMMA_RTOL`` relative to its norm (measured: 1.6e-7 under memo, 4.8e-8 under recompute='none')."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=5,
        per_layer_config={1: {"head_dim": 16}},
        vocab_size_per_layer_input=101,
        hidden_size_per_layer_input=8 if per_layer_inputs else 0,
    )
    torch.manual_seed(0)
    return Gemma4ForCausalLM(config).double().train()


def test_memo_refuses_a_layer_argument_that_needs_a_gradient():
    """Gemma 4's per-layer inputs come from trainable embeddings: memo's layer function would drop their gradient."""
    model = _gemma4(per_layer_inputs=True)
    reference = copy.deepcopy(model)
    _apply(model, "memo", 0.5)
    ids, labels = make_batch(2, 13)
    with pytest.raises(ValueError, match="Gemma4TextDecoderLayer gets arguments that need .*per_layer_input"):
        model(input_ids=ids, labels=labels)
    hf_memo.revert(model)  # the other modes differentiate the layer through autograd: exact
    _apply(model, "selective", None)
    torch.testing.assert_close(_step(model, ids, labels), _step(reference, ids, labels), rtol=1e-6, atol=0)
    _assert_grads_near(model, reference)


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_memo_on_heads_of_different_widths_per_layer_matches_unpatched(alpha):
    model = _gemma4(per_layer_inputs=False)
    reference = copy.deepcopy(model)
    _apply(model, "memo", alpha)
    ids, labels = make_batch(2, 13)
    torch.testing.assert_close(_step(model, ids, labels), _step(reference, ids, labels), rtol=1e-6, atol=0)
    _assert_grads_near(model, reference)


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_memo_training_forward_without_labels_matches_unpatched(family, alpha):
    model = _build(family)
    reference = copy.deepcopy(model)
    _apply(model, "memo", alpha)
    ids, _ = make_batch(2, 14)
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(2, 14, model.config.vocab_size, generator=generator, dtype=torch.float64)
    for m in (model, reference):
        m.zero_grad()
        out = m(input_ids=ids)
        assert out.loss is None
        (out.logits * weights).sum().backward()
    for seed in (1, 2):  # memo ran its layers (the first step calibrates), and steps stay exact
        ids = make_batch(2, 14, seed=seed)[0]
        logits = {}
        for name, m in (("memo", model), ("reference", reference)):
            m.zero_grad()
            logits[name] = m(input_ids=ids, use_cache=False).logits
            (logits[name] * weights).sum().backward()
        torch.testing.assert_close(logits["memo"], logits["reference"], rtol=1e-12, atol=1e-12)
        assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)
    assert patch_state(model).runtime.attention_calls > 0


def test_memo_leaves_evaluation_untouched():
    model = _apply(_build("llama"), "memo", 1.0)
    reference = copy.deepcopy(model)
    hf_memo.revert(reference)
    model.eval()
    reference.eval()
    ids, _ = make_batch(2, 11)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_memo_under_the_trainer_matches_plain_training_step_by_step(tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    ids, labels = make_batch(8, 16, seed=9)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})
    losses = {}
    for name in ("plain", "memo"):
        model = _build("llama", dtype=torch.float32)
        if name == "memo":
            _apply(model, "memo", 0.5)
        args = TrainingArguments(
            output_dir=str(tmp_path / name),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=2,
            learning_rate=1e-2,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            seed=0,
            data_seed=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        losses[name] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses["memo"]) == 2
    torch.testing.assert_close(torch.tensor(losses["memo"]), torch.tensor(losses["plain"]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.usefixtures("self_check_off")
def test_memo_bounds_a_chunks_intermediate_over_the_whole_batch(batch, monkeypatch):
    """``max_chunk_elements`` caps a chunk's MLP intermediate ``(B, S / chunks, I)``: the chunk count grows with B."""
    model = _build("llama")
    reference = copy.deepcopy(model)
    width = model.config.intermediate_size
    cut = []
    original = hf_memo.patches.forwards.chunk_bounds
    monkeypatch.setattr(hf_memo.patches.forwards, "chunk_bounds", lambda rows, n: cut.append(n) or original(rows, n))
    hf_memo.apply(model, recompute="memo", offload_fraction=0.5, min_chunk_tokens=1, max_chunk_elements=6 * width)
    ids, labels = make_batch(batch, 24)
    torch.testing.assert_close(_step(model, ids, labels), _step(reference, ids, labels), rtol=1e-6, atol=0)
    assert_same_grads(model, reference, rtol=1e-8, atol=1e-11)
    assert set(cut) == {24 // (6 // batch)}  # at most 6 tokens per chunk: 6 rows of one sequence, 1 row of 4
