"""Public JAX API: ``fused_experts`` (experts of a routed batch) and ``fused_moe`` (router
logits -> top-k -> experts), with one implementation table: "pallas" (the fused kernel) and
"xla" (sorted copies + ``ragged_dot``).

The fused kernel serves decode steps (up to ``MAX_TOKENS`` tokens, held whole in VMEM); longer
calls (prefill) take the XLA path, which is compute-bound there anyway. Forward only: training
keeps Transformers' experts on the moe-gemm kernel (``gmm``/``tgmm`` with
their VJP), where the backward's weight gradients need the per-expert row groups anyway; the
fused kernel exists to read each weight once per decode step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernel_hub.kernel_api import (
    Einsum,
    check_dtype,
    check_int32_values,
    check_rank,
    dtype_name,
    jax_default_device,
    jax_platform,
    op,
    pallas_and_xla,
    require,
    tpu_generation,
)

from . import pallas_tpu, quant, reference
from .activations import KINDS, Activation
from .blocks import MAX_TOKENS, Blocks, blocks_problem, default_blocks, vmem_capacity
from .config import ExpertsConfig
from .routing import Router, route

FLOAT_DTYPES = ("float32", "bfloat16", "float64")
NO_INT8_MATMUL = ("v4",)
"""Generations whose Mosaic rejects int8 x int8 matmuls (checked by deviceless compiles)."""
INT_DTYPES = ("int32", "int64")


def make_config(
    activation: str,
    alpha: float,
    limit: float,
    transposed: bool,
    interleaved: bool,
    quantization: str | None,
) -> ExpertsConfig:
    op = "fused_experts"
    require(activation in KINDS, f"{op}: activation must be one of {KINDS}, got {activation!r}")
    require(
        quantization is None or quantization in quant.KINDS,
        f"{op}: quantization must be None or one of {quant.KINDS}, got {quantization!r}",
    )
    require(
        quantization is None or not transposed,
        f"{op}: quantized weights use Transformers' [E, out, in] layout; transposed=True is not "
        "supported with quantization",
    )
    return ExpertsConfig(
        Activation(activation, alpha, limit), transposed, interleaved, quantization
    )


def check_inputs(
    x, top_k_index, top_k_weights, w_gate_up, w_down, gate_up_bias, down_bias, gate_up_scale,
    down_scale, config: ExpertsConfig,
) -> None:  # fmt: skip
    """Shape and dtype rules, shared by the JAX functions and the torch op."""
    op = "fused_experts"
    check_rank(op, "hidden_states", x, 2)
    check_dtype(op, "hidden_states", x, FLOAT_DTYPES)
    check_rank(op, "top_k_index", top_k_index, 2)
    check_dtype(op, "top_k_index", top_k_index, INT_DTYPES)
    check_rank(op, "top_k_weights", top_k_weights, 2)
    check_dtype(op, "top_k_weights", top_k_weights, FLOAT_DTYPES)
    tokens, hidden = x.shape
    require(
        tuple(top_k_index.shape) == tuple(top_k_weights.shape) and top_k_index.shape[0] == tokens,
        f"{op}: top_k_index {tuple(top_k_index.shape)} and top_k_weights "
        f"{tuple(top_k_weights.shape)} must both be [{tokens}, k] (tokens of hidden_states)",
    )
    check_rank(op, "w_gate_up", w_gate_up, 3)
    check_rank(op, "w_down", w_down, 3)
    weight_dtype = dtype_name(x.dtype)
    if config.quantization is not None:
        weight_dtype = jnp.dtype(quant.WEIGHT_DTYPES[config.quantization]).name
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        check_dtype(op, name, w, (weight_dtype,))
    experts = w_gate_up.shape[0]
    inter = config.intermediate(w_gate_up.shape)
    layout = "[E, H, 2I]" if config.transposed else "[E, 2I, H]"
    require(
        config.hidden(w_gate_up.shape) == hidden
        and w_gate_up.shape[2 if config.transposed else 1] == 2 * inter,
        f"{op}: w_gate_up {tuple(w_gate_up.shape)} read as {layout} must have H={hidden} "
        "(hidden_states) and an even gate/up dimension"
        + (" (mxfp4: H / 2 bytes per row)" if config.packing > 1 else ""),
    )
    down = (
        (experts, inter, hidden)
        if config.transposed
        else (experts, hidden, inter // config.packing)
    )
    require(
        tuple(w_down.shape) == down,
        f"{op}: w_down {tuple(w_down.shape)} must be {down} for w_gate_up "
        f"{tuple(w_gate_up.shape)} (transposed={config.transposed})",
    )
    for name, bias, shape in (
        ("gate_up_bias", gate_up_bias, (experts, 2 * inter)),
        ("down_bias", down_bias, (experts, hidden)),
    ):
        if bias is not None:
            require(
                tuple(bias.shape) == shape,
                f"{op}: {name} {tuple(bias.shape)} must be {shape}",
            )
    scales = (("gate_up_scale", gate_up_scale, w_gate_up), ("down_scale", down_scale, w_down))
    if config.quantization is None:
        given = [name for name, scale, _ in scales if scale is not None]
        require(not given, f"{op}: {given} given without quantization")
        return
    for name, scale, w in scales:
        shape = quant.scale_shape(config.quantization, tuple(w.shape))
        if config.quantization == "mxfp4" and scale is not None and scale.ndim == 3:
            # or its groups lane-padded (``padding``): trailing groups no byte reads
            padded = -(-shape[2] // 128) * 128
            shape = (*shape[:2], padded if scale.shape[2] == padded else shape[2])
        require(
            scale is not None and tuple(scale.shape) == shape,
            f"{op}: quantization={config.quantization!r} needs {name} of shape {shape} for "
            f"weight {tuple(w.shape)}, got {None if scale is None else tuple(scale.shape)}",
        )
        check_dtype(op, name, scale, (jnp.dtype(quant.SCALE_DTYPES[config.quantization]).name,))
    if config.quantization == "mxfp4":
        require(
            hidden % quant.MX_GROUP == 0 and inter % quant.MX_GROUP == 0,
            f"{op}: mxfp4 weights need H ({hidden}) and I ({inter}) to be multiples of "
            f"{quant.MX_GROUP} (whole scale groups)",
        )
    if config.quantization == "w8a8":
        require(
            hidden % quant.ACT_GROUP == 0 and inter % quant.ACT_GROUP == 0,
            f"{op}: w8a8 quantizes activations per {quant.ACT_GROUP} columns: H ({hidden}) and "
            f"I ({inter}) must be multiples of {quant.ACT_GROUP}",
        )
    if config.quantization == "fp8":
        require(
            hidden % quant.FP8_BLOCK == 0 and inter % quant.FP8_BLOCK == 0,
            f"{op}: fp8 weights need H ({hidden}) and I ({inter}) to be multiples of "
            f"{quant.FP8_BLOCK} (whole scale blocks)",
        )


def _check_id_values(top_k_index, w_gate_up) -> None:
    """``fused_experts``' ids, on every call where they can be read (``host_values``): none wider
    than int32, and no expert twice for one token (the kernel gives an expert at most one row
    per token; XLA would sum both)."""
    op, experts = "fused_experts", w_gate_up.shape[0]
    ids = check_int32_values(op, "top_k_index", top_k_index)
    if ids is None or ids.size == 0:
        return
    routed = np.where((ids >= 0) & (ids < experts), ids, -1 - np.arange(ids.shape[1]))
    ordered = np.sort(routed, axis=1)
    twice = np.argwhere(ordered[:, 1:] == ordered[:, :-1])
    if len(twice):
        token, slot = twice[0]
        require(
            False,
            f"{op}: token {token} routes to expert {ordered[token, slot]} twice in top_k_index; "
            f"a token's expert ids must be distinct (ids outside [0, {experts}) may repeat: "
            "they contribute nothing)",
        )


def _interpret() -> bool:
    return jax_platform() == "cpu"


def _vmem_capacity() -> int:
    generation = None if _interpret() else tpu_generation(jax_default_device())
    return vmem_capacity(generation)


def _default_blocks(x, idx, w1, config: ExpertsConfig) -> Blocks | None:
    """Blocks for one kernel call within 85% of the chip's VMEM."""
    return default_blocks(
        idx.shape[0],
        idx.shape[1],
        w1.shape[0],
        config.intermediate(w1.shape),
        x.shape[1],
        x.dtype,
        config,
        jnp.dtype(w1.dtype).itemsize,
        int(0.85 * _vmem_capacity()),
    )


def _pallas(x, idx, w, w1, w2, b1, b2, s1, s2, *, config, out_dtype, blocks):
    blocks = blocks or _default_blocks(x, idx, w1, config)
    if config.quantization is not None:
        s1 = quant.kernel_scale(s1, config.quantization)
        s2 = quant.kernel_scale(s2, config.quantization)

    return pallas_tpu.fused_experts(
        x, idx, w, w1, w2, b1, b2, s1, s2,
        config=config, out_dtype=out_dtype, blocks=blocks, interpret=_interpret(),
        vmem_capacity=_vmem_capacity(),
    )  # fmt: skip


def _xla(x, idx, w, w1, w2, b1, b2, s1, s2, *, config, out_dtype, blocks):
    return reference.fused_experts(
        x, idx, w, w1, w2, b1, b2, s1, s2, config=config, out_dtype=out_dtype
    )


def _pallas_problem(x, idx, w, w1, w2, b1, b2, s1, s2, *, config, out_dtype, blocks):
    if jnp.dtype(x.dtype).name == "float64" and not _interpret():
        return "float64 runs only in interpret mode (CPU)"
    if config.quantization == "w8a8" and not _interpret():
        generation = tpu_generation(jax_default_device())
        if generation in NO_INT8_MATMUL:
            return f"TPU {generation}'s MXU has no int8 matmul (w8a8); the XLA path runs it"
    if idx.shape[0] > MAX_TOKENS:
        return (
            f"{idx.shape[0]} tokens: the fused kernel holds at most {MAX_TOKENS} (a decode "
            "step) in VMEM; prefill runs the sorted ragged_dot path"
        )
    inter = config.intermediate(w1.shape)
    if blocks is not None:
        return blocks_problem(blocks, inter, x.dtype, config)
    if _default_blocks(x, idx, w1, config) is None:
        return f"no intermediate block size fits the TPU block rules for I={inter}"
    return None


TABLE = pallas_and_xla("fused_experts", _pallas, _xla, _pallas_problem)


def _check_experts(
    hidden_states, top_k_index, top_k_weights, w_gate_up, w_down, gate_up_bias, down_bias,
    gate_up_scale, down_scale, activation, alpha, limit, transposed, interleaved, quantization,
) -> None:  # fmt: skip
    """``fused_experts``' options and inputs, by the op's parameter names."""
    config = make_config(activation, alpha, limit, transposed, interleaved, quantization)
    check_inputs(
        hidden_states, top_k_index, top_k_weights, w_gate_up, w_down, gate_up_bias, down_bias,
        gate_up_scale, down_scale, config,
    )  # fmt: skip


def _check_moe(
    hidden_states, router_logits, w_gate_up, w_down, gate_up_bias, down_bias, gate_up_scale,
    down_scale, routing_bias, top_k, scoring, renormalize, groups, top_groups, routed_scale,
    activation, alpha, limit, transposed, interleaved, quantization,
) -> None:  # fmt: skip
    """``fused_moe``'s routing and, for the top-k ids it will route to, ``fused_experts``'
    checks."""
    check_rank("fused_moe", "router_logits", router_logits, 2)
    check_dtype("fused_moe", "router_logits", router_logits, FLOAT_DTYPES)
    check_rank("fused_experts", "w_gate_up", w_gate_up, 3)
    experts = w_gate_up.shape[0]
    require(
        tuple(router_logits.shape) == (hidden_states.shape[0], experts),
        f"fused_moe: router_logits {tuple(router_logits.shape)} must be "
        f"[{hidden_states.shape[0]}, {experts}] (tokens, experts)",
    )
    require(
        routing_bias is None or tuple(routing_bias.shape) == (experts,),
        f"fused_moe: routing_bias must be [{experts}], got "
        f"{None if routing_bias is None else tuple(routing_bias.shape)}",
    )
    router = Router(top_k, scoring, renormalize, groups, top_groups, routed_scale)
    problem = router.problem(experts)
    require(problem is None, f"fused_moe: {problem}")
    ids = jax.ShapeDtypeStruct((hidden_states.shape[0], min(top_k, experts)), jnp.int32)
    _check_experts(
        hidden_states, ids, jax.ShapeDtypeStruct(ids.shape, jnp.float32), w_gate_up, w_down,
        gate_up_bias, down_bias, gate_up_scale, down_scale, activation, alpha, limit, transposed,
        interleaved, quantization,
    )  # fmt: skip


# Sharding: tokens split freely (each token's experts are its own). ``fused_experts`` splits the
# experts too (expert parallelism for decode, a ``combined`` factor): each shard runs its own
# experts on every token it holds and one psum adds the shards' f32 partial sums. ``fused_moe``
# keeps them whole: its top-k reads every expert's logit (the moe-gemm kernel's ``moe_ep`` is the
# prefill form). Splitting the intermediate dimension would need the gate and up halves split
# alike, which the stacked [gate; up] layout does not allow.
_EP = "expert parallelism: fused_experts after the routing, or the moe-gemm kernel's moe_ep"
_WEIGHT_FACTORS = ("k", "experts", "gu", "h", "i", "gu_s", "h_s", "i_s", "h_p", "i_p", "h_g",
                   "i_g", "o", "p")  # fmt: skip


def _weights(transposed: bool, quantization: str | None) -> str:
    w = "experts h gu, experts i h" if transposed else "experts gu h, experts h i"
    if quantization == "mxfp4":  # two values per byte along the contraction
        w = "experts gu h_p, experts h i_p"
    bias = "experts gu, experts h"
    scales = {
        "int8": "experts gu, experts h",
        "w8a8": "experts gu, experts h",
        "fp8": "experts gu_s h_s, experts h_s i_s",
        "mxfp4": "experts gu h_g, experts h i_g",
    }.get(quantization, "experts o, experts p")  # None: absent operands (checked by the op)
    return f"{w}, {bias}, {scales}"


def _einsum(text: str, split_experts: bool = False) -> Einsum:
    factors = {f for side in text.replace("->", ",").split(",") for f in side.split()}
    whole = [f for f in _WEIGHT_FACTORS if f in factors and not (split_experts and f == "experts")]
    if split_experts:
        return Einsum(text, whole=whole, combined=("experts",))
    return Einsum(text, whole=whole, handled_by={"experts": _EP})


def _experts_rule(transposed: bool = False, quantization: str | None = None, **options) -> Einsum:
    weights = _weights(transposed, quantization)
    return _einsum(f"tokens h, tokens k, tokens k, {weights} -> tokens h", split_experts=True)


def _moe_rule(transposed: bool = False, quantization: str | None = None, **options) -> Einsum:
    weights = _weights(transposed, quantization)
    return _einsum(f"tokens h, tokens experts, {weights}, experts -> tokens h")


# The torch op's backward differentiates the XLA path (sorted rows and ``ragged_dot``) at the
# same inputs, recomputing its forward: gradients are exact, and training steps that happen to
# run through a model kernelized for inference stay correct. Quantized weights get no gradient
# (they are not trainable).
_DIFFERENTIABLE = (
    "hidden_states", "top_k_weights", "w_gate_up", "w_down", "gate_up_bias", "down_bias",
)  # fmt: skip


def _experts_backward(inputs, outputs, cotangents, **static):
    """Gradients of the XLA implementation for every differentiable input: zeros for quantized
    weights, None for absent optional inputs."""
    static = {k: v for k, v in static.items() if k != "implementation"}
    frozen = ("w_gate_up", "w_down") if static.get("quantization") else ()
    names = [n for n in _DIFFERENTIABLE if inputs[n] is not None and n not in frozen]

    def forward(*values):
        a = {**inputs, **dict(zip(names, values, strict=True))}
        return fused_experts(
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


@op(
    check=_check_experts,
    check_values=_check_id_values,
    differentiable=_DIFFERENTIABLE,
    sharding=_experts_rule,
    jax_only=("blocks", "split_axes"),
    jax_backward=_experts_backward,
)
def fused_experts(
    hidden_states: jax.Array,
    top_k_index: jax.Array,
    top_k_weights: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    gate_up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    gate_up_scale: jax.Array | None = None,
    down_scale: jax.Array | None = None,
    *,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    transposed: bool = False,
    interleaved: bool = False,
    quantization: str | None = None,
    implementation: str | None = None,
    blocks: Blocks | None = None,
    split_axes: dict[str, tuple[str, ...]] | None = None,
) -> jax.Array:
    """Mixture-of-experts experts for a routed batch -> [T, H] in the dtype of hidden_states.

    ``hidden_states`` [T, H]; ``top_k_index`` / ``top_k_weights`` [T, k] (ids outside [0, E)
    contribute nothing; a token's ids must be distinct); ``w_gate_up`` [E, 2I, H] and ``w_down``
    [E, H, I] (``transposed``: [E, H, 2I] / [E, I, H]), gate and up ``interleaved`` or stacked
    [gate; up]; optional biases [E, 2I] / [E, H]; ``quantization`` "int8" / "fp8" / "mxfp4" /
    "w8a8" with weights and scales in ``quant``'s layouts. ``activation``: silu, gelu, gelu_tanh or
    gpt_oss (``alpha``, ``limit``). Forward only (see the module docstring).

    ``split_axes`` (set by the sharding boundary): inside a shard_map whose mesh splits the
    experts over ``split_axes["experts"]``, the weights, biases and scales are this shard's
    experts (expert parallelism; see ``local_experts_sum``).
    """
    config = make_config(activation, alpha, limit, transposed, interleaved, quantization)
    args = (hidden_states, top_k_index, top_k_weights, w_gate_up, w_down, gate_up_bias,
            down_bias, gate_up_scale, down_scale)  # fmt: skip
    tokens, hidden = hidden_states.shape
    if tokens == 0 or top_k_index.shape[1] == 0:
        return jnp.zeros((tokens, hidden), hidden_states.dtype)
    experts_axes = (split_axes or {}).get("experts", ())
    if experts_axes:
        return local_experts_sum(
            *args, axes=experts_axes, config=config, blocks=blocks, implementation=implementation
        )
    return TABLE(
        *args,
        config=config,
        out_dtype=hidden_states.dtype,
        blocks=blocks,
        implementation=implementation,
    )


def local_experts_sum(
    hidden_states: jax.Array,
    top_k_index: jax.Array,
    *arrays: jax.Array | None,
    axes: str | tuple[str, ...],
    config: ExpertsConfig,
    **options,
) -> jax.Array:
    """Expert parallelism inside a shard_map over ``axes``: this shard holds experts
    [first, first + E_local) (global ids shifted by ``first``; ids outside the shard's range
    contribute nothing, which the kernel guarantees), runs them on every token it holds into an f32
    partial sum, and one ``psum`` over ``axes`` adds the shards' sums."""
    first = jax.lax.axis_index(axes) * arrays[1].shape[0]  # arrays: weights, w_gate_up, ...
    partial = TABLE(
        hidden_states, top_k_index - first, *arrays, config=config, out_dtype=jnp.float32,
        **options,
    )  # fmt: skip
    return jax.lax.psum(partial, axes).astype(hidden_states.dtype)


@op(check=_check_moe, sharding=_moe_rule, jax_only=("blocks",))
def fused_moe(
    hidden_states: jax.Array,
    router_logits: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    gate_up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    gate_up_scale: jax.Array | None = None,
    down_scale: jax.Array | None = None,
    routing_bias: jax.Array | None = None,
    *,
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
    blocks: Blocks | None = None,
) -> jax.Array:
    """The routed experts of an MoE layer from ``router_logits`` [T, E]: top-k routing
    (``routing.Router``: softmax or sigmoid, ``renormalize``, grouped top-k, ``routing_bias``
    [E] that only chooses, ``routed_scale``), then ``fused_experts``. Shared experts are the
    caller's."""
    router = Router(top_k, scoring, renormalize, groups, top_groups, routed_scale)
    weights, ids = route(router_logits, router, routing_bias)
    return fused_experts.__wrapped__(
        hidden_states, ids, weights, w_gate_up, w_down, gate_up_bias, down_bias,
        gate_up_scale, down_scale,
        activation=activation, alpha=alpha, limit=limit, transposed=transposed,
        interleaved=interleaved, quantization=quantization, implementation=implementation,
        blocks=blocks,
    )  # fmt: skip
