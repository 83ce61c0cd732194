"""The longest sequence that fits: a bracketing search over a memory usage that grows with sequence length."""

from __future__ import annotations

from collections.abc import Callable


def _round_down(value: float, granularity: int) -> int:
    return int(value // granularity) * granularity


def longest_fitting(usage: Callable[[int], float], start: int, granularity: int = 256, limit: int = 1 << 24) -> int:
    """The largest multiple of ``granularity`` up to ``limit`` whose ``usage`` is at most 1 (0 if none is).

    ``usage(seq_len)`` is the fraction of the memory budget used (e.g. peak / GPU memory); it is
    assumed to grow with the sequence length, close to linearly, so each probe is placed where the
    line through the bracketing probes crosses 1 (with a bisection whenever that stalls). A handful
    of probes suffices; each costs one ``usage`` call.
    """
    if granularity < 1 or limit < granularity:
        raise ValueError(f"need 1 <= granularity <= limit, got granularity={granularity}, limit={limit}")
    probes: dict[int, float] = {}

    def probe(seq_len: int) -> float:
        if seq_len not in probes:
            probes[seq_len] = usage(seq_len)
        return probes[seq_len]

    if probe(granularity) > 1:
        return 0
    lo = granularity
    hi = None
    candidate = min(max(_round_down(start, granularity), granularity), limit)
    while hi is None:  # grow until something does not fit
        if probe(candidate) <= 1:
            lo = candidate
            if lo >= limit:
                return lo
            slope = (probes[lo] - probes[granularity]) / max(lo - granularity, 1)
            guess = lo + (1 - probes[lo]) / slope if slope > 0 else 8 * lo
            candidate = min(limit, max(lo + granularity, min(_round_down(guess, granularity), 8 * lo)))
        else:
            hi = candidate
    bisect_next = False
    while hi - lo > granularity:
        if bisect_next:
            candidate = _round_down((lo + hi) / 2, granularity)
        else:
            u_lo, u_hi = probes[lo], probes[hi]
            candidate = _round_down(lo + (1 - u_lo) * (hi - lo) / (u_hi - u_lo), granularity)
        candidate = min(max(candidate, lo + granularity), hi - granularity)
        width = hi - lo
        if probe(candidate) <= 1:
            lo = candidate
        else:
            hi = candidate
        bisect_next = (hi - lo) > width / 2
    return lo
