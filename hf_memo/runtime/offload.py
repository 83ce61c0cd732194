"""Moving bytes between device and host: a reusable host buffer pool and a copy engine with side streams.

On CUDA, host buffers are pinned and copies run on their own device-to-host and host-to-device
streams, ordered against the compute stream with events. On CPU the same calls are plain copies and
events are ``None``, so every code path runs in the CPU test suite.
"""

from __future__ import annotations

import torch

from hf_memo.profiler.placement import mark_host


class HostPool:
    """Host byte buffers reused across steps: acquiring after a release of a large enough buffer allocates nothing.

    Buffers are pinned when the device is CUDA. ``reserved_bytes`` only grows when more bytes are in
    flight at once than ever before (e.g. a longer sequence).
    """

    def __init__(self, device: torch.device) -> None:
        self.pin = device.type == "cuda"
        self._free: list[torch.Tensor] = []
        self.reserved_bytes = 0
        self.in_use_bytes = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A ``(>= nbytes,)`` uint8 host buffer; the smallest free one that fits, else a new one."""
        fitting = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
        if fitting:
            buffer = self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
        else:
            buffer = mark_host(torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.pin))
            self.reserved_bytes += nbytes
        self.in_use_bytes += buffer.numel()
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        """Give a buffer from :meth:`acquire` back for reuse."""
        self.in_use_bytes -= buffer.numel()
        self._free.append(buffer)


class CopyEngine:
    """Asynchronous device<->host copies on side streams (CUDA), or plain copies (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None

    def _copy(
        self, stream: torch.cuda.Stream | None, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None
    ) -> torch.cuda.Event | None:
        if stream is None:
            dst.copy_(src)
            return None
        stream.wait_event(torch.cuda.current_stream(self.device).record_event())
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            return stream.record_event()

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
        """Copy device ``src`` into host ``dst`` once the compute stream's work so far is done."""
        return self._copy(self.d2h, dst, src, None)

    def to_device(
        self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None = None
    ) -> torch.cuda.Event | None:
        """Copy host ``src`` into device ``dst`` once the compute stream's work so far and ``after`` (e.g. the
        copy that filled ``src``) are done."""
        return self._copy(self.h2d, dst, src, after)

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Make the compute stream wait for ``event`` (no-op on CPU)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def mark(self) -> torch.cuda.Event | None:
        """An event at the compute stream's current position (``None`` on CPU)."""
        return torch.cuda.current_stream(self.device).record_event() if self.cuda else None
