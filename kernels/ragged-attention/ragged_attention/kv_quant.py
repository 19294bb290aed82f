"""The 8-bit KV cache format: what a quantized cached key or value stands for.

A cached token's key (or value) of kv head ``h`` is ``D`` 8-bit numbers ``q`` and one f32 scale
``s`` (per token and kv head): it stands for ``q * s``. The scale is set when the token is
written (``quantize``: the row's largest magnitude maps to the format's largest value), so
quantizing needs no calibration and no later rescaling. A row of zeros has scale 1.

Why per token and head: a cache page is written one token at a time during decode, so a scale
shared by a page (or by all of a head's tokens) would be fixed before the values it must cover
exist (clipping later ones, or requantizing the page). Per row, the error of each element is at
most half a step of its own row: e4m3 keeps 3 mantissa bits (relative error <= 2**-4), int8 a
step of max|row| / 127. The scales cost 4 bytes per D bytes of 8-bit data (3.1% at D = 128).

``float8_e4m3fn`` and ``int8`` are the cache dtypes (``KV_CACHE_DTYPES``). ``quantize`` runs in
torch (the cache write); ``dequantize`` is what the values stand for, in JAX (the XLA
references; the Pallas kernels apply the same scales on the score side).
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from kernel_hub.kernel_api import KernelInputError

KV_CACHE_DTYPES = ("float8_e4m3fn", "int8")
"""The 8-bit cache dtypes, by name."""
SCALE_DTYPE = "float32"
_LARGEST = {"float8_e4m3fn": 448.0, "int8": 127.0}


def kv_cache_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of an 8-bit cache named ``name``; any other value is refused."""
    key = str(name).removeprefix("torch.")
    if key not in _LARGEST:
        raise KernelInputError(
            f"kv_cache_dtype={name!r} is not an 8-bit KV cache dtype; valid: "
            f"{', '.join(KV_CACHE_DTYPES)} (None keeps the model's dtype)"
        )
    return getattr(torch, key)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] in ``dtype``, scales f32 [...]): one scale per row."""
    largest = _LARGEST[str(dtype).removeprefix("torch.")]
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / largest, torch.ones_like(amax))
    y = x / scale[..., None]
    if dtype == torch.int8:
        y = y.round()
    return y.clamp(-largest, largest).to(dtype), scale


def dequantize(values, scales, dtype):
    """``values [..., D] * scales [...]`` in f32 (f64 for f64), rounded once to ``dtype``."""
    acc = jnp.promote_types(dtype, jnp.float32)
    return (values.astype(acc) * scales.astype(acc)[..., None]).astype(dtype)


def is_quantized(dtype) -> bool:
    """Whether ``dtype`` (torch or JAX) is one of the 8-bit cache dtypes."""
    return str(dtype).removeprefix("torch.") in _LARGEST
