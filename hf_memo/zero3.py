"""DeepSpeed ZeRO stage 3 is refused: hf_memo's layer functions need whole parameters in backward.

ZeRO-3 partitions every parameter to shape ``[0]`` outside the gather around its module's own call.
hf_memo's autograd Functions (mini-sequence MLP and LM head, the memo layer executor) take the
parameters as inputs and recompute with them in backward, where ZeRO-3 has released them: autograd
then rejects the gradients (``returned an invalid gradient ... expected shape compatible with [0]``),
in every recompute mode and with sequence parallelism (reproduced on CPU with gloo, DeepSpeed 0.19).
ZeRO stages 1 and 2 keep parameters whole and train exactly like one process; FSDP2 shards parameters
and is exact too.
"""

from __future__ import annotations

import os

from torch import nn

ALTERNATIVES = (
    "use DeepSpeed ZeRO stage 1 or 2 (optimizer state and gradients partitioned, parameters whole), "
    "or FSDP2 (torch.distributed.fsdp.fully_shard) to shard parameters"
)


def zero3_reason(model: nn.Module) -> str | None:
    """Why DeepSpeed ZeRO-3 is (or will be) in charge of ``model``'s parameters, or ``None``.

    ZeRO-3 is seen in the parameters themselves (DeepSpeed gives a partitioned parameter a ``ds_id``),
    in transformers' DeepSpeed config (``TrainingArguments(deepspeed=...)``, Accelerate's DeepSpeed
    plugin) or in the environment ``accelerate launch`` sets for a DeepSpeed config.
    """
    first = next(model.parameters(), None)
    if first is not None and hasattr(first, "ds_id"):
        return "its parameters are partitioned by DeepSpeed ZeRO stage 3"
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        return "transformers' DeepSpeed config sets zero_optimization.stage=3"
    accelerate_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if accelerate_deepspeed and os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3":
        return "accelerate launch configures DeepSpeed with zero_stage: 3"
    return None


def check_not_zero3(model: nn.Module) -> None:
    """Raise ``ValueError`` naming ZeRO-3 and what to use instead when it is in charge of ``model``."""
    reason = zero3_reason(model)
    if reason is not None:
        raise ValueError(
            f"hf_memo does not support DeepSpeed ZeRO stage 3 ({reason}): ZeRO-3 releases every parameter "
            "to shape [0] outside its module's call, and hf_memo's mini-sequence and memo layer functions "
            f"recompute with whole parameters in backward; {ALTERNATIVES}"
        )
