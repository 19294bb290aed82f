"""layernorm: value and gradient parity, the torch op contract, layer swaps, TPU compiles."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kernel_hub import get_kernel
from kernel_hub.errors import KernelInputError, NoImplementationError
from kernel_hub.kernel_api import tiling
from kernel_hub.testing import max_errors, pallas_call_outputs

k = get_kernel("layernorm")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
AFFINES = ["weight+bias", "weight", "none", "bias"]


def torch_reference(x, weight, bias, eps):
    """float64 oracle, independent of the kernel's own JAX reference."""
    x64 = x.double()
    mean = x64.mean(-1, keepdim=True)
    var = (x64 - mean).pow(2).mean(-1, keepdim=True)
    y = (x64 - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y


def params(affine, hidden, dtype, requires_grad=False):
    weight = torch.randn(hidden).to(dtype) if "weight" in affine else None
    bias = torch.randn(hidden).to(dtype) if "bias" in affine else None
    for p in (weight, bias):
        if p is not None:
            p.requires_grad_(requires_grad)
    return weight, bias


SHAPES = [(1, 128), (8, 128), (3, 5, 200), (37, 1000), (2, 3, 4, 96), (1, 7)]


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_matches_float64_reference(shape, dtype, implementation):
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    weight, bias = params("weight+bias", shape[-1], dtype)
    out = k.layer_norm(x, weight, bias, 1e-5, implementation)
    want = torch_reference(x, weight, bias, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    abs_err, rel_err = max_errors(out, want)
    scale = max(1.0, float(want.abs().max()))
    assert abs_err <= TOL[dtype] * scale, f"max abs {abs_err:.3g}, max rel {rel_err:.3g}"


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", AFFINES)
def test_gradients_match_float64_reference(affine, dtype, implementation):
    x = (torch.randn(6, 5, 160) * 2 + 0.5).to(dtype).requires_grad_()
    weight, bias = params(affine, 160, dtype, requires_grad=True)
    grad_out = torch.randn(6, 5, 160).to(dtype)
    out = k.layer_norm_any(x, weight, bias, 1e-5, implementation)
    assert out.dtype == dtype
    abs_err, _ = max_errors(out.detach(), torch_reference(x, weight, bias, 1e-5).detach())
    assert abs_err <= TOL[dtype] * 4
    out.backward(grad_out)

    leaves = {"dx": x, "dweight": weight, "dbias": bias}
    leaves = {name: t for name, t in leaves.items() if t is not None}
    copies = {name: t.detach().double().requires_grad_() for name, t in leaves.items()}
    torch_reference(copies["dx"], copies.get("dweight"), copies.get("dbias"), 1e-5).backward(
        grad_out.double()
    )
    for name, leaf in leaves.items():
        want = copies[name].grad
        abs_err, rel_err = max_errors(leaf.grad, want)
        scale = max(1.0, float(want.abs().max()))
        assert abs_err <= TOL[dtype] * scale, f"{name}: max abs {abs_err:.3g}, rel {rel_err:.3g}"


@pytest.mark.parametrize("affine", ["weight+bias", "none"])
@pytest.mark.parametrize("block_rows", [8, 24])
def test_pallas_ragged_row_blocks_match_reference(block_rows, affine):
    """Several grid steps with a partial last block: the partial sums must skip padding rows."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((37, 256)) + 2.0, jnp.float32)
    g = jnp.asarray(rng.standard_normal((37, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(256), jnp.float32) if affine != "none" else None
    b = jnp.asarray(rng.standard_normal(256), jnp.float32) if affine != "none" else None

    def loss(impl, **kw):
        return lambda x, w, b: jnp.sum(k.jax.layer_norm(x, w, b, implementation=impl, **kw) * g)

    want_y = k.jax.layer_norm(x, w, b, implementation="xla")
    got_y = k.jax.layer_norm(x, w, b, implementation="pallas", block_rows=block_rows)
    np.testing.assert_allclose(got_y, want_y, rtol=1e-5, atol=1e-5)
    # one jitted program each: run eagerly, each primitive of the backward compiles alone
    want = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(x, w, b)
    got = jax.jit(jax.grad(loss("pallas", block_rows=block_rows), argnums=(0, 1, 2)))(x, w, b)
    for got_part, want_part in zip(got, want, strict=True):
        assert (got_part is None) == (want_part is None)
        if want_part is not None:
            np.testing.assert_allclose(got_part, want_part, rtol=1e-4, atol=1e-4)


def test_forward_only_program_writes_no_statistics():
    """Inference writes y alone; the forward of a gradient also writes the rows' mean and rstd."""
    x, w = jnp.ones((37, 256), jnp.float32), jnp.ones(256, jnp.float32)

    def norm(x, w):
        return k.jax.layer_norm(x, w, w, implementation="pallas", block_rows=16)

    assert pallas_call_outputs(norm, x, w) == [("layer_norm_forward", ((37, 256),))]
    grad = jax.grad(lambda x, w: norm(x, w).sum(), argnums=(0, 1))
    forwards = [
        out for name, out in pallas_call_outputs(grad, x, w) if name == "layer_norm_forward"
    ]
    assert forwards == [((37, 256), (37, 1), (37, 1))]


def test_default_block_fits_budget_and_tiling():
    pallas_tpu = k.jax.pallas_tpu
    for rows, hidden, dtype in [(4096, 1024, jnp.bfloat16), (4608, 3072, jnp.float32)]:
        config = pallas_tpu.default_config(rows, hidden, dtype)
        assert pallas_tpu.config_problem(rows, dtype, config) is None
        per_row = pallas_tpu.vmem_bytes_per_row(hidden, jnp.dtype(dtype).itemsize)
        assert config.block_rows * per_row <= tiling.VMEM_BUDGET_BYTES


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_float64_gradcheck(implementation):
    x = torch.randn(3, 24, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(24, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(24, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, w, b: k.layer_norm(a, w, b, 1e-5, implementation), (x, weight, bias)
    )
    assert not jax.config.jax_enable_x64, "the global x64 flag must stay off"


@pytest.mark.parametrize(
    ("op", "n_params"), [("layer_norm", 2), ("layer_norm_no_bias", 1), ("layer_norm_no_affine", 0)]
)
def test_opcheck(op, n_params):
    x = torch.randn(4, 3, 64, requires_grad=True)
    extra = [torch.randn(64, requires_grad=True) for _ in range(n_params)]
    result = torch.library.opcheck(getattr(k, op).op, (x, *extra, 1e-5, "pallas"))
    assert set(result.values()) == {"SUCCESS"}, result


def test_fullgraph_compile_forward_and_backward():
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    layer_norm = block[1]
    layer_norm.forward = types.MethodType(k.layers.LayerNorm.forward, layer_norm)
    x = torch.randn(2, 5, 64)
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    eager_out = block(x)
    eager_out.square().sum().backward()
    eager_grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    compiled_out = compiled(x)
    compiled_out.square().sum().backward()
    torch.testing.assert_close(compiled_out, eager_out)
    for got, want in zip((p.grad for p in block.parameters()), eager_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_non_contiguous_inputs_are_accepted():
    x = torch.randn(10, 2 * 96)[1:, ::2]
    weight, bias = torch.randn(200)[3:99], torch.randn(96)
    abs_err, _ = max_errors(
        k.layer_norm(x, weight, bias, 1e-5), torch_reference(x, weight, bias, 1e-5)
    )
    assert abs_err < 1e-5


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.nn.LayerNorm(48),
        lambda: torch.nn.LayerNorm(48, bias=False),
        lambda: torch.nn.LayerNorm(48, elementwise_affine=False, eps=1e-6),
        lambda: torch.nn.LayerNorm((6, 8)),
    ],
    ids=["affine", "no-bias", "no-affine", "2d-shape"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_matches_torch_layernorm(make, dtype):
    torch.manual_seed(0)
    stock = make().to(dtype)
    with torch.no_grad():
        for p in stock.parameters():
            p.normal_()
    assert k.layers.MODULE_CHECKS["LayerNorm"](stock) is None
    x = (torch.randn(3, 5, 48) * 2 + 1).to(dtype).reshape(3, 5, *stock.normalized_shape)
    swapped = types.MethodType(k.layers.LayerNorm.forward, stock)
    got, want = swapped(x), stock(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    abs_err, _ = max_errors(got, want)
    assert abs_err <= TOL[dtype] * 4, abs_err


@pytest.mark.parametrize("lead", [(2, 5), (4,)], ids=["padded-rows-and-lead-dims", "exact-rows"])
def test_layer_output_may_be_modified_in_place_in_training(lead):
    """XLM scales its LayerNorm output by the padding mask in place (``tensor *= mask``): the
    swapped layer's output must allow that and give stock's output and gradients (the bridge
    saves no output for the derived backward; the layer makes no copy)."""
    torch.manual_seed(0)
    stock = torch.nn.LayerNorm(48)
    with torch.no_grad():
        stock.weight.normal_()
        stock.bias.normal_()
    swapped = types.MethodType(k.layers.LayerNorm.forward, stock)
    x = torch.randn(*lead, 48, requires_grad=True)
    mask = (torch.arange(lead[-1]) < 3).float()[:, None]
    results = []
    for forward in (swapped, stock):
        stock.zero_grad()
        x.grad = None
        y = forward(x)
        y *= mask
        y.square().sum().backward()
        results.append([y.detach(), x.grad, stock.weight.grad.clone(), stock.bias.grad.clone()])
    for got, want in zip(*results, strict=True):
        abs_err, _ = max_errors(got, want)
        assert abs_err <= 1e-4, abs_err


def test_module_check_says_why():
    check = k.layers.MODULE_CHECKS["LayerNorm"]
    odd = torch.nn.LayerNorm(8)
    odd.weight = torch.nn.Parameter(torch.ones(4))
    assert "weight has shape (4,)" in check(odd)
    assert "meta device" in check(torch.nn.LayerNorm(8, device="meta"))
    eps_none = torch.nn.LayerNorm(8)
    eps_none.eps = None
    assert "eps is None" in check(eps_none)


class TestBadInputs:
    def test_wrong_dtype(self):
        with pytest.raises(KernelInputError, match="x has dtype int64; supported: float32"):
            k.layer_norm_no_affine(torch.ones(2, 8, dtype=torch.int64), 1e-5)

    def test_mismatched_bias(self):
        with pytest.raises(KernelInputError, match=r"bias has shape \(7,\).*shape \(8,\) or be"):
            k.layer_norm(torch.ones(2, 8), torch.ones(8), torch.ones(7), 1e-5)

    def test_scalar_input(self):
        with pytest.raises(KernelInputError, match="x must have rank 1 to 8"):
            k.layer_norm_no_affine(torch.tensor(1.0), 1e-5)

    def test_illegal_block_is_refused_with_reason(self):
        x = jnp.ones((40, 128), jnp.float32)
        with pytest.raises(NoImplementationError, match="block_rows=12 must equal rows"):
            k.jax.layer_norm(x, implementation="pallas", block_rows=12)


@pytest.mark.tpu_compile
def test_oversized_block_is_a_vmem_failure_on_v4():
    from kernel_hub.bench.compile_check import compile_case

    case = dataclasses.replace(
        k.benchmark.case("oversized", 8192, 4096), kwargs={"eps": 1e-5, "block_rows": 4096}
    )
    result = compile_case("layernorm", case, "v4")
    assert not result.ok and result.vmem_overflow, result.error
