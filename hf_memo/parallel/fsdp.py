"""FSDP version 1 with flattened parameters (``use_orig_params=False``), refused before any step runs.

FSDP1 without ``use_orig_params`` replaces a wrapped module's parameters with one flat parameter held outside
the module: hf_memo's autograd functions, which take a module's parameters as inputs and return their
gradients, would find none and the gradients would be lost. FSDP2 (``fully_shard``) and FSDP1 with
``use_orig_params=True`` keep the parameters on their modules and train exactly.
"""

from __future__ import annotations

from torch import nn

MESSAGE = (
    "FSDP (version 1) with use_orig_params=False flattens the parameters into one parameter outside their "
    "modules, and hf_memo could not return their gradients. Use FullyShardedDataParallel(..., "
    "use_orig_params=True) (Accelerate: fsdp_use_orig_params: true), or FSDP2 (torch.distributed.fsdp.fully_shard)"
)


def flattens_parameters(model: nn.Module) -> bool:
    """Whether FSDP1 holds ``model``'s parameters flattened: ``model`` (or a module inside it) is such an FSDP1
    wrapper, or ``model`` has no parameters left at all (it is inside one)."""
    if next(model.parameters(), None) is None:
        return True
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(
        isinstance(module, FullyShardedDataParallel) and not module._use_orig_params for module in model.modules()
    )


def check_parameters_whole(model: nn.Module, where: str) -> None:
    """Raise ``ValueError`` (naming ``where`` it was found) when FSDP1 holds ``model``'s parameters flattened."""
    if flattens_parameters(model):
        raise ValueError(f"hf_memo found {where}: {MESSAGE}")
