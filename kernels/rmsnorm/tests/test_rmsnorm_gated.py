"""Gated RMSNorm (``gated_rms_norm``, layers RMSNormGated / RMSNormGatedGrouped): values and
gradients against float64 and against Transformers' own gated norms (both forms, f32 and bf16,
both implementations), the exact probe that recognises the Transformers classes, and errors."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
import torch.nn.functional as F

from kernel_hub import get_kernel
from kernel_hub.errors import KernelInputError, NoImplementationError
from kernel_hub.layers.integrations import transformers as hf
from kernel_hub.testing import max_errors

k = get_kernel("rmsnorm")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
IMPLEMENTATIONS = ["xla", "pallas"]


def oracle(x, gate, weight, eps, norm_before_gate, group=None):
    """float64, no intermediate rounding."""
    x, weight = x.double(), weight.double()
    gate = None if gate is None else gate.double()
    h = x if gate is None or norm_before_gate else x * F.silu(gate)
    group = group or h.shape[-1]
    grouped = h.view(*h.shape[:-1], -1, group)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * grouped.view(h.shape)
    return y * F.silu(gate) if norm_before_gate else y


def stock_module(model_type: str, cls_name: str, hidden: int, **kwargs):
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    norm = getattr(module, cls_name)(hidden, **kwargs)
    with torch.no_grad():
        norm.weight.normal_()
    return norm


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_matches_float64(norm_before_gate, dtype, implementation):
    x, gate = torch.randn(3, 37, 256).to(dtype), torch.randn(3, 37, 256).to(dtype)
    weight = torch.randn(256).to(dtype)
    y = k.gated_rms_norm(x, gate, weight, 1e-6, norm_before_gate, None, implementation)
    want = oracle(x, gate, weight, 1e-6, norm_before_gate)
    abs_err, rel_err = max_errors(y, want)
    scale = max(1.0, float(want.abs().max()))  # bf16 rounds twice (as Transformers does)
    assert abs_err <= TOL[dtype] * scale, f"max abs {abs_err:.3g}, max rel {rel_err:.3g}"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gradients_match_float64(norm_before_gate, implementation):
    inputs = [torch.randn(5, 128), torch.randn(5, 128), torch.randn(128)]
    leaves = [t.clone().requires_grad_() for t in inputs]
    grad = torch.randn(5, 128)
    k.gated_rms_norm(*leaves, 1e-5, norm_before_gate, None, implementation).backward(grad)
    ref = [t.double().requires_grad_() for t in inputs]
    oracle(*ref, 1e-5, norm_before_gate).backward(grad.double())
    for name, got, want in zip(("x", "gate", "weight"), leaves, ref, strict=True):
        abs_err, rel_err = max_errors(got.grad, want.grad)
        assert abs_err <= 1e-4, f"d{name}: max abs {abs_err:.3g}, max rel {rel_err:.3g}"


@pytest.mark.parametrize(
    ("norm_before_gate", "with_gate", "dtype"),
    [(True, True, "bfloat16"), (False, True, "float32"), (False, False, "float32")],
)
def test_pallas_backward_equals_reference_vjp(norm_before_gate, with_gate, dtype):
    """The Pallas backward at 16-row blocks (40 rows: 3 blocks, the last ragged) against jax.vjp
    of the reference: dx, the gate's gradient and the weight's (an f32 weight with bf16 x, as
    Qwen3-Next holds it)."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (40, 256), dtype)
    gate = jax.random.normal(keys[1], (40, 256), dtype) if with_gate else None
    weight = jax.random.normal(keys[2], (256,), jnp.float32)
    grad = jax.random.normal(keys[3], (40, 256), dtype)
    config = k.jax.pallas_tpu.BlockConfig(block_rows=16)
    gated_pallas = importlib.import_module(f"{k.jax.__package__}.gated_pallas")

    def kernel(x, gate, weight):
        return gated_pallas.gated_rms_norm_2d(x, gate, weight, 1e-6, norm_before_gate, config, True)

    def reference(x, gate, weight):
        return k.jax.reference.gated_rms_norm(x, gate, weight, 1e-6, norm_before_gate, None)

    # one jitted program each: run eagerly, each primitive of the backward compiles alone
    @functools.partial(jax.jit, static_argnums=0)
    def vjp(fn, x, gate, weight, grad):
        return jax.vjp(fn, x, gate, weight)[1](grad)

    got = vjp(kernel, x, gate, weight, grad)
    want = vjp(reference, x, gate, weight, grad)
    for name, a, b in zip(("dx", "dgate", "dweight"), got, want, strict=True):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype, name
        abs_err = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        assert abs_err <= 1e-5 * float(jnp.max(jnp.abs(b.astype(jnp.float32)))), name


@pytest.mark.parametrize(
    ("model_type", "cls_name", "layer", "kwargs"),
    [
        ("qwen3_next", "Qwen3NextRMSNormGated", "RMSNormGated", {"eps": 1e-6}),
        ("bamba", "BambaRMSNormGated", "RMSNormGatedGrouped", {"group_size": 64, "eps": 1e-6}),
        ("mamba2", "MambaRMSNormGated", "RMSNormGatedGrouped", {"group_size": 128, "eps": 1e-5}),
    ],
)
def test_layers_equal_transformers_forward_and_gradients(model_type, cls_name, layer, kwargs):
    stock = stock_module(model_type, cls_name, 128, **kwargs)
    assert hf.recognised_layer(type(stock)) == layer
    assert k.KERNEL.module_checks[layer](stock) is None
    layer_cls = k.KERNEL.layers[layer]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 9, 128).to(dtype).requires_grad_()
        gate = torch.randn(2, 9, 128).to(dtype).requires_grad_()
        want = stock(x, gate)
        got = layer_cls.forward(stock, x, gate)  # the platform's default implementation
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
        before = layer == "RMSNormGated"
        group = None if before else stock.group_size
        eps = stock.variance_epsilon
        if group in (None, 128):  # the Pallas kernel normalises whole rows
            pallas = k.gated_rms_norm(x, gate, stock.weight, eps, before, group, "pallas")
            torch.testing.assert_close(pallas, want, rtol=TOL[dtype], atol=TOL[dtype])
        if dtype == torch.float32:
            grad = torch.randn_like(want)
            got_grads = torch.autograd.grad(got, (x, gate, stock.weight), grad)
            want_grads = torch.autograd.grad(want, (x, gate, stock.weight), grad)
            for a, b in zip(got_grads, want_grads, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_probe_leaves_other_gated_forms_alone_with_the_reason():
    falcon = importlib.import_module("transformers.models.falcon_h1.modeling_falcon_h1")
    kimi = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
    verdict = hf.recognise_gated_norm(falcon.FalconH1RMSNormGated)
    assert verdict.layer is None and "reads self.norm_before_gate" in verdict.reason
    verdict = hf.recognise_gated_norm(kimi.KimiLinearRMSNormGated)
    assert verdict.layer is None and "none of the gated forms" in verdict.reason


def test_module_checks_refuse_state_the_layers_do_not_read():
    stock = stock_module("qwen3_next", "Qwen3NextRMSNormGated", 64)
    stock.activation = "gelu"
    assert "activation is 'gelu'" in k.KERNEL.module_checks["RMSNormGated"](stock)
    grouped = stock_module("bamba", "BambaRMSNormGated", 64, group_size=48)
    assert "group_size is 48" in k.KERNEL.module_checks["RMSNormGatedGrouped"](grouped)


def test_bad_inputs_are_refused():
    x, weight = torch.randn(4, 64), torch.randn(64)
    with pytest.raises(KernelInputError, match="gate has shape"):
        k.gated_rms_norm(x, torch.randn(4, 32), weight)
    with pytest.raises(KernelInputError, match="norm_before_gate=True needs a gate"):
        k.gated_rms_norm(x, None, weight)
    with pytest.raises(KernelInputError, match="group_size=48 must divide"):
        k.gated_rms_norm(x, x, weight, 1e-6, False, 48)
    with pytest.raises(NoImplementationError, match="normalises whole rows"):
        k.gated_rms_norm(x, x, weight, 1e-6, False, 32, "pallas")


@pytest.mark.tpu_compile
@pytest.mark.parametrize("generation", ["v4", "v5e", "v6e"])
def test_pallas_compiles_at_qwen3_next_size(generation):
    """The gated norm of Qwen3-Next-80B-A3B's mixer (8k tokens x 32 value heads, rows of 128),
    forward and backward, for TPU generations without a TPU (v4 has the smallest VMEM)."""
    import jax
    import jax.numpy as jnp

    from kernel_hub.bench.cases import KernelCase
    from kernel_hub.bench.compile_check import compile_case

    rows, hidden = 8192 * 32, 128
    rows_struct = jax.ShapeDtypeStruct((rows, hidden), jnp.bfloat16)
    case = KernelCase(
        name="qwen3-next-gated-norm-prefill-8k",
        fn=k.jax.gated_rms_norm,
        args=(rows_struct, rows_struct, jax.ShapeDtypeStruct((hidden,), jnp.float32)),
        kwargs={"eps": 1e-6},
        flops=10 * rows * hidden,
        bytes_accessed=3 * rows * hidden * 2,
        differentiable=(0, 1, 2),
    )
    for direction in ("forward", "backward"):
        result = compile_case("rmsnorm", case, generation, direction, implementation="pallas")
        assert result.ok, f"{generation} {direction}: {result.error}"
