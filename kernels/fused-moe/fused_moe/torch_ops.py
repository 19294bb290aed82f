"""The fused_experts and fused_moe torch ops (forward only), built with kernel-hub's bridge."""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import jax_op, op_namespace, require

from . import api


@jax_op(op_namespace(__name__), api.fused_experts)
def fused_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    transposed: bool = False,
    interleaved: bool = False,
    quantization: str | None = None,
    implementation: str | None = None,
) -> torch.Tensor:
    """MoE experts of a routed batch -> [T, H]; see ``api.fused_experts``."""
    config = api.make_config(activation, alpha, limit, transposed, interleaved, quantization)
    api.check_inputs(
        hidden_states, top_k_index, top_k_weights, w_gate_up, w_down, gate_up_bias, down_bias,
        gate_up_scale, down_scale, config,
    )  # fmt: skip


@jax_op(op_namespace(__name__), api.fused_moe)
def fused_moe(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    routing_bias: torch.Tensor | None = None,
    top_k: int = 2,
    scoring: str = "softmax",
    renormalize: bool = True,
    groups: int | None = None,
    top_groups: int | None = None,
    routed_scale: float = 1.0,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    transposed: bool = False,
    interleaved: bool = False,
    quantization: str | None = None,
    implementation: str | None = None,
) -> torch.Tensor:
    """Router logits -> top-k -> experts, [T, H]; see ``api.fused_moe``."""
    require(
        router_logits.ndim == 2 and router_logits.shape[0] == hidden_states.shape[0],
        f"fused_moe: router_logits must be [tokens, experts], got {tuple(router_logits.shape)}",
    )
    config = api.make_config(activation, alpha, limit, transposed, interleaved, quantization)
    tokens, top = hidden_states.shape[0], min(top_k, router_logits.shape[1])
    ids = torch.empty((tokens, top), dtype=torch.int32, device="meta")
    api.check_inputs(
        hidden_states, ids, ids.to(torch.float32), w_gate_up, w_down, gate_up_bias, down_bias,
        gate_up_scale, down_scale, config,
    )  # fmt: skip
