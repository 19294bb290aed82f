"""Transformers integration: an ``ExpertsInterface`` function running MoE experts through gmm.

``register()`` makes ``model.set_experts_implementation(name)`` (or ``experts_implementation=name``
at load) route every ``@use_experts_implementation`` experts module (Mixtral, Qwen2-MoE,
Qwen3-MoE, ...) through ``experts_forward``. The router stays in torch.

The rows of each gmm (tokens x top-k) are padded to a power of two (at least ``MIN_ROWS``):
decode and continuous batching change the token count every step, and each row count is one
compilation. Padded rows belong to no expert, so gmm gives zeros for them; they are cut off.

Quantized experts (int8 per channel with ``*_scale`` [E, out], as ``kernel_hub.quantize_experts``
makes them; fp8 128 x 128 blocks with ``*_scale_inv``, Transformers' ``FP8Experts``) run through
``gmm_quantized``: the weights stay quantized, each block is dequantized in VMEM, and the
activations get their gradient through the same dequantized weight. Quantized weights are
frozen: ones that require a gradient, and formats ``gmm_quantized`` does not read (mxfp4, w8a8,
static fp8 activation scales, [E, in, out] layouts), are left alone with the reason.
"""

from __future__ import annotations

import functools

import torch

from kernel_hub.kernel_api import transformers_ep

from . import api, quantized
from .expert_parallel import expert_axis
from .expert_parallel_op import moe_ep_swiglu
from .routing import Routing, combine, gather_tokens, route

gmm = api.gmm.torch
gmm_quantized = api.gmm_quantized.torch

DEFAULT_NAME = "kernel_hub_moe_gemm"
MIN_ROWS = 8
"""Smallest row bucket: one sublane tile of f32."""
# What kernelize() checks before switching a model in a given mode (tested: fullgraph compile
# without graph breaks, and training gradients).
can_torch_compile = True
has_backward = True
FP8_BLOCK = (128, 128)
_SCALE_NAMES = {torch.int8: "_scale", torch.float8_e4m3fn: "_scale_inv"}
"""Quantized weight dtype -> the suffix of its scale's attribute name."""


def _projections(experts: torch.nn.Module) -> tuple[str, ...]:
    gated = getattr(experts, "has_gate", True)
    return ("gate_up_proj" if gated else "up_proj", "down_proj")


def _scale(experts: torch.nn.Module, projection: str) -> torch.Tensor | None:
    """The scale of a quantized projection, None for a float one."""
    suffix = _SCALE_NAMES.get(getattr(experts, projection).dtype)
    return getattr(experts, projection + suffix, None) if suffix else None


def _quantized_problem(experts: torch.nn.Module, projection: str) -> str | None:
    weight = getattr(experts, projection)
    if weight.is_floating_point() and weight.element_size() > 1:
        return None
    if weight.dtype not in _SCALE_NAMES:
        return (
            f"its {projection} is {weight.dtype} (e.g. mxfp4 bytes); gmm_quantized reads int8 "
            "per-channel and fp8 128x128-block weights"
        )
    if getattr(experts, "kernel_hub_w8a8", False):
        return "it is w8a8 (int8 activations too); gmm_quantized runs int8 weights only (W8A16)"
    if getattr(experts, "is_transposed", False):
        return "quantized [E, in, out] expert weights are not supported"
    scale = _scale(experts, projection)
    suffix = _SCALE_NAMES[weight.dtype]
    if scale is None or scale.dtype != torch.float32:
        return f"its {weight.dtype} {projection} carries no float32 {projection}{suffix}"
    if weight.dtype == torch.float8_e4m3fn:
        block = getattr(experts, "block_size", None)
        if block is None or tuple(block) != FP8_BLOCK:
            return f"fp8 weights with block_size {block}; gmm_quantized reads 128x128 blocks"
        if getattr(experts, "activation_scheme", "dynamic") != "dynamic":
            return "fp8 with static activation scales (W8A8); gmm_quantized runs W8A16"
    try:
        quantized.check_inputs(
            torch.empty(0, weight.shape[2]),
            weight,
            scale,
            torch.zeros(weight.shape[0], dtype=torch.int32),
            True,
        )
    except ValueError as exc:
        return str(exc)
    frozen = [t for t in (weight, scale) if t.requires_grad]
    if frozen:
        return (
            f"its quantized {projection} (or its scale) requires a gradient; quantized weights "
            "are frozen (gmm_quantized differentiates the activations only)"
        )
    return None


def _split_over_experts(weight: torch.Tensor) -> bool:
    """A DTensor split along its expert dimension."""
    placements = getattr(weight, "placements", ())
    return type(weight).__name__ == "DTensor" and any(
        p.is_shard(0) for p in placements if hasattr(p, "is_shard")
    )


def module_problem(experts: torch.nn.Module) -> str | None:
    """Why ``experts_forward`` cannot run ``experts`` exactly (expert-split DTensors without an
    expert-parallel dispatch, quantized formats, frozen weights), or None."""
    if not hasattr(experts, "down_proj"):
        return None
    weights = [getattr(experts, p) for p in _projections(experts)]
    if any(map(_split_over_experts, weights)) and not transformers_ep.dispatches(experts):
        return (
            "its expert weights are DTensors split over experts without an expert-parallel "
            "dispatch around the experts (Transformers' DistributedConfig(ep_size=...) plan sends "
            "each token to the rank owning its expert); gmm would see global expert ids against "
            "local weights"
        )
    unsplit = transformers_ep.unsplit(experts) if transformers_ep.dispatches(experts) else []
    if unsplit:
        return (
            "Transformers' expert-parallel plan splits its experts but leaves "
            f"{', '.join(unsplit)} whole, so they would not match this rank's local experts"
        )
    return next(
        (
            p
            for p in map(functools.partial(_quantized_problem, experts), _projections(experts))
            if p
        ),
        None,
    )


def _grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    routing: Routing,
    weight_is_in_out: bool,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-expert ``x @ W.T + b`` for Transformers' [E, out, in] weights (or ``x @ W`` for
    [E, in, out] ones), rows sorted by expert; rows bucketed (see the module docstring). A
    ``scale`` means ``weight`` is quantized: ``gmm_quantized`` in the activations' dtype."""
    rows = x.shape[0]
    padded = max(MIN_ROWS, 1 << (rows - 1).bit_length()) if rows else 0
    if scale is None:
        x = torch.nn.functional.pad(x.to(weight.dtype), (0, 0, 0, padded - rows))
        out = gmm(x, weight, routing.group_sizes, transpose_rhs=not weight_is_in_out)[:rows]
    else:
        x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
        out = gmm_quantized(x, weight, scale, routing.group_sizes)[:rows]
    if bias is not None:  # a sentinel row (id >= E, after route) takes the zero row
        with_none = torch.cat([bias, bias.new_zeros(1, bias.shape[-1])])
        out = out + with_none[routing.expert_ids.clamp(max=weight.shape[0])]
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
    problem = module_problem(experts)
    if problem:
        raise NotImplementedError(f"{type(experts).__name__}: moe-gemm cannot run it: {problem}")
    top_k = top_k_index.shape[-1]
    transposed = getattr(experts, "is_transposed", False)
    has_bias = getattr(experts, "has_bias", False)
    routing = route(top_k_index, experts.num_experts)
    rows = gather_tokens(hidden_states, routing, top_k)
    first, down = _projections(experts)
    bias = getattr(experts, first + "_bias") if has_bias else None
    weight, scale = getattr(experts, first), _scale(experts, first)
    projected = _grouped_linear(rows, weight, bias, routing, transposed, scale)
    if getattr(experts, "has_gate", True):
        activated = experts._apply_gate(projected)
    else:
        activated = experts.act_fn(projected)

    bias = experts.down_proj_bias if has_bias else None
    weight, scale = experts.down_proj, _scale(experts, down)
    out = _grouped_linear(activated, weight, bias, routing, transposed, scale)
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
            ("quantized weights", experts.gate_up_proj.element_size() == 1),
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
    """Register ``experts_forward`` with Transformers' ``ExpertsInterface`` (and its FP8 experts
    interface, which fp8 checkpoints' ``FP8Experts`` dispatch through) under ``name``."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # a Transformers without FP8 experts: nothing else to register with
        return name
    FP8ExpertsInterface.register(name, experts_forward)
    return name
