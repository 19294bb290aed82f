"""``layers.ApplyRotaryPosEmb``, the ``rotary_pos_emb`` slot as Hugging Face ``kernels`` loads it:
Llama's ``apply_rotary_pos_emb`` in both layouts and dtypes, forward and gradients, and a clear
refusal of the half-width cos/sin it does not serve."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kernel_hub import get_kernel
from kernel_hub.kernel_api import KernelInputError


@pytest.fixture(scope="module")
def layer():
    return get_kernel("rotary").layers.ApplyRotaryPosEmb()


def _inputs(unsqueeze_dim: int, dtype: torch.dtype, width: int = 16):
    g = torch.Generator().manual_seed(0)
    shape_q, shape_k = ((2, 4, 6, 16), (2, 2, 6, 16))
    if unsqueeze_dim == 2:
        shape_q, shape_k = ((2, 6, 4, 16), (2, 6, 2, 16))
    q, k = (torch.randn(s, generator=g).to(dtype).requires_grad_() for s in (shape_q, shape_k))
    angles = torch.randn(2, 6, width // 2, generator=g)
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin))
    return q, k, cos, sin


@pytest.mark.parametrize(
    ("unsqueeze_dim", "dtype"), [(1, torch.float32), (2, torch.bfloat16)], ids=["1-f32", "2-bf16"]
)
def test_layer_is_llamas_apply_rotary_pos_emb(layer, unsqueeze_dim, dtype) -> None:
    q, k, cos, sin = _inputs(unsqueeze_dim, dtype)
    got = layer(q, k, cos, sin, unsqueeze_dim)
    want = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)
    cotangents = [torch.randn_like(x) for x in want]
    grads = torch.autograd.grad(got, (q, k), cotangents)
    expected = torch.autograd.grad(want, (q, k), cotangents)
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b, **tol)


def test_half_width_cos_is_refused(layer) -> None:
    q, k, cos, sin = _inputs(1, torch.float32, width=8)
    with pytest.raises(KernelInputError, match="cos/sin are 8 wide for a head dim of 16"):
        layer(q, k, cos, sin)
