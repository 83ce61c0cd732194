"""The allocation trace of one training step: forward, backward and (optionally) an AdamW step.

The step is the steady state of training: optimizer state exists before it starts (one warm-up
step creates it, unrecorded) and gradients are released after the optimizer step, as a training
loop with ``zero_grad(set_to_none=True)`` does. AdamW is PyTorch's fused implementation, the
Hugging Face Trainer's default, with learning rate 0 so a profiled real model is left unchanged.

The profile runs the attention kernel of the machine it runs on; ``kernels`` names the device it is for, whose
attention kernels' workspace the trace then includes (:mod:`hf_memo.profiler.kernel_workspace`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hf_memo.profiler.trace import AllocationTrace

if TYPE_CHECKING:  # PyTorch and the recorder (fake tensors' dispatch) load with the first step, not with OPTIMIZERS
    import torch
    from torch import nn

    from hf_memo.profiler.allocations import AllocationRecorder
    from hf_memo.profiler.kernel_workspace import KernelTarget

OPTIMIZERS = ("adamw", "none")


def steady_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer | None:
    """The optimizer of the step over ``model``'s trainable parameters, its state already created (or ``None``)."""
    import torch

    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {kind!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "none" or not params:
        return None
    optimizer = torch.optim.AdamW(params, lr=0.0, fused=True)
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def token_batch(model: nn.Module, batch_size: int, seq_len: int) -> torch.Tensor:
    """Random ``(batch_size, seq_len)`` token ids for ``model``, on its device."""
    import torch

    config = model.config if hasattr(model, "config") else model.get_base_model().config
    device = next(model.parameters()).device
    return torch.randint(0, config.get_text_config().vocab_size, (batch_size, seq_len), device=device)


def training_step(
    model: nn.Module,
    input_ids: torch.Tensor,
    optimizer: torch.optim.Optimizer | None,
    stage: Callable[[str], None] = lambda name: None,
) -> None:
    """One step on ``input_ids`` ``(B, S)`` (also the labels); ``stage(name)`` is told each stage as it starts."""
    stage("forward")
    loss = model(input_ids=input_ids, labels=input_ids).loss
    stage("backward")
    loss.backward()
    del loss
    if optimizer is not None:
        stage("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    stage("other")


def record_training_step(
    model: nn.Module,
    batch_size: int,
    seq_len: int,
    optimizer: str = "adamw",
    on_start: Callable[[], None] | None = None,
    kernels: str | KernelTarget = "cuda",
) -> tuple[AllocationRecorder, int]:
    """Run one training step of ``model`` under an :class:`AllocationRecorder`; the recorder and the layer count.

    See :func:`trace_training_step`; the recorder also gives the addresses of real allocations.
    ``on_start()`` is called once the optimizer state and the inputs exist, right before recording.
    """
    from hf_memo.profiler.allocations import AllocationRecorder
    from hf_memo.profiler.kernel_workspace import workspace_hook
    from hf_memo.profiler.phases import PhaseTracker, decoder_layers

    model.zero_grad(set_to_none=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = steady_optimizer(model, optimizer)
    layers = decoder_layers(model)
    input_ids = token_batch(model, batch_size, seq_len)
    tracker = PhaseTracker(layers)
    recorder = AllocationRecorder(tracker.phase, lambda: tracker.stage, workspace_hook(kernels))

    def stage(name: str) -> None:
        tracker.stage = name
        recorder.mark_stage(name)

    hooks = [p.register_post_accumulate_grad_hook(lambda p: recorder.label(p.grad, "gradient")) for p in params]
    if on_start is not None:
        on_start()
    try:
        with tracker, recorder:
            recorder.track(list(model.parameters()), "parameter")
            recorder.track(list(model.buffers()), "buffer")
            if opt is not None:
                recorder.track(list(opt.state.values()), "optimizer")
            recorder.track(input_ids, "activation")
            training_step(model, input_ids, opt, stage)
            if opt is not None:
                recorder.label(list(opt.state.values()), "optimizer")
    finally:
        for hook in hooks:
            hook.remove()
    return recorder, len(layers)


def trace_training_step(
    model: nn.Module,
    batch_size: int,
    seq_len: int,
    optimizer: str = "adamw",
    meta: dict[str, Any] | None = None,
    kernels: str | KernelTarget = "cuda",
) -> AllocationTrace:
    """Record every allocation of one training step of ``model`` on random ``(batch_size, seq_len)`` tokens.

    Call inside the model's fake session (or with a real model on its device). Gradients are
    released first; parameters, buffers, optimizer state and the ``input_ids`` (also the labels)
    come first as ``malloc`` events of phase ``"other"``; what is still alive at the end is listed
    in ``meta["live_at_end"]``; ``meta["stage_starts"]`` gives the index of the first event of each stage
    (``"forward"``, ``"backward"``, ``"optimizer"``, ``"other"``).

    Args:
        model: a Hugging Face causal LM (or a PEFT model wrapping one) in train mode.
        batch_size, seq_len: the ``(B, S)`` shape of the token batch.
        optimizer: ``"adamw"`` (fused AdamW over the trainable parameters) or ``"none"``
            (forward and backward only; gradients stay alive at the end).
        meta: stored in the trace's ``meta`` (with ``batch_size``, ``seq_len``, ``optimizer``, ``layers``).
        kernels: the device the profile is for (see :func:`~hf_memo.profiler.kernel_workspace.kernel_target`):
            ``"cuda"`` (an H100/H200 with flash-attn) adds, around each traced CPU attention op, the workspace
            the CUDA kernel it stands for allocates inside the call; ``"cpu"`` adds nothing (a real CPU run).
    """
    recorder, layers = record_training_step(model, batch_size, seq_len, optimizer, kernels=kernels)
    info = {"batch_size": batch_size, "seq_len": seq_len, "optimizer": optimizer, "layers": layers}
    return recorder.trace({**info, **(meta or {})})
