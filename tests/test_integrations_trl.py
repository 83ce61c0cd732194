"""TRL's ``SFTTrainer`` with ``MemoCallback`` against TRL without hf_memo: padding-free and packed batches,
Hugging Face gradient checkpointing on (TRL's default), the same losses step by step."""

import pytest
import torch
import trl
from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

import hf_memo
from hf_memo import MemoCallback, MemoConfig
from tests.conftest import VOCAB, build_model

STEPS = 2


def _tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' vocabulary (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2)."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )


def _dataset() -> Dataset:
    """Tokenized rows of different lengths (7 to 30 tokens), so batches have padding to remove or rows to pack."""
    generator = torch.Generator().manual_seed(0)
    lengths = [7, 30, 12, 19, 25, 9, 16, 22]
    return Dataset.from_dict(
        {"input_ids": [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]}
    )


def _train(tmp_path, name: str, memo: MemoConfig | None, **sft) -> list[float]:
    model = build_model("llama", dtype=torch.float32, num_hidden_layers=3)
    args = trl.SFTConfig(
        output_dir=str(tmp_path / name),
        max_steps=STEPS,
        per_device_train_batch_size=3,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        seed=0,
        gradient_checkpointing=True,
        max_length=32 if sft.get("packing") else None,
        **sft,
    )
    callbacks = [] if memo is None else [MemoCallback(memo, progress=False)]
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=_dataset(), processing_class=_tokenizer(), callbacks=callbacks
    )
    trainer.train()
    assert (hf_memo.applied_config(model) is not None) == (memo is not None)
    if memo is not None and memo.recompute == "memo":
        assert hf_memo.memo_runtime(model).attention_calls > 0  # the memo executor ran the layers
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


LAYOUTS = {"padding_free": {"padding_free": True}, "packing": {"packing": True}}
CONFIGS = {
    "none": MemoConfig(recompute="none", mlp_chunks=3),
    "full": MemoConfig(recompute="full", mlp_chunks=3),
    "selective": MemoConfig(recompute="selective", mlp_chunks=3),
    "memo": MemoConfig(recompute="memo", mlp_chunks=3, min_chunk_tokens=1, offload_fraction=0.5),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sft_trainer_with_memo_callback_matches_trl_alone(tmp_path, layout):
    # TRL computes its loss with its own LM head on the backbone's output (fused_lm_head): hf_memo contributes the
    # decoder layers, which attend per sample from the batch the backbone describes.
    plain = _train(tmp_path, "plain", None, **LAYOUTS[layout])
    assert len(plain) == STEPS
    for recompute, config in CONFIGS.items():
        memo = _train(tmp_path, recompute, config, **LAYOUTS[layout])
        torch.testing.assert_close(torch.tensor(memo), torch.tensor(plain), rtol=1e-6, atol=0, msg=recompute)
