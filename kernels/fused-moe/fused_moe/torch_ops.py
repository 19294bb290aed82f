"""The fused_experts and fused_moe torch ops, built with kernel-hub's bridge.

The forward is the fused kernel; the backward differentiates the XLA path (sorted rows and
``ragged_dot``) at the same inputs, recomputing its forward: gradients are exact, and training
steps that happen to run through a model kernelized for inference stay correct. Quantized weights
get no gradient (they are not trainable).
"""

from __future__ import annotations

import torch

from kernel_hub.kernel_api import jax_op, op_namespace, require

from . import api

_DIFFERENTIABLE = (
    "hidden_states", "top_k_weights", "w_gate_up", "w_down", "gate_up_bias", "down_bias",
)  # fmt: skip


def _experts_backward(inputs, outputs, cotangents, **static):
    """Gradients of the XLA implementation for every differentiable input: zeros for quantized
    weights, None for absent optional inputs."""
    import jax
    import jax.numpy as jnp

    static = {k: v for k, v in static.items() if k != "implementation"}
    frozen = ("w_gate_up", "w_down") if static.get("quantization") else ()
    names = [n for n in _DIFFERENTIABLE if inputs[n] is not None and n not in frozen]

    def forward(*values):
        a = {**inputs, **dict(zip(names, values, strict=True))}
        return api.fused_experts(
            a["hidden_states"], a["top_k_index"], a["top_k_weights"], a["w_gate_up"],
            a["w_down"], a["gate_up_bias"], a["down_bias"], a["gate_up_scale"], a["down_scale"],
            implementation="xla", **static,
        )  # fmt: skip

    _, pullback = jax.vjp(forward, *(inputs[n] for n in names))
    grads = dict(zip(names, pullback(cotangents[0]), strict=True))
    return tuple(
        None if inputs[n] is None else grads.get(n, jnp.zeros_like(inputs[n]))
        for n in _DIFFERENTIABLE
    )


@jax_op(
    op_namespace(__name__),
    api.fused_experts,
    differentiable=_DIFFERENTIABLE,
    jax_backward=_experts_backward,
)
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
