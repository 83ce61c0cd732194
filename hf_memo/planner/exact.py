"""What an exact DSA solver hands back, and the error it raises when it cannot run at all."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class SolverUnavailable(RuntimeError):
    """The solver cannot run here (not installed, or its license refuses the model)."""


@dataclass(frozen=True)
class ExactResult:
    """One exact solve of ``min peak`` subject to ``peak >= floor``.

    Attributes:
        offsets: the best placement found, shape ``(n,)``, or ``None`` when none was found in time.
        bound: a proven lower bound on ``max(floor, optimal peak)``.
        proven: whether the solver proved its placement optimal (for ``peak >= floor``).
        status: the solver's own status, in words.
    """

    offsets: np.ndarray | None
    bound: int
    proven: bool
    status: str
