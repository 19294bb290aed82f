"""Helpers for the kernelize tests: throwaway kernels and registries, comparisons."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import torch
import yaml

from kernel_hub.layers.report import KernelizeReport
from kernel_hub.paths import BUILTIN_DIR

TOLERANCE = 1e-4


class TmpHub:
    """A registry file and a kernels directory under a test's tmp_path."""

    def __init__(self, root: Path):
        self.root = root
        self.kernels = root / "kernels"
        self.kernels.mkdir()
        self.registry = root / "registry.yaml"

    def add_kernel(
        self,
        name: str,
        files: dict[str, str],
        *,
        layers: tuple[str, ...] = (),
        version: str = "1.0.0",
    ) -> Path:
        """kernels/<name>/kernel.yaml plus a package made of ``files`` (file name -> source)."""
        package = name.replace("-", "_")
        kernel_dir = self.kernels / name
        (kernel_dir / package).mkdir(parents=True)
        manifest = {
            "name": name,
            "version": version,
            "package": package,
            "ops": [],
            "layers": list(layers),
            "implementations": {"torch": ["tpu", "gpu", "cpu"]},
            "requires": {"kernel-hub": ">=1.3"},
        }
        (kernel_dir / "kernel.yaml").write_text(yaml.safe_dump(manifest))
        for file_name, source in files.items():
            (kernel_dir / package / file_name).write_text(textwrap.dedent(source))
        return kernel_dir

    def copy_in_tree(self, name: str) -> Path:
        """A copy of the in-tree kernel ``kernels/<name>`` (loaded as a separate module)."""
        return shutil.copytree(BUILTIN_DIR / "kernels" / name, self.kernels / name)

    def all_kinds_registry(self) -> Path:
        """In-tree rmsnorm and ragged-attention plus throwaway attention and moe-gemm kernels."""
        self.copy_in_tree("rmsnorm")
        self.copy_in_tree("ragged-attention")
        self.add_kernel("attention", attention_kernel())
        self.add_kernel("moe-gemm", experts_kernel())
        return self.write_registry(
            {
                "rmsnorm": {"layers": ["RMSNorm"], "implementations": {"cpu": ["xla"]}},
                "attention": {},
                "moe-gemm": {},
                "ragged-attention": {"implementations": {"cpu": ["xla"]}},
            }
        )

    def write_registry(self, ops: dict[str, dict]) -> Path:
        """``ops``: op name -> entry fields; kernel, version and implementations have defaults."""
        defaults = {"version": ">=1.0,<2", "implementations": {"cpu": ["torch"]}}
        entries = {op: {"kernel": op, **defaults, **fields} for op, fields in ops.items()}
        self.registry.write_text(yaml.safe_dump({"schema": 1, "ops": entries}))
        return self.registry


def declaring(*, layers: tuple[str, ...] = (), integrations: bool = False) -> str:
    """A throwaway kernel's ``__init__.py``: its ``KERNEL`` (no ops, no JAX) naming ``layers``
    (classes of its ``layers.py``) and, with ``integrations``, its ``integrations.py`` as the
    Transformers adapter (imported with the package, so tests can read its ``CALLS``)."""
    lines = ["from kernel_hub.kernel_api import KernelDeclaration"]
    fields = ["ops={}", "jax=None"]
    if layers:
        lines.append("from . import layers")
        fields.append("layers={" + ", ".join(f"{n!r}: layers.{n}" for n in layers) + "}")
    if integrations:
        lines.append("from . import integrations")
        fields.append('integrations={"transformers": lambda: integrations}')
    return "\n".join([*lines, f"KERNEL = KernelDeclaration({', '.join(fields)})", ""])


def torch_rmsnorm_kernel(
    *, arg: str = "hidden_states", has_backward: bool = True, can_torch_compile: bool = True
) -> dict[str, str]:
    """Files of a pure-torch kernel providing layers.RMSNorm (no JAX), with chosen flags."""
    return {
        "__init__.py": declaring(layers=("RMSNorm",)),
        "layers.py": f"""
            import torch

            class RMSNorm(torch.nn.Module):
                can_torch_compile = {can_torch_compile}
                has_backward = {has_backward}

                def forward(self, {arg}):
                    x = {arg}.float()
                    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
                    return self.weight * x.to({arg}.dtype)
            """,
    }


def assert_registry_fully_used(report: KernelizeReport) -> None:
    """Every candidate the registry has an op for was swapped; something was.

    Continuous batching is inference-only and eager-only by design: in training and
    torch_compile modes it is left alone (ragged-attention's own tests cover it)."""
    mode_bound = ("has no backward", "does not declare can_torch_compile")
    unused = [
        e.line()
        for e in report.left_alone
        if e.op is not None
        and not (e.kind == "continuous batching" and any(m in e.reason for m in mode_bound))
    ]
    assert not unused, "\n".join(unused)
    assert report.swapped


def max_masked_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest |a - b| over the real (unpadded) token positions."""
    return (a - b)[mask.bool()].abs().max().item()


def swapped_modules(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


def attention_kernel(
    *,
    name: str = "kernel_hub_test_attention",
    register_mask: bool = True,
    returns: str | None = None,
    can_torch_compile: bool = True,
    has_backward: bool = True,
) -> dict[str, str]:
    """A kernel whose ``integrations.register()`` adds a counting wrapper of Transformers' SDPA
    attention to AttentionInterface (and SDPA's mask to AttentionMaskInterface)."""
    return {
        "__init__.py": declaring(integrations=True),
        "integrations.py": f"""
            from transformers import AttentionInterface
            from transformers.integrations.sdpa_attention import sdpa_attention_forward
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

            can_torch_compile = {can_torch_compile}
            has_backward = {has_backward}
            module_problem = None
            CALLS = []

            def attention(module, query, key, value, attention_mask, **kwargs):
                CALLS.append(tuple(query.shape))
                return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

            def register(name={name!r}):
                AttentionInterface.register(name, attention)
                if {register_mask}:
                    AttentionMaskInterface.register(name, sdpa_mask)
                return {returns!r} or name
            """,
    }


def experts_kernel(*, name: str = "kernel_hub_test_experts") -> dict[str, str]:
    """A kernel whose ``integrations.register()`` adds a counting wrapper of Transformers'
    grouped_mm experts forward to ExpertsInterface."""
    return {
        "__init__.py": declaring(integrations=True),
        "integrations.py": f"""
            from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

            can_torch_compile = True
            has_backward = True
            module_problem = None
            CALLS = []

            def experts(self, hidden_states, top_k_index, top_k_weights):
                CALLS.append(tuple(hidden_states.shape))
                return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)

            def register(name={name!r}):
                ExpertsInterface.register(name, experts)
                return name
            """,
    }
