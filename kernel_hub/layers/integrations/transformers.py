"""Transformers: known layer classes, and the attention and MoE experts interfaces.

Known classes. Transformers marks its layers with ``use_kernel_forward_from_hub("RMSNorm")``, but
with no compatible ``kernels`` package installed that decorator is an inert stub and sets nothing.
kernel-hub then recognises a class as one of the rmsnorm kernel's layers when

1. it is defined in a ``transformers.`` module and its name ends with ``RMSNorm``, and
2. its ``forward``, run on a probe object that holds only ``weight`` and an epsilon (and, for a
   form with a scale flag such as Gemma 4's ``with_scale``, the flag: True with the weight,
   False without), computes one of ``NORM_FORMS`` bit for bit and dtype for dtype, for f32 and
   bf16 inputs and weights.

The form decides the layer; the name of the forward's input picks the layer of that form taking
it under that name (Llama 4's ``forward(self, x)``: ``RMSNormOfX``). Near misses (eps placement,
a bias, another rounding point, other state) are never swapped.

Interfaces. Attention modules whose forward reads ``ALL_ATTENTION_FUNCTIONS`` and experts modules
whose forward is the ``@use_experts_implementation`` dispatcher are switched as a whole model:
the registry op (``attention``, ``moe-gemm``) provides a kernel whose
``integrations.register() -> name`` registers with the interface, and the model is switched with
``set_attn_implementation`` / ``set_experts_implementation``. The previous implementation is kept
so ``unkernelize`` can restore it.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.moe import ExpertsInterface
from transformers.masking_utils import AttentionMaskInterface

from kernel_hub.errors import KernelHubError

from .causal_lm_loss import CausalLMLossInterface
from .continuous_batching import ContinuousBatchingInterface
from .function_slots import FunctionSlotInterface
from .mlp_forms import MLPRecognition, is_gated_mlp_candidate, recognise_mlp
from .moe_blocks import InputScaledMoEInterface
from .rotary_slot import RotarySlotInterface


@dataclass(frozen=True)
class NormForm:
    """An RMSNorm formula a kernel layer computes exactly (rounding points and dtype included)."""

    layer: str
    formula: str
    reference: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    """The formula in torch, written as the model families write it (x̂ = x normalised in f32)."""
    scale_flag: str | None = None
    """A bool attribute the forward reads: True applies the weight, False means the module holds
    no weight and computes ``x̂.to(x.dtype)`` (Gemma 4's ``with_scale``)."""
    renamed: tuple[tuple[str, str], ...] = ()
    """(forward input name, layer taking it under that name) for inputs not named as ``layer``'s."""

    def layer_for(self, cls: type) -> str:
        """The layer of this form whose forward names its input as ``cls.forward`` does (else
        ``layer``: kernelize then reports the signatures that differ)."""
        try:
            names = list(inspect.signature(cls.forward).parameters)
        except (TypeError, ValueError):
            return self.layer
        return dict(self.renamed).get(names[1] if len(names) > 1 else "", self.layer)


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def _f32_scale(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (weight * _normalized(x, eps)).to(x.dtype)


NORM_FORMS = (
    NormForm(
        "RMSNorm",
        "weight * x̂.to(x.dtype)",
        lambda x, weight, eps: weight * _normalized(x, eps).to(x.dtype),
        renamed=(("x", "RMSNormOfX"),),
    ),
    NormForm("RMSNormF32Scale", "(weight * x̂).to(x.dtype)", _f32_scale),
    NormForm(
        "RMSNormZeroCentered",
        "(x̂ * (1 + weight.float())).to(x.dtype)",
        lambda x, weight, eps: (_normalized(x, eps) * (1.0 + weight.float())).to(x.dtype),
    ),
    NormForm(
        "RMSNormOptionalScale",
        "(weight * x̂).to(x.dtype) if with_scale else x̂.to(x.dtype)",
        _f32_scale,
        scale_flag="with_scale",
    ),
)
"""Forms ``recognise_norm`` tells apart, each served by the rmsnorm kernel's layer of that name."""

_PROBE_EPS = 0.125
"""Large next to the probe's mean square (~0.25), so a misplaced or missing eps shows."""
_PROBE_DTYPES = (
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16),
)
_EPS_NAMES = ("variance_epsilon", "eps")


class _Probe:
    """Stands in for a norm instance holding only ``state``; the class's own methods are bound
    to it, and every attribute the forward asks for is recorded."""

    def __init__(self, cls: type, state: dict[str, Any]):
        object.__setattr__(self, "_probe", (cls, state, set()))

    def __getattr__(self, name: str) -> Any:
        cls, state, read = object.__getattribute__(self, "_probe")
        read.add(name)
        if name in state:
            return state[name]
        attribute = inspect.getattr_static(cls, name, None)
        if isinstance(attribute, types.FunctionType):
            return types.MethodType(attribute, self)
        raise AttributeError(f"{cls.__name__}.forward reads self.{name}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"forward sets self.{name}")


@dataclass(frozen=True)
class Recognition:
    """What ``recognise_norm`` found for a class: the layer serving it, or why there is none."""

    layer: str | None
    reason: str | None = None


def is_transformers_norm(cls: type) -> bool:
    """A Transformers ``*RMSNorm`` class: one ``recognise_norm`` decides about."""
    return cls.__module__.startswith("transformers.") and cls.__name__.endswith("RMSNorm")


@functools.cache
def recognise_norm(cls: type) -> Recognition:
    """Which of ``NORM_FORMS`` ``cls.forward`` computes, bit for bit and dtype for dtype.

    The forward runs on a probe holding only ``weight`` and an epsilon (``variance_epsilon``,
    else ``eps``), and for a form with a scale flag also the flag (True with the weight, False
    without), for f32 and bf16 inputs and weights, with an eps large enough to matter. A form is
    recognised only when every probe output equals that form's torch formula exactly; a forward
    that reads other state, takes other arguments or matches no form is refused.
    """
    generator = torch.Generator().manual_seed(0)
    x = 0.5 * torch.randn(2, 3, 16, generator=generator)
    weight = torch.randn(16, generator=generator)
    problems = []
    for eps_name in _EPS_NAMES:
        for flag in dict.fromkeys(f.scale_flag for f in NORM_FORMS):
            forms = [f for f in NORM_FORMS if f.scale_flag == flag]
            outcome = _probe_forms(cls, forms, eps_name, x, weight)
            if isinstance(outcome, NormForm):
                return Recognition(outcome.layer_for(cls))
            problems.append(outcome)
    forms = "; ".join(f"{f.layer}: {f.formula}" for f in NORM_FORMS)
    return Recognition(
        None,
        f"its forward is none of the RMSNorm forms kernel-hub serves ({forms}): "
        f"{_closest(problems)}",
    )


def _closest(problems: list[str]) -> str:
    """The probe problem to report: the first one not caused by a probe holding another epsilon
    or scale-flag name than the forward reads (those only say the probe picked a wrong name)."""
    named = {*_EPS_NAMES, *(f.scale_flag for f in NORM_FORMS if f.scale_flag)}
    real = [p for p in problems if not any(f"reads self.{n}" in p for n in named)]
    return (real or problems)[0]


def _probe_states(
    flag: str | None, eps_name: str, weight: torch.Tensor
) -> list[tuple[dict[str, Any], bool]]:
    """(probe state, whether it holds the weight) for forms with scale flag ``flag``."""
    held = {"weight": weight, eps_name: _PROBE_EPS}
    if flag is None:
        return [(held, True)]
    return [({**held, flag: True}, True), ({eps_name: _PROBE_EPS, flag: False}, False)]


def _probe_forms(
    cls: type, forms: list[NormForm], eps_name: str, x: torch.Tensor, weight: torch.Tensor
):
    """The one of ``forms`` (all with one scale flag) matching on every probe, or why none does
    (a string)."""
    candidates = list(forms)
    for x_dtype, w_dtype in _PROBE_DTYPES:
        xi, wi = x.to(x_dtype), weight.to(w_dtype)
        for state, weighted in _probe_states(forms[0].scale_flag, eps_name, wi):
            probe = _Probe(cls, state)
            try:
                with torch.no_grad():
                    out = cls.forward(probe, xi)
            except Exception as exc:  # other state or arguments: not a form served here
                return f"on a probe holding {', '.join(state)}: {type(exc).__name__}: {exc}"
            read = object.__getattribute__(probe, "_probe")[2]
            if weighted and "weight" not in read:
                return "it does not read self.weight"
            candidates = [
                f
                for f in candidates
                if _same(
                    out,
                    f.reference(xi, wi, _PROBE_EPS)
                    if weighted
                    else _normalized(xi, _PROBE_EPS).to(xi.dtype),
                )
            ]
            if not candidates:
                return f"x {x_dtype}, weight {w_dtype}: the result differs from every form"
    return candidates[0]


def _same(out: Any, expected: torch.Tensor) -> bool:
    return (
        isinstance(out, torch.Tensor) and out.dtype == expected.dtype and torch.equal(out, expected)
    )


def _silu32(gate: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate.to(torch.float32))


def _grouped_normalized(h: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    grouped = h.view(*h.shape[:-1], h.shape[-1] // group, group)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return grouped.view(h.shape)


_PROBE_GROUP = 8
"""Half the probe's hidden size: a grouped norm that normalised whole rows would show."""

GATED_NORM_FORMS = (
    NormForm(
        "RMSNormGated",
        "((weight * x̂.to(x.dtype)) * silu(gate.float())).to(x.dtype)",
        lambda x, gate, weight, eps: (
            (weight * _normalized(x, eps).to(x.dtype)) * _silu32(gate)
        ).to(x.dtype),
    ),
    NormForm(
        "RMSNormGatedGrouped",
        "weight * group_norm(x.float() * silu(gate.float())).to(x.dtype)",
        lambda x, gate, weight, eps: (
            weight
            * _grouped_normalized(x.to(torch.float32) * _silu32(gate), _PROBE_GROUP, eps).to(
                x.dtype
            )
        ),
    ),
)
"""Forms ``recognise_gated_norm`` tells apart (rmsnorm kernel layers of those names)."""


def is_transformers_gated_norm(cls: type) -> bool:
    """A Transformers ``*RMSNormGated`` class (the hybrid models' gated norms)."""
    return cls.__module__.startswith("transformers.") and cls.__name__.endswith("RMSNormGated")


@functools.cache
def recognise_gated_norm(cls: type) -> Recognition:
    """Which of ``GATED_NORM_FORMS`` ``cls.forward(x, gate)`` computes, bit for bit and dtype for
    dtype, on a probe holding ``weight``, ``variance_epsilon``, ``activation="silu"`` and
    ``group_size`` (half the hidden size), for f32 and bf16 inputs and weights."""
    generator = torch.Generator().manual_seed(0)
    x = 0.5 * torch.randn(2, 3, 2 * _PROBE_GROUP, generator=generator)
    gate = torch.randn(2, 3, 2 * _PROBE_GROUP, generator=generator)
    weight = torch.randn(2 * _PROBE_GROUP, generator=generator)
    state = {"variance_epsilon": _PROBE_EPS, "activation": "silu", "group_size": _PROBE_GROUP}
    candidates = list(GATED_NORM_FORMS)
    for x_dtype, w_dtype in _PROBE_DTYPES:
        xi, gi, wi = x.to(x_dtype), gate.to(x_dtype), weight.to(w_dtype)
        probe = _Probe(cls, {"weight": wi, **state})
        try:
            with torch.no_grad():
                out = cls.forward(probe, xi, gi)
        except Exception as exc:  # other state or arguments: not a form served here
            return Recognition(None, f"on a gated-norm probe: {type(exc).__name__}: {exc}")
        candidates = [f for f in candidates if _same(out, f.reference(xi, gi, wi, _PROBE_EPS))]
        if not candidates:
            forms = "; ".join(f"{f.layer}: {f.formula}" for f in GATED_NORM_FORMS)
            return Recognition(
                None,
                f"x {x_dtype}, weight {w_dtype}: its forward is none of the gated forms "
                f"kernel-hub serves ({forms})",
            )
    return Recognition(candidates[0].layer)


MIXERS = dict.fromkeys(
    ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"), "GatedDeltaNet"
)
MIXERS.update(
    dict.fromkeys(
        (
            "Mamba2Mixer",
            "BambaMixer",
            "NemotronHMamba2Mixer",
            "FalconH1Mixer",
            "GraniteMoeHybridMambaLayer",
            "Zamba2MambaMixer",
        ),
        "Mamba2ScanMixer",
    )
)
"""Hybrid models' linear-attention mixers (by class name) and the kernel layer that replaces their
forward; the layer's module check verifies the instance."""


def recognised_layer(cls: type) -> str | None:
    """The layer name a known Transformers class can be replaced by, or None."""
    if is_gated_mlp_candidate(cls):
        return recognise_gated_mlp(cls).layer
    if cls.__module__.startswith("transformers.") and cls.__name__ in MIXERS:
        return MIXERS[cls.__name__]
    if is_transformers_gated_norm(cls):
        return recognise_gated_norm(cls).layer
    return recognise_norm(cls).layer if is_transformers_norm(cls) else None


def recognise_gated_mlp(cls: type) -> MLPRecognition:
    """Which gated-MLP layer serves a Transformers ``*MLP`` class (``mlp_forms``), or why none."""
    return recognise_mlp(cls, _Probe)


def hf_kernels_problem(model: torch.nn.Module) -> str | None:
    """Why kernel-hub must not kernelize a model Hugging Face ``kernels`` manages, or None.

    ``use_kernels=True`` (``from_pretrained`` or the attribute) makes every ``train()``/``eval()``
    switch re-run that library's kernelize, which resets the forward of each layer it knows:
    kernel-hub's swaps would be undone silently at the next mode switch.
    """
    for name, module in model.named_modules():
        if getattr(module, "_use_kernels", False) is True:
            where = f" (its submodule {name!r})" if name else ""
            return (
                f"{type(model).__name__}{where} has use_kernels=True: Hugging Face kernels "
                "manages its layers and re-kernelizes them on every train()/eval(), which would "
                "undo kernel-hub's swaps; load it without use_kernels (or set "
                "model.use_kernels = False before any kernelize) to use kernel-hub"
            )
    return None


def _forward_reads(cls: type, name: str) -> bool:
    """Whether ``cls.forward`` (or a function it wraps) reads the global or closure ``name``."""
    fn = getattr(cls, "forward", None)
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is not None and (name in code.co_names or name in code.co_freevars):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


@dataclass(frozen=True)
class ModelInterface:
    """A Transformers dispatch table that a kernel's ``integrations.register()`` adds itself to."""

    name: str
    kind: str
    op: str
    """Registry op whose kernel provides the implementation."""
    dispatch_name: str
    """Global or closure name a dispatching forward reads."""
    config_attribute: str
    setter: str
    registered: Callable[[str], str | None]
    """Why an implementation name is not usable (not registered, no mask function), or None."""
    model_problem: Callable[[torch.nn.Module, list[tuple[str, torch.nn.Module]]], str | None] = (
        lambda model, modules: None
    )
    """Why the model (with its dispatching modules) must keep its stock implementation."""
    training_problem: Callable[[torch.nn.Module, list[tuple[str, torch.nn.Module]]], str | None] = (
        lambda model, modules: None
    )
    """The same, for training mode only (a gradient the implementation would not give)."""
    inference_op: str | None = None
    """Registry op used instead of ``op`` when kernelizing for inference (a forward-only kernel
    serving the same interface)."""

    def dispatches(self, module: torch.nn.Module) -> bool:
        return _forward_reads(type(module), self.dispatch_name)

    def unreached(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
        """Modules this interface sees but cannot switch: none (it sees only dispatchers)."""
        return []

    def integration(self, kernel: types.ModuleType) -> Any:
        """What registers the kernel with the interface: its declared Transformers adapter."""
        return kernel.KERNEL.integration("transformers")

    def current(self, model: torch.nn.Module) -> dict[str, Any]:
        """The implementation of the model and of each sub-config in use, as the setter accepts
        it (a sub-config whose implementation was never set, None, belongs to no submodel)."""
        if not callable(getattr(model, self.setter, None)):
            raise KernelHubError(
                f"{type(model).__name__} has no {self.setter}(); kernelize the whole Transformers "
                f"model (a PreTrainedModel) to switch its {self.kind}"
            )
        config = model.config
        current = {"": getattr(config, self.config_attribute)}
        for key in getattr(config, "sub_configs", {}):
            sub = getattr(config, key, None)
            value = getattr(sub, self.config_attribute, None) if sub is not None else None
            if value is not None:
                current[key] = value
        return current

    def switch(self, model: torch.nn.Module, name: Any) -> str:
        """Make ``model`` use implementation ``name``, or a clear error with the model unchanged."""
        problem = (
            f"is {type(name).__name__} {name!r}, not a name"
            if not isinstance(name, str)
            else self.registered(name)
        )
        if problem:
            raise KernelHubError(f"integrations.register() returned a name that {problem}")
        previous = self.current(model)
        try:
            getattr(model, self.setter)(name)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise KernelHubError(
                f"{type(model).__name__}.{self.setter}({name!r}) failed: {exc}"
            ) from exc
        if getattr(model.config, self.config_attribute) != name:
            self.restore(model, previous)
            raise KernelHubError(
                f"{type(model).__name__} does not let its {self.kind} implementation be switched"
            )
        return name

    def restore(self, model: torch.nn.Module, previous: dict[str, Any]) -> None:
        getattr(model, self.setter)(previous)


def _attention_problem(name: str) -> str | None:
    if name not in AttentionInterface():
        return f"is not registered with AttentionInterface ({name!r})"
    if name not in AttentionMaskInterface():
        return (
            f"has no AttentionMaskInterface entry ({name!r}); the attention function would get "
            "no mask and ignore padding"
        )
    return None


def _sdpa_convention_problem(
    model: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]]
) -> str | None:
    """kernel-hub attention gets SDPA's masks (``sdpa_mask``), which leave out a purely causal
    mask and let the module's ``is_causal`` decide. A model Transformers does not run with SDPA
    (``_supports_sdpa = False``) may have a causal layer whose ``is_causal`` is False (it gets
    an explicit causal mask under eager: Pegasus-X, NLLB-MoE, GIT decoders); there that layer
    would silently become bidirectional."""
    if getattr(model, "_supports_sdpa", True) is not False:
        return None
    name = next((n for n, m in modules if getattr(m, "is_causal", True) is False), None)
    if name is None:
        return None
    return (
        f"{type(model).__name__} does not support SDPA (_supports_sdpa = False) and {name} has "
        "is_causal = False: with SDPA's masks (a purely causal mask left out) a causal layer "
        "of it could run bidirectional"
    )


def _legacy_mask_problem(model: torch.nn.Module) -> str | None:
    """A model that builds its own BERT-era extended mask (``get_extended_attention_mask`` or an
    ``extended_attention_mask`` local: a broadcastable [B, 1, 1, S] additive mask, LayoutLM) hands
    attention that mask instead of one from ``AttentionMaskInterface``, in a layout the attention
    kernel does not take."""
    for module in model.modules():
        fn = type(module).forward
        while fn is not None:
            code = getattr(fn, "__code__", None)
            if code is not None and (
                "extended_attention_mask" in code.co_varnames
                or "get_extended_attention_mask" in code.co_names
            ):
                return (
                    f"{type(module).__name__} builds its own broadcastable [B, 1, 1, S] attention "
                    "mask (extended_attention_mask) instead of asking AttentionMaskInterface, and "
                    "the attention kernel takes only the masks the interface builds"
                )
            fn = getattr(fn, "__wrapped__", None)
    return None


def _parameter_mask_problem(
    model: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]]
) -> str | None:
    """An attention layer that computes its mask from parameters and the mask tensor (Doge's
    dynamic mask attention, ``prepare_dynamic_mask`` over ``A`` and ``dt_proj``) needs a mask
    tensor to post-process, where kernel-hub hands its attention a compact mask description, and
    in training the mask's gradient, which the attention kernel does not return."""
    name = next((n for n, m in modules if _forward_reads(type(m), "prepare_dynamic_mask")), None)
    if name is None:
        return None
    return (
        f"{name} computes its attention mask from parameters (prepare_dynamic_mask): it needs a "
        "mask tensor to post-process (kernel-hub passes a compact mask description) and, in "
        "training, the mask's gradient, which the attention kernel does not give"
    )


def _attention_model_problem(
    model: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]]
) -> str | None:
    return (
        _sdpa_convention_problem(model, modules)
        or _legacy_mask_problem(model)
        or _parameter_mask_problem(model, modules)
    )


def _experts_problem(name: str) -> str | None:
    if name not in ExpertsInterface():
        return f"is not registered with ExpertsInterface ({name!r})"
    return None


ATTENTION_INTERFACE = ModelInterface(
    name="AttentionInterface",
    kind="attention",
    op="attention",
    dispatch_name="ALL_ATTENTION_FUNCTIONS",
    config_attribute="_attn_implementation",
    setter="set_attn_implementation",
    registered=_attention_problem,
    model_problem=_attention_model_problem,
)

MODEL_INTERFACES = (
    ATTENTION_INTERFACE,
    ModelInterface(
        name="ExpertsInterface",
        kind="experts",
        op="moe-gemm",
        inference_op="fused-moe",
        dispatch_name="experts_interface",
        config_attribute="_experts_implementation",
        setter="set_experts_implementation",
        registered=_experts_problem,
    ),
    InputScaledMoEInterface(),
    ContinuousBatchingInterface(attention=ATTENTION_INTERFACE),
    CausalLMLossInterface(),
    FunctionSlotInterface(
        slots=("causal_conv1d_fn", "causal_conv1d_update"),
        op="causal-conv1d",
        name="CausalConv1dSlots",
        calls_global=_forward_reads,
    ),
    RotarySlotInterface(),
)
