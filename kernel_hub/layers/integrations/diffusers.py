"""Diffusers: kernel-hub attention behind Diffusers' attention dispatcher, and its LayerNorm class.

Attention. Diffusers' newer models (Flux, Flux2, Wan, QwenImage, HunyuanVideo, LTX, ...) call
``dispatch_attention_fn(q, k, v, backend=processor._attention_backend, ...)``. The attention
kernel declares a Diffusers adapter (``KERNEL.integrations["diffusers"]``) whose ``register()``
registers the kernel as a Diffusers attention backend and returns its key; kernelize sets
``_attention_backend`` on each such processor *instance* to that key, so only that model changes:
Diffusers' global active backend is never touched, two models in one process can differ, and
``unkernelize`` puts back exactly what each processor had.

Processors that call ``torch.nn.functional.scaled_dot_product_attention`` directly (the legacy
``attention_processor.py``: SD3's ``JointAttnProcessor2_0``, UNet's ``AttnProcessor2_0``), and
processors set to an explicit backend or to context parallelism, are left alone with the reason.

Layers. ``FP32LayerNorm`` (Wan, ...) is the ``FP32LayerNorm`` layer of the ``layernorm`` op,
Diffusers' ``RMSNorm`` (SD3's q/k norms) the ``DiffusersRMSNorm`` layer of the ``rmsnorm`` op (one
with a bias is left alone); Diffusers' ``LayerNorm`` is ``torch.nn.LayerNorm`` (see
``integrations.torch_nn``).

Per-head q/k norms before a rotary (``layers_left_to_xla``: Flux's ``norm_q``, ``norm_k``,
``norm_added_q``, ``norm_added_k``, a norm over the head dim in an attention module whose processor
then calls ``apply_rotary_emb``) are left to XLA: XLA fuses such a norm into the rotary that splits
each head into pairs, and after a kernel call it relayouts the norm's output through a chain of
copies instead (measured on Flux: docs/model-bench.md, item 4 of "Where kernelized lost"). Norms
over all heads (Wan's) are not per-head and keep their kernel.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
from diffusers.models import attention_dispatch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
from diffusers.models.normalization import FP32LayerNorm, RMSNorm

from kernel_hub.errors import KernelHubError

FP32_LAYERNORM_LAYER = "FP32LayerNorm"
RMSNORM_LAYER = "DiffusersRMSNorm"
_SWITCHABLE_BACKENDS = (None, AttentionBackendName.NATIVE)
"""A processor on Diffusers' default (no backend of its own) or on ``native`` is switched; one
the user pointed at another backend keeps it."""
_KERNEL_KEYS: set[AttentionBackendName] = set()
"""The backend keys kernelize switched processors to (switched again by a later kernelize)."""


def recognised_layer(cls: type) -> str | None:
    """The layer name a Diffusers class can be replaced by, or None."""
    if issubclass(cls, FP32LayerNorm) and cls.forward is FP32LayerNorm.forward:
        return FP32_LAYERNORM_LAYER
    if issubclass(cls, RMSNorm) and cls.forward is RMSNorm.forward:
        return RMSNORM_LAYER
    return None


def _backend_name(backend: Any) -> str:
    """A processor's backend by name: an enum member's value, a string, or (None) Diffusers'
    active backend, which a processor without a backend of its own uses."""
    if backend is None:
        backend = _AttentionBackendRegistry.get_active_backend()[0]
    return str(getattr(backend, "value", backend))


def _dispatching(processor: Any) -> bool:
    """Whether a processor's ``__call__`` goes through ``dispatch_attention_fn``."""
    code = getattr(type(processor).__call__, "__code__", None)
    return code is not None and attention_dispatch.dispatch_attention_fn.__name__ in code.co_names


def _switch_problem(processor: Any) -> str | None:
    name = type(processor).__name__
    if not _dispatching(processor):
        return (
            f"its processor {name} calls torch's scaled_dot_product_attention itself, not "
            "Diffusers' dispatch_attention_fn, so no attention backend reaches it"
        )
    backend = getattr(processor, "_attention_backend", None)
    if backend not in _SWITCHABLE_BACKENDS and backend not in _KERNEL_KEYS:
        return f"its processor {name} is set to attention backend {_backend_name(backend)!r}"
    if getattr(processor, "_parallel_config", None) is not None:
        return f"its processor {name} runs context parallel attention (_parallel_config)"
    return None


def _processors(model: torch.nn.Module):
    """(name, attention module, processor) for every module holding a Diffusers processor."""
    for name, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is not None and callable(processor) and not isinstance(processor, type):
            yield name, module, processor


_QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")
"""Where Diffusers' attention modules hold their q/k norms (the added ones: the text stream's)."""
_ROTARY = "apply_rotary_emb"
_ROTARY_QK_NORM_REASON = (
    "a per-head q/k norm before {processor}'s apply_rotary_emb: XLA fuses the norm into the "
    "rotary's split of each head into pairs, and after a kernel it copies the norm's output "
    "through relayouts instead, so kernelize leaves it to XLA"
)


def _normalized_width(norm: torch.nn.Module) -> int | None:
    """The width a norm normalizes over (torch's ``normalized_shape``, Diffusers' ``dim``)."""
    shape = getattr(norm, "normalized_shape", getattr(norm, "dim", None))
    if not isinstance(shape, tuple) or not shape or not all(isinstance(n, int) for n in shape):
        return None
    return math.prod(shape)


def layers_left_to_xla(model: torch.nn.Module) -> dict[torch.nn.Module, str]:
    """Per-head q/k norms (over the module's ``head_dim``) of attention modules whose processor
    calls ``apply_rotary_emb`` -> why kernelize leaves them to XLA (see the module doc)."""
    kept = {}
    for _, module, processor in _processors(model):
        code = getattr(type(processor).__call__, "__code__", None)
        head_dim = getattr(module, "head_dim", None)
        if code is None or _ROTARY not in code.co_names or not isinstance(head_dim, int):
            continue
        reason = _ROTARY_QK_NORM_REASON.format(processor=type(processor).__name__)
        for attribute in _QK_NORMS:
            norm = getattr(module, attribute, None)
            if isinstance(norm, torch.nn.Module) and _normalized_width(norm) == head_dim:
                kept[norm] = reason
    return kept


_NO_ATTRIBUTE = object()


class DispatcherInterface:
    """Diffusers' attention dispatcher, switched per processor instance (see the module doc)."""

    name = "diffusers.dispatch_attention_fn"
    kind = "attention"
    op = "attention"

    def dispatches(self, module: torch.nn.Module) -> bool:
        processor = getattr(module, "processor", None)
        return processor is not None and _switch_problem(processor) is None

    def unreached(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
        found = []
        for name, module, processor in _processors(model):
            problem = _switch_problem(processor)
            if problem is not None:
                found.append((name, module, problem))
        return found

    def integration(self, kernel: types.ModuleType) -> Any:
        """What registers the kernel as a backend: its declared Diffusers adapter (a kernel that
        declares none leaves the processors as they are, with this reason)."""
        adapter = kernel.KERNEL.integration("diffusers")
        if adapter is None:
            manifest = kernel.manifest
            raise KernelHubError(
                f"kernel {manifest.name} {manifest.version} declares no Diffusers adapter "
                "(KERNEL.integrations['diffusers']): use a kernel that does, such as the in-tree "
                "attention kernel"
            )
        return adapter

    def model_problem(
        self, model: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]]
    ) -> str | None:
        """Nothing model-wide keeps the dispatcher stock (each processor is judged alone)."""
        return None

    def current(self, model: torch.nn.Module) -> dict[str, Any]:
        """'' -> the backend the switchable processors use now (one name, or a list when they
        differ); 'processors' -> what each has on itself (what restore puts back)."""
        dispatching = [p for _, _, p in _processors(model) if _dispatching(p)]
        switchable = [p for p in dispatching if _switch_problem(p) is None]
        # Processors kept on a backend of the user's are not kernel-hub's to report on.
        judged = switchable or dispatching
        names = sorted({_backend_name(getattr(p, "_attention_backend", None)) for p in judged})
        return {
            "": names[0] if len(names) == 1 else f"mixed: {', '.join(names)}",
            "processors": [
                (p, p.__dict__.get("_attention_backend", _NO_ATTRIBUTE)) for p in switchable
            ],
        }

    def switch(self, model: torch.nn.Module, key: Any) -> str:
        if (
            not isinstance(key, AttentionBackendName)
            or key not in _AttentionBackendRegistry._backends
        ):
            raise KernelHubError(f"{key!r} is not a registered Diffusers attention backend key")
        _KERNEL_KEYS.add(key)
        for processor, _ in self.current(model)["processors"]:
            processor._attention_backend = key
        return key.value

    def restore(self, model: torch.nn.Module, previous: dict[str, Any]) -> None:
        for processor, had in previous["processors"]:
            if had is _NO_ATTRIBUTE:
                processor.__dict__.pop("_attention_backend", None)
            else:
                processor._attention_backend = had


MODEL_INTERFACES = (DispatcherInterface(),)
