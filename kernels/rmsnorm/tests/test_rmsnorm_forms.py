"""The norm forms (``weight_offset``, ``rounding``) against the torch formulas the model families
use: same dtype, bf16 bit for bit, f32 to float rounding; gradients; refusals; TPU compiles."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernel_hub import get_kernel
from kernel_hub.errors import KernelInputError

k = get_kernel("rmsnorm")
EPS = 1e-5


def _normalized(x: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)


FORMS = {  # name -> (weight_offset, rounding, the formula as Transformers writes it)
    "llama": (0.0, "normalized", lambda x, w: w * _normalized(x).to(x.dtype)),
    "gpt-oss/olmo2": (0.0, "input", lambda x, w: (w * _normalized(x)).to(x.dtype)),
    "gemma": (1.0, "input", lambda x, w: (_normalized(x) * (1.0 + w.float())).to(x.dtype)),
}
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16),
]


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=str)
@pytest.mark.parametrize("form", FORMS)
def test_forms_match_their_formula(form, dtypes, implementation):
    offset, rounding, formula = FORMS[form]
    x = (torch.randn(3, 7, 96) * 2).to(dtypes[0])
    weight = torch.randn(96).to(dtypes[1])
    expected = formula(x, weight)
    out = k.rms_norm(x, weight, EPS, implementation, offset, rounding)
    assert out.dtype == expected.dtype
    if out.dtype == torch.bfloat16:
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, rtol=0, atol=4e-6 * float(expected.abs().max()))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("form", FORMS)
def test_form_gradients_match_autograd_of_the_formula(form, implementation):
    offset, rounding, formula = FORMS[form]
    x = torch.randn(5, 64, requires_grad=True)
    weight = (torch.randn(64) * 0.5).requires_grad_()
    grad = torch.randn(5, 64)
    k.rms_norm(x, weight, EPS, implementation, offset, rounding).backward(grad)
    x_ref, w_ref = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    formula(x_ref, w_ref).backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, w_ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_zero_centered_float64_gradcheck(implementation):
    x = torch.randn(3, 24, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(24, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b: k.rms_norm(a, b, 1e-6, implementation, 1.0, "input"), (x, weight)
    )


def test_opcheck_with_form_arguments():
    x = torch.randn(4, 3, 64, requires_grad=True)
    weight = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    result = torch.library.opcheck(k.rms_norm.op, (x, weight, 1e-6, None, 1.0, "input"))
    assert set(result.values()) == {"SUCCESS"}, result


def test_bad_form_arguments_are_refused_with_the_valid_choices():
    x, weight = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(KernelInputError, match="rounding='last'; valid: promoted, input"):
        k.rms_norm(x, weight, 1e-6, None, 0.0, "last")
    with pytest.raises(KernelInputError, match="weight_offset=True"):
        k.jax.rms_norm(x.numpy(), weight.numpy(), weight_offset=True)


@pytest.mark.tpu_compile
@pytest.mark.parametrize("form", ["llama", "gemma"])
def test_forms_compile_for_every_tpu_generation(form):
    from kernel_hub.bench.compile_check import compile_matrix

    offset, rounding, _ = FORMS[form]
    base = next(c for c in k.benchmark.CASES if c.name == "prefill-8k-h4096")
    case = dataclasses.replace(
        base,
        name=f"{base.name}-{form}",
        kwargs={**base.kwargs, "weight_offset": offset, "rounding": rounding},
    )
    results = compile_matrix("rmsnorm", [case])
    failed = [(r.generation, r.case, r.direction, r.error) for r in results if not r.ok]
    assert not failed
    assert {r.generation for r in results} == {"v4", "v5e", "v5p", "v6e"}
