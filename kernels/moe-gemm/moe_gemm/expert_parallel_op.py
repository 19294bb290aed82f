"""The expert-parallel MoE block as a torch op, for Transformers experts whose weights are sharded
over a mesh axis (torchax tensors holding sharded JAX arrays): SwiGLU experts in Transformers'
[E, out, in] layout, run by ``expert_parallel.moe_ep``."""

from __future__ import annotations

import jax
import torch

from kernel_hub.kernel_api import jax_op, op_namespace, require

from . import expert_parallel


def _swiglu_experts(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *, axis, transport
):
    """The result laid out like ``hidden_states`` (the torch model reshapes it next; on an
    Explicit mesh a reshape of a token-split array needs its output sharding spelled out)."""
    out = expert_parallel.moe_ep(
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up_proj,
        down_proj,
        activation=expert_parallel.swiglu,
        axis=axis,
        transpose_rhs=True,
        transport=transport,
    )
    return jax.sharding.reshard(out, jax.typeof(hidden_states).sharding)


@jax_op(
    op_namespace(__name__),
    _swiglu_experts,
    differentiable=("hidden_states", "top_k_weights", "gate_up_proj", "down_proj"),
)
def moe_ep_swiglu(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    axis: str = "ep",
    transport: str | None = None,
) -> torch.Tensor:
    """sum_k w[t, k] * down[e] @ (silu(gate[e] x) * up[e] x) with experts split over ``axis``:
    hidden_states [T, H], top_k_index / top_k_weights [T, k], gate_up_proj [E, 2I, H] ([gate; up]),
    down_proj [E, H, I]."""
    require(
        hidden_states.ndim == 2,
        f"moe_ep_swiglu: hidden_states must be [tokens, hidden], got {tuple(hidden_states.shape)}",
    )
    hidden = hidden_states.shape[1]
    require(
        gate_up_proj.ndim == 3
        and tuple(down_proj.shape) == (gate_up_proj.shape[0], hidden, gate_up_proj.shape[1] // 2)
        and gate_up_proj.shape[2] == hidden,
        f"moe_ep_swiglu: gate_up_proj {tuple(gate_up_proj.shape)} and down_proj "
        f"{tuple(down_proj.shape)} must be [E, 2I, {hidden}] and [E, {hidden}, I]",
    )
