"""``kernel-hub build`` output: layout, metadata, digests; loadable by Hugging Face ``kernels``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kernel_hub.errors import KernelHubError
from kernel_hub.hub.build import build_kernel
from kernel_hub.hub.digests import hash_tree
from kernel_hub.hub.metadata import read_metadata
from kernel_hub.loading.loader import load_kernel_dir
from kernel_hub.registry.manifest import load_manifest

from .hub_helpers import RMSNORM


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    source = tmp_path_factory.mktemp("src") / "rmsnorm"
    shutil.copytree(RMSNORM, source, ignore=shutil.ignore_patterns("build"))
    (source / "rmsnorm" / "__pycache__").mkdir(exist_ok=True)
    (source / "rmsnorm" / "__pycache__" / "api.cpython-311.pyc").write_bytes(b"stale bytecode")
    return build_kernel(source)


def test_build_layout_metadata_and_digests(build):
    assert sorted(p.name for p in build.path.iterdir()) == ["torch-cpu", "torch-tpu"]
    for name, variant_dir in ((n, build.path / n) for n in build.variants):
        files = sorted(p.relative_to(variant_dir).as_posix() for p in variant_dir.rglob("*"))
        assert "metadata.json" in files and "kernel.yaml" in files
        assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]
        metadata = read_metadata(variant_dir)
        source = load_manifest(RMSNORM)  # what the build must state: the in-tree manifest
        assert (metadata.name, metadata.version, metadata.variant) == (
            "rmsnorm",
            source.version,
            name,
        )
        assert metadata.ops == source.ops == ("rms_norm", "gated_rms_norm")
        assert metadata.layers == source.layers
        assert metadata.layers[:5] == (
            "RMSNorm",
            "RMSNormF32Scale",
            "RMSNormZeroCentered",
            "TorchRMSNorm",
            "DiffusersRMSNorm",
        )
        assert dict(metadata.digest) == hash_tree(variant_dir)
        assert {"jax", "torch"} <= set(metadata.requires)
        manifest = load_manifest(variant_dir)  # kernel-hub's loader reads this manifest
        assert ("libtpu" in manifest.requires) == name.endswith("-tpu")
        raw = json.loads((variant_dir / "metadata.json").read_text())
        assert raw["version"] == 1 and raw["python-depends"] == []
        assert raw["backend"]["type"] == ("tpu" if name.endswith("-tpu") else "cpu")


def test_metadata_and_digest_agree_with_kernels_package(build):
    from kernels._rust import Digest, DigestAlgorithm, Metadata
    from kernels.variants import NoarchVariant, parse_variant

    for name in build.variants:
        # a name kernels cannot parse is logged as an invalid build variant on every load
        parsed = parse_variant(name)
        assert isinstance(parsed, NoarchVariant) and parsed.variant_str == name
        variant_dir = build.path / name
        theirs = Metadata.read_from_file(variant_dir / "metadata.json")
        assert str(theirs.name) == "rmsnorm" and theirs.version == 1
        # kernels' own check of a variant against the digest in its metadata
        theirs.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, variant_dir))


def test_failed_build_keeps_the_previous_one(build, tmp_path):
    source = tmp_path / "rmsnorm"
    shutil.copytree(RMSNORM, source, ignore=shutil.ignore_patterns("build"))
    good = build_kernel(source)
    before = hash_tree(good.path / "torch-cpu", with_metadata=True)
    (source / "rmsnorm" / "__init__.py").unlink()
    with pytest.raises(KernelHubError, match=r"has no __init__\.py"):
        build_kernel(source)
    assert hash_tree(good.path / "torch-cpu", with_metadata=True) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_build_variant_loads_with_kernel_hub_loader(build):
    module = load_kernel_dir(build.path / "torch-cpu")
    x, weight = torch.randn(3, 16), torch.rand(16)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    torch.testing.assert_close(module.rms_norm(x, weight), expected, rtol=1e-5, atol=1e-5)


def test_hugging_face_kernels_loads_build_and_kernelizes_layer(build, hub_env):
    import kernels
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_forward_from_hub

    module = kernels.get_local_kernel(build.path / "torch-cpu")
    x, weight = torch.randn(2, 5, 16), torch.rand(16) + 0.5
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    torch.testing.assert_close(module.rms_norm(x, weight, 1e-5), expected, rtol=1e-5, atol=1e-5)

    calls = []

    @use_kernel_forward_from_hub("RMSNorm")
    class TinyRMSNorm(torch.nn.Module):
        def __init__(self, hidden: int):
            super().__init__()
            self.weight = torch.nn.Parameter(weight.clone())
            self.variance_epsilon = 1e-5

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return hidden_states  # wrong on purpose: only the kernel's forward gives the norm

    model = torch.nn.Sequential(torch.nn.Identity(), TinyRMSNorm(16))
    mapping = {"RMSNorm": {"cpu": LocalLayerRepository(repo_path=build.path, layer_name="RMSNorm")}}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(model, mode=Mode.INFERENCE, device="cpu", use_fallback=False)
    with torch.no_grad():
        out = model(x)
    assert calls == []
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert hub_env.requests == []  # all of it offline (hub_env would catch any hub call)
