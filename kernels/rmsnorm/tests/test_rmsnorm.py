"""rmsnorm: value and gradient parity, the torch op contract, a Llama swap, TPU compiles."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kernel_hub import get_kernel
from kernel_hub.errors import KernelInputError, NoImplementationError
from kernel_hub.kernel_api import tiling
from kernel_hub.models.tiny import tiny_model
from kernel_hub.testing import max_errors, pallas_call_outputs

k = get_kernel("rmsnorm")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def torch_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 oracle, independent of the kernel's own JAX reference."""
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


SHAPES = [(1, 128), (8, 128), (3, 5, 200), (37, 1000), (2, 3, 4, 96), (1, 7)]


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_matches_float64_reference(shape, dtype, implementation):
    x = torch.randn(shape, dtype=dtype) * 3
    weight = torch.randn(shape[-1], dtype=dtype)
    out = k.rms_norm(x, weight, 1e-6, implementation)
    assert out.dtype == dtype and out.shape == x.shape
    abs_err, rel_err = max_errors(out, torch_reference(x, weight, 1e-6))
    scale = float(torch_reference(x, weight, 1e-6).abs().max())
    assert abs_err <= TOL[dtype] * max(1.0, scale), f"max abs {abs_err:.3g}, max rel {rel_err:.3g}"


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_float64_reference(dtype, implementation):
    x = (torch.randn(6, 5, 160) * 2).to(dtype).requires_grad_()
    weight = torch.randn(160).to(dtype).requires_grad_()
    grad_out = torch.randn(6, 5, 160).to(dtype)
    k.rms_norm(x, weight, 1e-5, implementation).backward(grad_out)

    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    torch_reference(x64, w64, 1e-5).backward(grad_out.double())
    for name, got, want in (("dx", x.grad, x64.grad), ("dweight", weight.grad, w64.grad)):
        abs_err, rel_err = max_errors(got, want)
        scale = max(1.0, float(want.abs().max()))
        assert abs_err <= TOL[dtype] * scale, (
            f"{name}: max abs {abs_err:.3g}, max rel {rel_err:.3g}"
        )


@pytest.mark.parametrize("block_rows", [8, 16, 24])
def test_pallas_ragged_row_blocks_match_reference(block_rows):
    """Several grid steps with a partial last block: dweight must ignore the padding rows."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((37, 256)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal(256), jnp.float32)
    g = jnp.asarray(np.random.default_rng(2).standard_normal((37, 256)), jnp.float32)

    def loss(impl, **kw):
        return lambda x, w: jnp.sum(k.jax.rms_norm(x, w, 1e-6, implementation=impl, **kw) * g)

    want_y = k.jax.rms_norm(x, w, 1e-6, implementation="xla")
    got_y = k.jax.rms_norm(x, w, 1e-6, implementation="pallas", block_rows=block_rows)
    np.testing.assert_allclose(got_y, want_y, rtol=1e-5, atol=1e-5)
    # one jitted program each: run eagerly, each primitive of the backward compiles alone
    want = jax.jit(jax.grad(loss("xla"), argnums=(0, 1)))(x, w)
    got = jax.jit(jax.grad(loss("pallas", block_rows=block_rows), argnums=(0, 1)))(x, w)
    for got_part, want_part in zip(got, want, strict=True):
        np.testing.assert_allclose(got_part, want_part, rtol=1e-4, atol=1e-4)


def test_forward_only_program_writes_no_statistics():
    """Inference writes y alone; the forward of a gradient also writes the rows' rstd."""
    x, w = jnp.ones((37, 256), jnp.float32), jnp.ones(256, jnp.float32)

    def norm(x, w):
        return k.jax.rms_norm(x, w, implementation="pallas", block_rows=16)

    assert pallas_call_outputs(norm, x, w) == [("rms_norm_forward", ((37, 256),))]
    grad = jax.grad(lambda x, w: norm(x, w).sum(), argnums=(0, 1))
    forwards = [out for name, out in pallas_call_outputs(grad, x, w) if name == "rms_norm_forward"]
    assert forwards == [((37, 256), (37, 1))]


def test_default_block_fits_budget_and_tiling():
    from_kernel = k.jax.pallas_tpu
    for rows, hidden, dtype in [
        (8192, 4096, jnp.bfloat16),
        (8192, 8192, jnp.float32),
        (5, 64, jnp.float32),
    ]:
        config = from_kernel.default_config(rows, hidden, dtype)
        assert from_kernel.config_problem(rows, dtype, config) is None
        per_row = from_kernel.vmem_bytes_per_row(hidden, jnp.dtype(dtype).itemsize)
        assert config.block_rows == rows or config.block_rows * per_row <= tiling.VMEM_BUDGET_BYTES


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_float64_gradcheck(implementation):
    x = torch.randn(3, 24, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(24, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b: k.rms_norm(a, b, 1e-6, implementation), (x, weight)
    )
    assert not jax.config.jax_enable_x64, "the global x64 flag must stay off"


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_opcheck(implementation):
    x = torch.randn(4, 3, 64, requires_grad=True)
    weight = torch.randn(64, requires_grad=True)
    result = torch.library.opcheck(k.rms_norm.op, (x, weight, 1e-6, implementation))
    assert set(result.values()) == {"SUCCESS"}, result


def test_fullgraph_compile_has_no_graph_break():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(64, 64)
            self.weight = torch.nn.Parameter(torch.randn(64))

        def forward(self, x):
            return self.linear(k.rms_norm(torch.relu(x), self.weight, 1e-6))

    block = Block()
    x = torch.randn(2, 5, 64)
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), block(x))


def test_non_contiguous_and_offset_inputs_are_accepted():
    base = torch.randn(10, 2 * 96)
    x = base[1:, ::2]  # strided and with a storage offset
    weight = torch.randn(200)[3:99]
    out = k.rms_norm(x, weight, 1e-6)
    abs_err, _ = max_errors(out, torch_reference(x, weight, 1e-6))
    assert abs_err < 1e-5


def test_llama_with_kernel_rmsnorm_matches_stock():
    from transformers import LlamaForCausalLM

    model = tiny_model(LlamaForCausalLM)
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        stock = model(ids).logits
        norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
        assert len(norms) == 2 * 2 + 1
        for norm in norms:
            norm.forward = types.MethodType(k.layers.RMSNorm.forward, norm)
        swapped = model(ids).logits
    abs_err, _ = max_errors(swapped, stock)
    assert abs_err <= 1e-4, f"max abs logit difference {abs_err:.3g}"


class TestBadInputs:
    def test_wrong_dtype(self):
        with pytest.raises(KernelInputError, match="x has dtype int64; supported: float32"):
            k.rms_norm(torch.ones(2, 8, dtype=torch.int64), torch.ones(8), 1e-6)

    def test_mismatched_weight(self):
        with pytest.raises(
            KernelInputError, match=r"weight has shape \(7,\).*must have shape \(8,\)"
        ):
            k.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-6)

    def test_scalar_input(self):
        with pytest.raises(KernelInputError, match="x must have rank 1 to 8"):
            k.rms_norm(torch.tensor(1.0), torch.ones(1), 1e-6)

    def test_unknown_implementation_suggests(self):
        with pytest.raises(KeyError, match="Did you mean 'pallas'"):
            k.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6, "palas")

    def test_illegal_block_is_refused_with_reason(self):
        x = jnp.ones((40, 128), jnp.float32)
        with pytest.raises(NoImplementationError, match="block_rows=12 must equal rows"):
            k.jax.rms_norm(x, jnp.ones(128), implementation="pallas", block_rows=12)

    def test_cuda_tensor_on_cpu_only_host(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        from kernel_hub.errors import UnsupportedDeviceError

        assert not torch.cuda.is_available()
        with FakeTensorMode(), pytest.raises(UnsupportedDeviceError, match="no gpu backend"):
            k.rms_norm(torch.ones(2, 8, device="cuda"), torch.ones(8, device="cuda"), 1e-6)

    def test_mixed_devices(self):
        from kernel_hub.errors import UnsupportedDeviceError

        with pytest.raises(UnsupportedDeviceError, match="one device"):
            k.rms_norm(torch.ones(2, 8), torch.ones(8, device="meta"), 1e-6)
