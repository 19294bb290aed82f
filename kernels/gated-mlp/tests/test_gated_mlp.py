"""gated-mlp: values and gradients vs float64 torch (Pallas interpret mode at TPU block sizes,
several blocks per axis), both layouts, every activation; the torch op contract; the MLP probe
(forms recognised, near misses refused) and tiny models in training matching stock."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from kernel_hub import get_kernel, kernel_mapping
from kernel_hub.errors import KernelInputError
from kernel_hub.layers.integrations import transformers as hf
from kernel_hub.layers.kernelize import kernelize

k = get_kernel("gated-mlp")
REFERENCE = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh"),
}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# 40 rows in blocks of 16 (ragged), 384 features in blocks of 128: three blocks per axis.
ROWS, FEATURES = 40, 384
BLOCKS = {"block_rows": 16, "block_cols": 128}


def _output_and_vjp(fn, cotangent, *args):
    """fn(*args) and its vjp at cotangent as one jitted program (run eagerly, each primitive of
    the kernel and its backward would compile alone)."""
    import jax

    @jax.jit
    def run(cotangent, *args):
        out, pullback = jax.vjp(fn, *args)
        return out, pullback(cotangent)

    return run(cotangent, *args)


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("activation", list(REFERENCE))
def test_values_and_gradients_match_float64(activation, fused, dtype, implementation):
    api = k.KERNEL.jax
    import jax.numpy as jnp
    import numpy as np

    torch.manual_seed(0)
    gate = (torch.randn(ROWS, FEATURES) * 3).to(dtype)
    up = torch.randn(ROWS, FEATURES).to(dtype)
    dy = torch.randn(ROWS, FEATURES).to(dtype)
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    want = REFERENCE[activation](g64) * u64
    want.backward(dy.double())

    def j(t):
        return jnp.asarray(t.float().numpy(), jnp.float32 if dtype == torch.float32 else "bfloat16")

    options = dict(implementation=implementation, **BLOCKS)
    if fused:
        x = jnp.concatenate([j(gate), j(up)], axis=1)
        out, (dx,) = _output_and_vjp(
            lambda x: api.gated_activation(x, None, activation, **options), j(dy), x
        )
        d_gate, d_up = dx[:, :FEATURES], dx[:, FEATURES:]
    else:
        out, (d_gate, d_up) = _output_and_vjp(
            lambda g, u: api.gated_activation(g, u, activation, **options), j(dy), j(gate), j(up)
        )
    tol = TOL[dtype]
    for name, got, expected in (
        ("out", out, want.detach()),
        ("d_gate", d_gate, g64.grad),
        ("d_up", d_up, u64.grad),
    ):
        got = np.asarray(got.astype(jnp.float32), np.float64)
        scale = max(1.0, float(expected.abs().max()))
        err = np.abs(got - expected.numpy()).max()
        assert err <= tol * scale, f"{name}: max abs error {err:.3g}"


def test_opcheck_and_fullgraph_compile():
    gate = torch.randn(2, 5, 256, requires_grad=True)
    up = torch.randn(2, 5, 256, requires_grad=True)
    result = torch.library.opcheck(k.gated_activation.op, (gate, up, "gelu_tanh", "pallas"))
    assert all(v == "SUCCESS" for v in result.values()), result
    fn = torch.compile(
        lambda g, u: k.gated_activation(g, u, "silu"), fullgraph=True, backend="aot_eager"
    )
    torch.testing.assert_close(fn(gate, up), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize(
    "option, match",
    [
        ({"activation": "relu"}, "activation='relu'; valid: silu, gelu, gelu_tanh"),
        ({"up": torch.randn(3, 5)}, "gate has shape"),
    ],
)
def test_errors_name_what_is_valid(option, match):
    arguments = {"x": torch.randn(3, 4), "up": torch.randn(3, 4), "activation": "silu"} | option
    with pytest.raises(KernelInputError, match=match):
        k.gated_activation(arguments["x"], arguments["up"], arguments["activation"])


def test_fused_odd_width_is_refused():
    with pytest.raises(KernelInputError, match="odd last dimension"):
        k.gated_activation(torch.randn(3, 5), None)


# -- the MLP probe and models ---------------------------------------------------------------

TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
}
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "GatedMLP"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, "GatedMLP"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16}, "GatedMLP"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, "FusedGatedMLP"),
}


def tiny(name: str) -> torch.nn.Module:
    config_name, model_name, extra, _ = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**TINY, **extra)
    return getattr(transformers, model_name)(config).train()


@pytest.mark.parametrize("name", list(MODELS))
def test_model_mlps_swapped_and_training_matches_stock(name):
    """Only the gated-mlp swap (the other ops off): loss and every gradient as stock."""
    model = tiny(name)
    stock = copy.deepcopy(model)
    others = {
        op: "off" for op in ("rmsnorm", "attention", "ragged-attention", "linear-cross-entropy")
    }
    with kernel_mapping(others):
        report = kernelize(model, device="cpu")
    mlps = [e for e in report.entries if e.target == MODELS[name][3]]
    assert len(mlps) == 2 and all(e.swapped for e in mlps), [e.line() for e in mlps]
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    want = stock(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    want.loss.backward()
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=0)
    for (n, p), q in zip(model.named_parameters(), stock.parameters(), strict=True):
        err = float((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12))
        assert err <= 1e-5, f"{n}: {err:.3g}"


def test_near_miss_mlp_is_refused_with_reason():
    class BiasedMLP(torch.nn.Module):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) + 1.0)

    class SwappedHalvesMLP(torch.nn.Module):
        def forward(self, hidden_states):
            up, gate = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
            return self.down_proj(up * self.activation_fn(gate))

    for cls in (BiasedMLP, SwappedHalvesMLP):
        cls.__module__ = "transformers.models.fake.modeling_fake"
        assert hf.is_gated_mlp_candidate(cls)
        recognition = hf.recognise_gated_mlp(cls)
        assert recognition.layer is None and "differs from" in recognition.reason


def test_unknown_activation_is_left_alone():
    model = tiny("llama")
    model.model.layers[0].mlp.act_fn = torch.nn.ReLU()
    report = kernelize(model, device="cpu")
    entry = next(e for e in report.entries if e.module == "model.layers.0.mlp")
    assert not entry.swapped and "its activation is ReLU" in entry.reason
