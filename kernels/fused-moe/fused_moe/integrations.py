"""Transformers integration: an ``ExpertsInterface`` function running MoE experts through the
fused kernel, for inference.

``register()`` adds ``experts_forward`` to Transformers' ``ExpertsInterface`` and to its FP8
experts interface, so ``set_experts_implementation(name)`` routes every
``@use_experts_implementation`` experts module (Mixtral, Qwen3-MoE, GPT-OSS, DeepSeek-V3, and
``FP8Experts`` of fp8-quantized checkpoints) here. The router stays Transformers' own; shared
experts stay outside.

What a module computes is read from it, never assumed: its layout flags, and its ``_apply_gate``
run on a probe and compared with each gated activation the kernel has (``module_problem`` says
why a module is left alone). Under Transformers' expert-parallel plan (``DistributedConfig(
ep_size=...)``) the kernel runs each rank's local experts inside the plan's token dispatch and
combine; other expert weights split over devices (DTensor, or torchax tensors holding sharded
arrays) are left to moe-gemm's expert parallelism or refused with the reason. Token counts
are padded to a power of two (at least ``MIN_TOKENS``) with rows that route nowhere, so
continuous batching's changing batch sizes compile once per bucket.
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass

import torch

from kernel_hub.kernel_api import KernelInputError, transformers_ep

from . import api, padding, quantized

log = logging.getLogger(__name__)
fused_experts = api.fused_experts.torch

DEFAULT_NAME = "kernel_hub_fused_moe"
MIN_TOKENS = 8
can_torch_compile = True
"""Checked: fullgraph aot_eager compiles of kernelized Mixtral and MXFP4 GPT-OSS, no graph break."""
has_backward = True
"""The backward differentiates the XLA path (see ``api.fused_experts``); kernelize in training
mode still picks moe-gemm, whose gmm/tgmm backward kernels are the training path."""

_PROBE_ROWS = 4


def _torch_forms(module: torch.nn.Module) -> dict[str, callable]:
    """The kernel's gated activations in torch, f32, on [rows, 2I] gate/up columns laid out as
    the module lays them out."""
    interleaved = not getattr(module, "is_concatenated", True)
    alpha = getattr(module, "alpha", None) or getattr(module, "swiglu_alpha", None)
    limit = getattr(module, "limit", None) or getattr(module, "swiglu_limit", None)

    def split(h):
        return (h[..., 0::2], h[..., 1::2]) if interleaved else h.chunk(2, dim=-1)

    def gated(act):
        return lambda h: act(split(h)[0]) * split(h)[1]

    def gpt_oss(h):
        gate, up = split(h)
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    forms = {
        "silu": gated(torch.nn.functional.silu),
        "gelu": gated(torch.nn.functional.gelu),
        "gelu_tanh": gated(functools.partial(torch.nn.functional.gelu, approximate="tanh")),
    }
    if alpha is not None and limit is not None:
        forms["gpt_oss"] = gpt_oss
    return forms


def activation_of(module: torch.nn.Module) -> tuple[str | None, str]:
    """(kernel activation kind, "") or (None, why none matches) for the module's gate."""
    if not getattr(module, "has_gate", True):
        return None, "it has no gate (up_proj only); the fused kernel implements gated experts"
    gate_fn = getattr(module, "_apply_gate", None)
    if gate_fn is None:
        return None, "it has no _apply_gate"
    weight = module.gate_up_proj
    width = weight.shape[2] if getattr(module, "is_transposed", False) else weight.shape[1]
    probe = torch.randn(_PROBE_ROWS, width, generator=torch.Generator().manual_seed(0)) * 4
    with torch.no_grad():
        try:
            out = gate_fn(probe)
        except Exception as exc:  # a gate the probe cannot run is not one the kernel knows
            return None, f"its _apply_gate failed on a probe ({type(exc).__name__}: {exc})"
        for kind, form in _torch_forms(module).items():
            expected = form(probe)
            if out.shape == expected.shape and torch.allclose(out, expected, rtol=1e-6, atol=1e-6):
                return kind, ""
    return None, f"its _apply_gate ({type(module).__name__}) matches none of the kernel's forms"


def _sharded(weight: torch.Tensor) -> bool:
    """Whether the weight is split over devices (DTensor, or a torchax tensor of a sharded
    array)."""
    if type(weight).__name__ == "DTensor" or getattr(weight, "_is_expert_parallel", False):
        return True
    to_array = getattr(weight, "jax", None)
    if not callable(to_array):
        return False
    import jax

    spec = getattr(jax.typeof(to_array()).sharding, "spec", ())
    return any(axis is not None for axis in spec)


def module_problem(module: torch.nn.Module) -> str | None:
    """Why the fused kernel cannot run ``module`` exactly, or None (then its weights are padded
    for the TPU layout once, here: kernelize runs this)."""
    problem = _problem(module)
    if problem is None:
        padding.prepare(module)
    return problem


def _problem(module: torch.nn.Module) -> str | None:
    """``module_problem``'s checks, leaving the weights as they are."""
    weights = [getattr(module, p) for p in ("gate_up_proj", "down_proj") if hasattr(module, p)]
    split = getattr(module, "_is_expert_parallel", False) or any(map(_sharded, weights))
    if split and not transformers_ep.dispatches(module):
        if any(type(w).__name__ == "DTensor" for w in weights):
            return (
                "its expert weights are DTensors split over devices without an expert-parallel "
                "dispatch around the experts (Transformers' DistributedConfig(ep_size=...) plan "
                "sends each token to the rank owning its expert); no MoE kernel runs them exactly"
            )
        return "its expert weights are split over devices (expert parallelism: moe-gemm's moe_ep)"
    unsplit = transformers_ep.unsplit(module) if split else []
    if unsplit:
        return (
            "Transformers' expert-parallel plan splits its experts but leaves "
            f"{', '.join(unsplit)} whole, so they would not match this rank's local experts"
        )
    if getattr(module, "has_post_expert_norm", False):
        return "it has a post-expert norm"
    if not hasattr(module, "gate_up_proj") or not hasattr(module, "down_proj"):
        return "it has no gate_up_proj / down_proj 3D weights"
    problem = quantized.problem(module)
    if problem:
        return problem
    kind, why = activation_of(module)
    if kind is None:
        return why
    # checked here (kernelize runs this eagerly), so a compiled forward never runs the probe
    _ACTIVATIONS[_activation_key(module)] = kind
    _CHECKED.add(module)
    return None


def _activation_key(module: torch.nn.Module) -> tuple:
    """What decides the gate's form: the class, its gate parameters and activation (modules of one
    class may hold different ``act_fn``s: Llama 4's experts, read from the instance)."""
    act_fn = getattr(module, "act_fn", None)
    return (
        type(module),
        type(act_fn),
        getattr(act_fn, "approximate", None),
        getattr(module, "alpha", None),
        getattr(module, "limit", None),
        getattr(module, "swiglu_alpha", None),
        getattr(module, "swiglu_limit", None),
        getattr(getattr(module, "config", None), "hidden_act", None),
    )


def _activation(module: torch.nn.Module) -> str:
    """The module's activation kind, probed once per class and gate parameters."""
    key = _activation_key(module)
    cached = _ACTIVATIONS.get(key)
    if cached is None:
        kind, why = activation_of(module)
        if kind is None:
            raise NotImplementedError(f"{type(module).__name__}: fused-moe cannot run it: {why}")
        cached = _ACTIVATIONS[key] = kind
    return cached


_ACTIVATIONS: dict[tuple, str] = {}
_CHECKED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Modules already checked by ``module_problem`` (the check runs a probe)."""


def _bucket(tokens: int) -> int:
    return max(MIN_TOKENS, 1 << (tokens - 1).bit_length())


def experts_forward(
    experts: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """``ExpertsInterface`` function: hidden_states [T, H], top_k_index / top_k_weights [T, k]
    -> [T, H] in the dtype of hidden_states."""
    # kernelize checked it; a compiled forward does not guard on the weak set (its size changes
    # whenever an unrelated module is collected, which fails dynamo's guards mid-trace)
    checked = torch.compiler.is_compiling() or experts in _CHECKED
    problem = None if checked else module_problem(experts)
    if problem:
        raise NotImplementedError(f"{type(experts).__name__}: fused-moe cannot run it: {problem}")
    tensors, extra = padding.kernel_tensors(experts)
    tokens = hidden_states.shape[0]
    padded = _bucket(tokens) if tokens else 0
    pad = padded - tokens
    x = torch.nn.functional.pad(hidden_states, (0, extra, 0, pad))
    ids = torch.nn.functional.pad(top_k_index.to(torch.int32), (0, 0, 0, pad), value=-1)
    weights = torch.nn.functional.pad(top_k_weights, (0, 0, 0, pad))
    module_kind = _activation(experts)
    alpha = getattr(experts, "alpha", None) or getattr(experts, "swiglu_alpha", None) or 1.702
    limit = getattr(experts, "limit", None) or getattr(experts, "swiglu_limit", None) or 7.0
    out = fused_experts(
        x,
        ids,
        weights,
        *tensors,
        activation=module_kind,
        alpha=float(alpha),
        limit=float(limit),
        transposed=bool(getattr(experts, "is_transposed", False)),
        interleaved=not getattr(experts, "is_concatenated", True),
        quantization=quantized.kind(experts),
    )
    return out[:tokens, : hidden_states.shape[1]]


def register(name: str = DEFAULT_NAME) -> str:
    """Register ``experts_forward`` with Transformers' experts interfaces under ``name``."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # a Transformers without FP8 experts: nothing else to register with
        return name
    FP8ExpertsInterface.register(name, experts_forward)
    return name


@dataclass(frozen=True)
class QuantizationReport:
    """What ``quantize_experts`` did: the error of every quantized weight, and the experts
    modules left alone with the reason."""

    quantization: str
    errors: tuple[quantized.WeightError, ...]
    left_alone: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        lines = [f"quantize_experts({self.quantization!r}):"]
        for e in self.errors:
            lines.append(
                f"  {e.module}.{e.projection}: {e.bytes_before} -> {e.bytes_after} bytes, "
                f"relative RMS error {e.relative_rms:.3g}, max |error| {e.max_abs:.3g}"
            )
        if self.quantization == "w8a8":
            lines.append(
                "  activations: int8 per token and 128 columns at run time (their error is not "
                "in the weight figures above; compare the model's outputs)"
            )
        lines += [f"  {name}: left alone ({why})" for name, why in self.left_alone]
        return "\n".join(lines)


def quantize_experts(model: torch.nn.Module, quantization: str) -> QuantizationReport:
    """Quantize the expert weights of every Transformers experts module of ``model`` in place
    ("int8": per output channel; "fp8": e4m3, 128x128 blocks; "mxfp4": e2m1 with an e8m0 scale
    per 32, GPT-OSS's checkpoint format; "w8a8": int8's weights, and activations quantized to int8
    per token and 128 columns in the kernel) and switch its experts to the fused kernel, the only
    path that runs them. Returns (and logs) each weight's error."""
    if quantization not in quantized.KINDS:
        raise KernelInputError(
            f"quantize_experts: quantization must be one of {quantized.KINDS}, got {quantization!r}"
        )
    errors, left_alone = [], []
    for name, module in model.named_modules():
        if not hasattr(module, "has_gate") or getattr(module, "gate_up_proj", None) is None:
            continue
        why = quantized.quantize_problem(module, quantization) or _problem(module)
        if why:
            left_alone.append((name, why))
            continue
        errors += quantized.quantize_module(name, module, quantization)
        _CHECKED.discard(module)
    if errors:
        model.set_experts_implementation(register())
    report = QuantizationReport(quantization, tuple(errors), tuple(left_alone))
    log.warning("%s", report)
    return report
