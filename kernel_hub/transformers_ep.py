"""What a Transformers experts module under the expert-parallel plan looks like to a kernel's
integration: whether the plan dispatches its tokens, and which parameters it left whole.

Shared by the integrations of the expert kernels (fused-moe, moe-gemm), which cannot import
each other; read from module attributes only, so this imports neither torch nor Transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def dispatches(module: torch.nn.Module) -> bool:
    """Whether Transformers' expert-parallel plan dispatches the module's tokens: its forward is
    the plan's ``ep_forward``, which hands the experts function this rank's experts as local
    tensors and local expert ids (off-rank pairs as ids >= ``num_experts``, which contribute
    nothing), and combines the ranks' results itself (all-reduce or all-to-all)."""
    forward = module.__dict__.get("forward")
    return getattr(forward, "__qualname__", "").startswith("EpDispatchExpertsParallel.")


def unsplit(module: torch.nn.Module) -> list[str]:
    """Parameters the expert-parallel plan left whole (e.g. quantization scales, biases): its
    forward hands the experts function local shards of the split ones next to these whole ones,
    which no longer line up with this rank's experts. Inside that forward every parameter is a
    local tensor: nothing to tell then (kernelize checked before)."""
    parameters = dict(module.named_parameters(recurse=False))
    if not any(type(p).__name__ == "DTensor" for p in parameters.values()):
        return []
    return [
        name
        for name, parameter in parameters.items()
        if type(parameter).__name__ != "DTensor"
        or not any(p.is_shard(0) for p in parameter.placements)
    ]
