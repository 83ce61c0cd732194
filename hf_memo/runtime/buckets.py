"""Length buckets: steps whose lengths differ by a few percent share one memory decision, plan and host buffers.

With dynamic padding nearly every step has a new length. Deciding the memory policy (calibration, the policy
solve), planning memory and pinning host buffers per exact length would redo seconds of work and re-pin
gigabytes at almost every step. The runtime instead decides once per bucket, for the bucket's longest
length, and sizes its buffers for it, so every step of the bucket fits what was decided and reuses them.
"""

from __future__ import annotations

STEPS_PER_OCTAVE = 32
"""Bucket lengths per power of two: a step is rounded up by less than ``1 / 32`` (3.1%) of its length."""


def bucket_length(seq_len: int) -> int:
    """The longest length of ``seq_len``'s bucket: ``seq_len`` rounded up to a multiple of ``2^(k - 5)``,
    where ``2^k <= seq_len < 2^(k+1)`` (exact below 64 tokens). ``bucket_length(bucket_length(s)) ==
    bucket_length(s)``."""
    if seq_len < 2 * STEPS_PER_OCTAVE:
        return seq_len
    step = 1 << (seq_len.bit_length() - 1 - (STEPS_PER_OCTAVE.bit_length() - 1))
    return -(-seq_len // step) * step


def stretch(seq_len: int) -> float:
    """``bucket_length(seq_len) / seq_len``: how much more than this step a buffer sized for its bucket holds."""
    return bucket_length(seq_len) / max(seq_len, 1)
