"""Transformers: known layer classes, and the attention and MoE experts interfaces.

Known classes. Transformers marks its layers with ``use_kernel_forward_from_hub("RMSNorm")``, but
with no compatible ``kernels`` package installed that decorator is an inert stub and sets nothing.
kernel-hub then recognises a class as the ``RMSNorm`` layer when

1. it is defined in a ``transformers.`` module and its name ends with ``RMSNorm``, and
2. its ``forward``, run on a probe object that holds only ``weight`` and ``variance_epsilon``,
   computes Llama's ``weight * (x / sqrt(mean(x**2, -1) + eps)).to(x.dtype)``: same values and
   same output dtype, for random f32 x and weight, and for bf16 x with an f32 weight (Llama
   returns f32 there, as the kernel does).

Gemma-style norms (scale by ``1 + weight``), unweighted, gated and ``self._norm(...)``-based
variants fail 2 and are never swapped, and so do norms that cast the product back to the input
dtype (``(weight * x).to(x.dtype)``). In transformers 5.24 this recognises 143 of the 198
``*RMSNorm`` classes (Llama, Mistral, Mixtral, Qwen2/3, Qwen2/3-MoE, ...).

Interfaces. Attention modules whose forward reads ``ALL_ATTENTION_FUNCTIONS`` and experts modules
whose forward is the ``@use_experts_implementation`` dispatcher are switched as a whole model:
the registry op (``attention``, ``moe-gemm``) provides a kernel whose
``integrations.register() -> name`` registers with the interface, and the model is switched with
``set_attn_implementation`` / ``set_experts_implementation``. The previous implementation is kept
so ``unkernelize`` can restore it.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.moe import ExpertsInterface
from transformers.masking_utils import AttentionMaskInterface

from kernel_hub.errors import KernelHubError

RMSNORM_LAYER = "RMSNorm"
_PROBE_EPS = 1e-5


def recognised_layer(cls: type) -> str | None:
    """The layer name a known Transformers class can be replaced by, or None."""
    return RMSNORM_LAYER if is_llama_style_rmsnorm(cls) else None


@functools.cache
def is_llama_style_rmsnorm(cls: type) -> bool:
    """Rule 1 and 2 of the module docstring, checked once per class."""
    if not (cls.__module__.startswith("transformers.") and cls.__name__.endswith("RMSNorm")):
        return False
    probes = ((torch.float32, 1e-5), (torch.bfloat16, 1e-2))
    return all(_matches_llama(cls.forward, dtype, rtol) for dtype, rtol in probes)


def _matches_llama(forward: Callable[..., Any], x_dtype: torch.dtype, rtol: float) -> bool:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=generator).to(x_dtype)
    probe = types.SimpleNamespace(
        weight=torch.randn(8, generator=generator), variance_epsilon=_PROBE_EPS
    )
    try:
        with torch.no_grad():
            out = forward(probe, x)
    except Exception:  # it reads other state or wants other arguments: not the Llama form
        return False
    x32 = x.float()
    normalized = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + _PROBE_EPS)
    expected = probe.weight * normalized.to(x_dtype)
    return (
        isinstance(out, torch.Tensor)
        and out.shape == expected.shape
        and out.dtype == expected.dtype
        and torch.allclose(out, expected, rtol=rtol, atol=rtol * 1e-1)
    )


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

    def dispatches(self, module: torch.nn.Module) -> bool:
        return _forward_reads(type(module), self.dispatch_name)

    def unreached(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
        """Modules this interface sees but cannot switch: none (it sees only dispatchers)."""
        return []

    def integration(self, kernel: types.ModuleType) -> Any:
        """What registers the kernel with the interface: the kernel's ``integrations`` module."""
        return getattr(kernel, "integrations", None)

    def current(self, model: torch.nn.Module) -> dict[str, Any]:
        """The implementation of the model and of each sub-config, as the setter accepts it."""
        if not callable(getattr(model, self.setter, None)):
            raise KernelHubError(
                f"{type(model).__name__} has no {self.setter}(); kernelize the whole Transformers "
                f"model (a PreTrainedModel) to switch its {self.kind}"
            )
        config = model.config
        current = {"": getattr(config, self.config_attribute)}
        for key in getattr(config, "sub_configs", {}):
            sub = getattr(config, key, None)
            if sub is not None:
                current[key] = getattr(sub, self.config_attribute)
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


def _experts_problem(name: str) -> str | None:
    if name not in ExpertsInterface():
        return f"is not registered with ExpertsInterface ({name!r})"
    return None


MODEL_INTERFACES = (
    ModelInterface(
        name="AttentionInterface",
        kind="attention",
        op="attention",
        dispatch_name="ALL_ATTENTION_FUNCTIONS",
        config_attribute="_attn_implementation",
        setter="set_attn_implementation",
        registered=_attention_problem,
    ),
    ModelInterface(
        name="ExpertsInterface",
        kind="experts",
        op="moe-gemm",
        dispatch_name="experts_interface",
        config_attribute="_experts_implementation",
        setter="set_experts_implementation",
        registered=_experts_problem,
    ),
)
