"""Diffusers: kernel-hub attention behind Diffusers' attention dispatcher, and its LayerNorm class.

Attention. Diffusers' newer models (Flux, Flux2, Wan, QwenImage, HunyuanVideo, LTX, ...) call
``dispatch_attention_fn(q, k, v, backend=processor._attention_backend, ...)`` with q/k/v in
[B, S, H, D]. kernelize sets ``_attention_backend`` on each such processor *instance* to a
kernel-hub backend key, so only that model changes: Diffusers' global active backend is never
touched, two models in one process can differ, and ``unkernelize`` puts back exactly what each
processor had. Diffusers' public setters accept only members of its closed ``AttentionBackendName``
enum; the key is an instance of that enum class that is *not* added to the enum (its member maps
stay as they are). It is registered in ``_AttentionBackendRegistry`` (private API) under that key,
which nothing else can look up.

The dispatcher drops every keyword its backend does not declare, silently. The backend is
therefore registered as accepting every name, and itself refuses what it does not implement.

Processors that call ``torch.nn.functional.scaled_dot_product_attention`` directly (the legacy
``attention_processor.py``: SD3's ``JointAttnProcessor2_0``, UNet's ``AttnProcessor2_0``), and
processors set to an explicit backend or to context parallelism, are left alone with the reason.

Layers. ``FP32LayerNorm`` (Wan, ...) is the ``FP32LayerNorm`` layer of the ``layernorm`` op,
Diffusers' ``RMSNorm`` (SD3's q/k norms) the ``DiffusersRMSNorm`` layer of the ``rmsnorm`` op (one
with a bias is left alone); Diffusers' ``LayerNorm`` is ``torch.nn.LayerNorm`` (see
``integrations.torch_nn``).
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
from diffusers.models import attention_dispatch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
from diffusers.models.normalization import FP32LayerNorm, RMSNorm

from kernel_hub.errors import KernelHubError, KernelInputError

log = logging.getLogger(__name__)

FP32_LAYERNORM_LAYER = "FP32LayerNorm"
RMSNORM_LAYER = "DiffusersRMSNorm"
BACKEND_PREFIX = "kernel_hub"
_SWITCHABLE_BACKENDS = (None, AttentionBackendName.NATIVE)
"""A processor on Diffusers' default (no backend of its own) or on ``native`` is switched; one
the user pointed at another backend keeps it."""


def recognised_layer(cls: type) -> str | None:
    """The layer name a Diffusers class can be replaced by, or None."""
    if issubclass(cls, FP32LayerNorm) and cls.forward is FP32LayerNorm.forward:
        return FP32_LAYERNORM_LAYER
    if issubclass(cls, RMSNorm) and cls.forward is RMSNorm.forward:
        return RMSNORM_LAYER
    return None


class _EveryName(frozenset):
    """Argument names of a backend that takes every keyword (and refuses what it cannot do)."""

    def __contains__(self, name: object) -> bool:
        return True


def _backend_key(name: str) -> AttentionBackendName:
    """An ``AttentionBackendName`` instance outside the enum's members (see the module doc)."""
    key = str.__new__(AttentionBackendName, name)
    key._name_ = key._value_ = name
    return key


def _sdpa_mask_4d(mask: torch.Tensor, batch: int, kv_len: int) -> torch.Tensor:
    """A mask as SDPA reads it, made 4-D: Diffusers' native backend turns a [B, S_k] mask into
    key padding [B, 1, 1, S_k]; any other rank broadcasts from the right."""
    if mask.dim() == 2 and tuple(mask.shape) == (batch, kv_len):
        return mask[:, None, None, :]
    if not 1 <= mask.dim() <= 4:
        raise KernelInputError(
            f"attention: attn_mask has shape {tuple(mask.shape)}; expected 1 to 4 dims "
            "broadcasting to [batch, heads, q_len, kv_len]"
        )
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


class _Backend:
    """One kernel's attention as a Diffusers backend (what kernelize registers and checks)."""

    HONOURED = (
        "query",
        "key",
        "value",
        "attn_mask",
        "dropout_p",
        "is_causal",
        "scale",
        "enable_gqa",
        "return_lse",
        "_parallel_config",
    )

    def __init__(self, kernel: types.ModuleType):
        self.kernel = kernel
        # The kernel's ops have backward ops and trace into one torch.compile graph.
        self.has_backward = True
        self.can_torch_compile = True
        self.module_problem = None  # each processor is judged by the interface instead
        # One key per loaded kernel build (its module name is unique to the build).
        self.key = _backend_key(f"{BACKEND_PREFIX}:{kernel.__name__}")

    def register(self) -> AttentionBackendName:
        """Register ``self.attention`` under the build's private key, once."""
        registry = _AttentionBackendRegistry
        if self.key not in registry._backends:
            registry.register(self.key)(self.attention)
            registry._supported_arg_names[self.key] = _EveryName(self.HONOURED)
        return self.key

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        return_lse: bool = False,
        _parallel_config: Any = None,
        **unknown: Any,
    ) -> torch.Tensor:
        """Diffusers' backend contract: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] -> [B, Sq, Hq, D]."""
        refused = {name: v for name, v in unknown.items() if v is not None}
        if return_lse:
            refused["return_lse"] = True
        if _parallel_config is not None:
            refused["_parallel_config"] = type(_parallel_config).__name__
        if refused:
            raise KernelInputError(
                f"attention: kernel-hub's Diffusers backend does not implement {refused}; it "
                f"honours {', '.join(self.HONOURED[:-2])}. Run this model with "
                "kernel_hub.unkernelize(model) or another Diffusers backend"
            )
        q_heads, kv_heads = query.shape[2], key.shape[2]
        if q_heads != kv_heads and not enable_gqa:
            raise KernelInputError(
                f"attention: query has {q_heads} heads and key/value {kv_heads}; Diffusers passes "
                "enable_gqa=True for grouped-query attention, and SDPA refuses this call too"
            )
        if attn_mask is not None and is_causal:
            raise KernelInputError("attention: attn_mask together with is_causal=True (SDPA too)")
        if is_causal and query.shape[1] != key.shape[1]:
            raise KernelInputError(
                f"attention: is_causal=True with q_len {query.shape[1]} != kv_len "
                f"{key.shape[1]}; SDPA's top-left causal mask for that case is not implemented"
            )
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        if dropout_p > 0.0:
            log.warning(
                "attention: dropout_p=%s > 0 runs torch SDPA (no dropout in the kernel)", dropout_p
            )
            mask = None if attn_mask is None else _sdpa_mask_4d(attn_mask, q.shape[0], k.shape[2])
            out = torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        else:
            out = self._kernel_attention(q, k, v, attn_mask, is_causal, scale)
        return out.transpose(1, 2)

    def _kernel_attention(self, q, k, v, attn_mask, causal, scale):
        """q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D] through the kernel's torch ops."""
        if attn_mask is None:
            return self.kernel.attention_with_lse(q, k, v, causal=causal, scale=scale)[0]
        batch, heads, q_len, kv_len = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        mask = _sdpa_mask_4d(attn_mask, batch, kv_len)
        if mask.dtype == torch.bool and mask.shape[1] == mask.shape[2] == 1:
            kv_mask = mask[:, 0, 0, :].expand(batch, kv_len)  # key padding: the kernel's own mask
            return self.kernel.attention_with_lse(q, k, v, kv_mask, scale=scale)[0]
        m_batch, m_heads = mask.shape[0], mask.shape[1]
        dense = mask.expand(m_batch, heads if m_heads != 1 else 1, q_len, kv_len)
        return self.kernel.attention_with_dense_mask(q, k, v, dense, scale=scale)[0]


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
    if backend not in _SWITCHABLE_BACKENDS and not _backend_name(backend).startswith(
        BACKEND_PREFIX
    ):
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

    def integration(self, kernel: types.ModuleType) -> _Backend:
        if "attention_with_lse" not in kernel.KERNEL.ops:
            raise KernelHubError(f"kernel {kernel.manifest.name} has no attention_with_lse op")
        return _Backend(kernel)

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
