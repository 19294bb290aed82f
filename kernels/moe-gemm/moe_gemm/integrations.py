"""Transformers integration: an ``ExpertsInterface`` function running MoE experts through gmm.

``register()`` makes ``model.set_experts_implementation(name)`` (or ``experts_implementation=name``
at load) route every ``@use_experts_implementation`` experts module (Mixtral, Qwen2-MoE,
Qwen3-MoE, ...) through ``experts_forward``. The router stays in torch.

The rows of each gmm (tokens x top-k) are padded to a power of two (at least ``MIN_ROWS``):
decode and continuous batching change the token count every step, and each row count is one
compilation. Padded rows belong to no expert, so gmm gives zeros for them; they are cut off.
"""

from __future__ import annotations

import torch

from .expert_parallel import expert_axis
from .expert_parallel_op import moe_ep_swiglu
from .routing import Routing, combine, gather_tokens, route
from .torch_ops import gmm

DEFAULT_NAME = "kernel_hub_moe_gemm"
MIN_ROWS = 8
"""Smallest row bucket: one sublane tile of f32."""
# What kernelize() checks before switching a model in a given mode (tested: fullgraph compile
# without graph breaks, and training gradients).
can_torch_compile = True
has_backward = True
module_problem = None  # every module the interface dispatches is served


def _grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    routing: Routing,
    weight_is_in_out: bool,
) -> torch.Tensor:
    """Per-expert ``x @ W.T + b`` for Transformers' [E, out, in] weights (or ``x @ W`` for
    [E, in, out] ones), rows sorted by expert; rows bucketed (see the module docstring)."""
    rows = x.shape[0]
    padded = max(MIN_ROWS, 1 << (rows - 1).bit_length()) if rows else 0
    x = torch.nn.functional.pad(x.to(weight.dtype), (0, 0, 0, padded - rows))
    out = gmm(x, weight, routing.group_sizes, transpose_rhs=not weight_is_in_out)[:rows]
    if bias is not None:
        out = out + bias[routing.expert_ids.clamp(max=weight.shape[0] - 1)]
    return out


def experts_forward(
    experts: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """``ExpertsInterface`` function: hidden_states [T, H], top_k_index / top_k_weights [T, k]
    -> [T, H]. Honours the experts' ``has_gate``, ``has_bias``, ``is_transposed`` and
    ``has_post_expert_norm`` flags set by ``use_experts_implementation``. Expert weights split
    over a mesh axis (torchax tensors holding sharded arrays) run expert-parallel (``moe_ep``)."""
    axis = expert_axis(experts.gate_up_proj) if hasattr(experts, "gate_up_proj") else None
    if axis is not None:
        return _expert_parallel(experts, hidden_states, top_k_index, top_k_weights, axis)
    top_k = top_k_index.shape[-1]
    transposed = getattr(experts, "is_transposed", False)
    has_bias = getattr(experts, "has_bias", False)
    routing = route(top_k_index, experts.num_experts)
    rows = gather_tokens(hidden_states, routing, top_k)

    if getattr(experts, "has_gate", True):
        bias = experts.gate_up_proj_bias if has_bias else None
        projected = _grouped_linear(rows, experts.gate_up_proj, bias, routing, transposed)
        activated = experts._apply_gate(projected)
    else:
        bias = experts.up_proj_bias if has_bias else None
        projected = _grouped_linear(rows, experts.up_proj, bias, routing, transposed)
        activated = experts.act_fn(projected)

    bias = experts.down_proj_bias if has_bias else None
    out = _grouped_linear(activated, experts.down_proj, bias, routing, transposed)
    if getattr(experts, "has_post_expert_norm", False):
        out = experts.post_expert_norm(out)
    return combine(out, routing, top_k_weights).to(hidden_states.dtype)


def _expert_parallel(experts, hidden_states, top_k_index, top_k_weights, axis: str):
    """Experts whose weights are split over mesh ``axis`` (torchax): ``moe_ep``, for the layout
    it implements (SwiGLU, [gate; up], [E, out, in], no bias or post-expert norm)."""
    from transformers.integrations.moe import _default_apply_gate

    unsupported = [
        what
        for what, bad in (
            ("no gate", not getattr(experts, "has_gate", True)),
            ("interleaved gate/up", not getattr(experts, "is_concatenated", True)),
            ("[E, in, out] weights", getattr(experts, "is_transposed", False)),
            ("biases", getattr(experts, "has_bias", False)),
            ("a post-expert norm", getattr(experts, "has_post_expert_norm", False)),
            ("a custom gate", type(experts)._apply_gate is not _default_apply_gate),
            (
                "an activation other than silu",
                getattr(experts.config, "hidden_act", None) != "silu",
            ),
        )
        if bad
    ]
    if unsupported:
        raise NotImplementedError(
            f"{type(experts).__name__}: expert weights split over mesh axis {axis!r} run through "
            f"moe_ep, which implements SwiGLU experts only; these have {', '.join(unsupported)}. "
            f"Replicate the expert weights to use the single-device path."
        )
    out = moe_ep_swiglu(
        hidden_states,
        top_k_index,
        top_k_weights.to(hidden_states.dtype),
        experts.gate_up_proj,
        experts.down_proj,
        axis,
    )
    return out.to(hidden_states.dtype)


def register(name: str = DEFAULT_NAME) -> str:
    """Register ``experts_forward`` with Transformers' ``ExpertsInterface`` under ``name``."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, experts_forward)
    return name
