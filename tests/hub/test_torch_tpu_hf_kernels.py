"""Hugging Face ``kernels`` (0.17, its TPU backend) loads a kernel-hub build on a TorchTPU host.

A signed rmsnorm build is published to a local ``kernel-hub serve``; ``kernels.kernelize(...,
device="tpu")`` with ``hub_layer_mapping()`` fetches its ``torch-tpu`` variant (and nothing else),
and every swapped layer, forward and backward, reaches TorchTPU's ``torch.tpu.pallas.jax_op`` on
the stand-in device (torch's lazy device; tests/torch_tpu_helpers.py). The attention build's
``flash_attn_varlen_func`` (what Transformers' hub attention calls) does the same from its
``torch-tpu`` variant.

What stands in beyond the device: ``kernels`` 0.17.2 picks its ``tpu`` backend only when
``torch.backends.tpu`` exists (kernels/backends.py says torch_tpu sets it at import), and
torch-tpu 0.2.0 does not set it on this host, explicitly imported or autoloaded; without it
``kernels`` takes the host for a CPU one and loads ``torch-cpu``, whatever ``kernelize``'s
``device`` says (that only picks the mapping entry). The first test records that gap, so it fails
once torch-tpu sets the attribute and the stand-in attribute below can go.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("torch_tpu", reason="torch-tpu is tested in its own venv (scripts/test.sh)")
pytest.importorskip("kernels")

import kernels
from kernels.backends import CPU, TPU, _backend
from runtime_helpers import lazy_device
from torch_tpu_helpers import install_wrapping_runtime

from kernel_hub.bridge.runtimes import torch_tpu as tpu_runtime
from kernel_hub.layers.integrations.hf_kernels import hub_layer_mapping

from .hub_helpers import cache_dir

HIDDEN = 256
LAYERS = 3


@kernels.use_kernel_forward_from_hub("RMSNorm")
class Norm(torch.nn.Module):
    """Llama's RMSNorm, marked for ``kernels`` as Transformers' decorator would mark it."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
        normed = hidden_states.float() * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * normed.to(hidden_states.dtype)


def test_torch_tpu_0_2_sets_no_torch_backends_tpu_so_kernels_sees_a_cpu_host() -> None:
    import torch_tpu  # noqa: F401

    assert not hasattr(torch.backends, "tpu")
    assert _backend() == CPU()


@pytest.fixture
def recorded_jax_ops(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """Every ``torch.tpu.pallas.jax_op`` made from now on: (name, the op it returned); the
    runtime's op cache starts empty, so each call shape makes its op here."""
    real = torch.tpu.pallas.jax_op
    made: list[tuple[str, object]] = []

    def recording(name, fn, *args, **kwargs):
        op = real(name, fn, *args, **kwargs)
        made.append((name, op))
        return op

    monkeypatch.setattr(torch.tpu.pallas, "jax_op", recording)
    monkeypatch.setattr(tpu_runtime, "_ops", {})
    return made


def test_kernels_loads_the_torch_tpu_variant_and_its_layers_reach_jax_op(
    publish, hub_env, recorded_jax_ops, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from huggingface_hub import constants

    # kernels 0.17.2's User-Agent with telemetry off is refused by huggingface_hub 2.4 (see
    # test_hf_kernels_pinned.py); every request still goes to the local server
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", False)
    # kernels downloads into KERNELS_CACHE as read at its import, else huggingface_hub's default
    # cache (~/.cache): point it at this test's cache instead
    monkeypatch.setattr(kernels.resolver, "CACHE_DIR", str(cache_dir(tmp_path)))
    # what kernels expects torch_tpu to set (see the module docstring)
    monkeypatch.setattr(torch.backends, "tpu", torch.tpu, raising=False)
    assert _backend() == TPU()
    published = publish("1.0.0")
    model = torch.nn.Sequential(*(Norm(HIDDEN, 1e-6) for _ in range(LAYERS)))
    mapping = {"RMSNorm": hub_layer_mapping(trust_remote_code=[published.repo])["RMSNorm"]}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="tpu", use_fallback=False)

    # the torch-tpu variant was chosen, fetched alone, and every norm's forward comes from it
    fetched = [path for method, path in hub_env.requests if method == "GET" and "/build/" in path]
    assert fetched and all("/build/torch-tpu/" in path for path in fetched), fetched
    variants = {p.parent.name for p in cache_dir(tmp_path).rglob("build/*/metadata.json")}
    assert variants == {"torch-tpu"}
    variant_dir = next(cache_dir(tmp_path).rglob("build/torch-tpu"))
    metadata = json.loads((variant_dir / "metadata.json").read_text())
    assert metadata["backend"] == {"type": "tpu"}
    build_id = metadata["id"]  # kernels imports the build under this name
    for norm in model:
        source = Path(inspect.getfile(norm.forward.__func__))
        assert source.is_relative_to(variant_dir), source

    # every swapped layer, forward and backward, runs through TorchTPU's jax_op
    wrapping = install_wrapping_runtime(monkeypatch)
    model.to(lazy_device())
    x = torch.zeros(2, 8, HIDDEN, device=lazy_device(), requires_grad=True)
    model(x).sum().backward()
    roles = [w.key[1] for w in wrapping.wrapped]
    assert roles == ["forward"] * LAYERS + ["backward"] * LAYERS
    ops = {name: op for name, op in recorded_jax_ops}
    assert len(ops) == 2, list(ops)  # one TorchTPU op per role: the call shape repeats
    for wrapped in wrapping.wrapped:
        assert wrapped.tpu_op.custom_op in ops.values()
        assert wrapped.tpu_op.kernel.__name__ in {name.split("::")[1] for name in ops}
        assert wrapped.key[0] == f"{build_id}::rms_norm"  # the op of the torch-tpu build
    assert [tuple(p.grad.shape) for p in model.parameters()] == [(HIDDEN,)] * LAYERS


def test_hub_attention_flash_functions_reach_jax_op_from_the_torch_tpu_variant(
    hub_env, keys, recorded_jax_ops, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What Transformers' hub attention calls (``flash_attn_varlen_func``, from the attention
    build's ``torch-tpu`` variant) on the stand-in device: one TorchTPU op forward and one
    backward, handed the packed sequences as segments and positions computed on the device."""
    from huggingface_hub import constants

    from kernel_hub.hub.publish import publish_kernel
    from kernel_hub.paths import kernels_dir

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", False)  # as in the test above
    monkeypatch.setattr(kernels.resolver, "CACHE_DIR", str(cache_dir(tmp_path)))
    monkeypatch.setattr(torch.backends, "tpu", torch.tpu, raising=False)
    repo = "kernel-hub/attention"
    sign_key = keys["publisher"].private_path
    publish_kernel(kernels_dir() / "attention", repo, sign_key=sign_key, build_dir=tmp_path / "b")
    attention = kernels.get_kernel(repo, version=1, trust_remote_code=True)
    assert Path(attention.__file__).parent.name == "torch-tpu"

    wrapping = install_wrapping_runtime(monkeypatch)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, heads, 16, generator=g) for heads in (4, 2, 2))
    leaves = [x.to(lazy_device()).requires_grad_() for x in (q, k, v)]
    cu = torch.tensor([0, 3, 10], dtype=torch.int32, device=lazy_device())
    out = attention.flash_attn_varlen_func(
        *leaves, cu, cu, 7, 7, causal=True, window_size=(3, 3), softcap=20.0
    )
    out.sum().backward()
    assert [w.key[1] for w in wrapping.wrapped] == ["forward", "backward"]
    assert all(w.key[0].endswith("::attention_with_lse") for w in wrapping.wrapped)
    assert len(recorded_jax_ops) == 2
    # q, k, v, kv_mask, segments, sinks, positions, groups, dropout_seed
    forward = wrapping.wrapped[0].tensors
    for given, x in zip(forward[:3], (q, k, v), strict=True):
        torch.testing.assert_close(given.cpu(), x.transpose(0, 1)[None], rtol=0, atol=0)
    segments = torch.tensor([[0] * 3 + [1] * 7], dtype=torch.int32)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6]], dtype=torch.int32)
    expected = [segments, segments, positions, positions]
    for given, want in zip(forward[4:6] + forward[7:9], expected, strict=True):
        assert torch.equal(given.cpu(), want), given.cpu()
    assert forward[3] is None and forward[6] is None and forward[9:] == [None, None, None]
    assert out.shape == (10, 4, 16) and [x.grad.shape for x in leaves] == [x.shape for x in leaves]
