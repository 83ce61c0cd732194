import torch
from torch._subclasses.fake_tensor import is_fake
from transformers import LlamaConfig

import hf_memo
from hf_memo.profiler.fake_model import fake_causal_lm
from hf_memo.profiler.memtracker import training_step_peak
from tests.conftest import ShapeRecorder

CONFIG = LlamaConfig(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=500,
    max_position_embeddings=4096,
)


def test_parameters_are_fake_and_of_the_requested_dtype():
    model, _ = fake_causal_lm(CONFIG, torch.bfloat16)
    assert model.training
    assert all(is_fake(p) and p.dtype == torch.bfloat16 for p in model.parameters())


def test_no_full_attention_mask_is_built_for_unpacked_sequences():
    seq = 1024
    model, session = fake_causal_lm(CONFIG, torch.float32)
    with session, ShapeRecorder() as recorder:
        model.model(input_ids=torch.randint(0, 500, (1, seq)), use_cache=False)
    assert not [s for s in recorder.shapes if s[-2:] == (seq, seq)]


def test_step_peak_is_positive_and_smaller_with_hf_memo():
    peaks = {}
    for patched in (False, True):
        model, session = fake_causal_lm(CONFIG, torch.float32)
        with session:
            if patched:
                hf_memo.apply(model, mlp_chunks=4, lm_head_chunks=8)
            peaks[patched] = training_step_peak(model, 1, 2048)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert peaks[False].parameter == peaks[True].parameter == params
    assert peaks[True].activations < peaks[False].activations
    assert peaks[False].total >= peaks[False].parameter + peaks[False].activations


def test_peft_can_add_adapters_to_a_fake_model():
    from peft import LoraConfig, get_peft_model

    model, session = fake_causal_lm(CONFIG, torch.bfloat16)
    with session, session.converting_modules():
        model = get_peft_model(model, LoraConfig(r=4, task_type="CAUSAL_LM"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(is_fake(p) for p in model.parameters())
    # rank 4 on q_proj (64 -> 64) and v_proj (64 -> 32) of both layers
    assert sum(p.numel() for p in trainable) == 2 * (4 * (64 + 64) + 4 * (64 + 32))
