"""Data that ships inside the package, so ``hf-memo demo`` and the LongAlpaca recipe run offline from a wheel.

``longalpaca/sample.json``: 40 synthetic LongAlpaca-format records (a long field report, a question, its answer);
``longalpaca/sample_tokenizer/``: a 4,096-token byte-level BPE tokenizer trained on them. Both are written,
deterministically, by ``examples/longalpaca/make_sample.py``.
"""

from pathlib import Path

LONGALPACA_DIR = Path(__file__).resolve().parent / "longalpaca"
LONGALPACA_SAMPLE = LONGALPACA_DIR / "sample.json"
LONGALPACA_TOKENIZER = LONGALPACA_DIR / "sample_tokenizer"

__all__ = ["LONGALPACA_DIR", "LONGALPACA_SAMPLE", "LONGALPACA_TOKENIZER"]
