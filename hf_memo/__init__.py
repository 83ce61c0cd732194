"""hf_memo: long-context training for Hugging Face Transformers in one line, ``hf_memo.apply(model)``."""

from hf_memo.config import MemoConfig
from hf_memo.integrations.estimate import estimate
from hf_memo.integrations.planning import plan_training_step
from hf_memo.integrations.trainer import MemoCallback
from hf_memo.patches import applied_config, apply, memo_runtime, revert, supported_model_types

__version__ = "0.1.0"

__all__ = [
    "MemoCallback",
    "MemoConfig",
    "applied_config",
    "apply",
    "estimate",
    "memo_runtime",
    "plan_training_step",
    "revert",
    "supported_model_types",
]
