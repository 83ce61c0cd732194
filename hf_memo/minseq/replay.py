"""What a recomputation in backward needs to repeat a forward exactly: RNG state and autocast state.

Leaving the outermost ``torch.autocast`` region empties autocast's cache of weight casts. A backward that
recomputes chunk after chunk, each under :meth:`ReplayState.replay`, runs them inside
:func:`autocast_cache_kept`, so each weight is cast once per backward, not once per chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ReplayState:
    """RNG and autocast state of one forward computation on ``device``.

    Dropout in a recomputed chunk draws the same mask as in forward, and the recomputation runs
    under the same autocast dtype, so recomputed intermediates equal the forward ones bitwise.
    """

    device: torch.device
    cpu_rng: torch.Tensor
    device_rng: torch.Tensor | None
    autocast_enabled: bool
    autocast_dtype: torch.dtype

    @classmethod
    def capture(cls, device: torch.device) -> ReplayState:
        device_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(
            device=device,
            cpu_rng=torch.get_rng_state(),
            device_rng=device_rng,
            autocast_enabled=torch.is_autocast_enabled(device.type),
            autocast_dtype=torch.get_autocast_dtype(device.type),
        )

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block with this state; the caller's RNG state is restored afterwards."""
        devices = [self.device] if self.device_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.set_rng_state(self.cpu_rng)
            if self.device_rng is not None:
                torch.cuda.set_rng_state(self.device_rng, self.device)
            with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_enabled):
                yield


@contextmanager
def autocast_cache_kept(device: torch.device) -> Iterator[None]:
    """Keep autocast's weight-cast cache across the :meth:`ReplayState.replay` regions run inside (until this
    region ends); the autocast state inside is the caller's, unchanged (so a backward run inside stays as it is).
    """
    kind = device.type
    with torch.autocast(kind, dtype=torch.get_autocast_dtype(kind), enabled=torch.is_autocast_enabled(kind)):
        yield
