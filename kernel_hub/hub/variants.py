"""Build variants: which framework and backend a build targets, and which one fits this machine.

Names are Hugging Face ``kernels``' noarch variants (``torch-tpu``, ``torch-cpu``): ``kernels``
parses a build folder's name as ``torch-<backend>`` (or a compiled ``torchXY-...`` / ``tvm-ffi...``
name) and logs every other one as an invalid build variant on each load, so there is no JAX-only
variant. JAX users load the same ones: every variant holds the same package (a kernel's
``__init__`` exports the torch ops and the JAX API together, and its manifest requires both jax
and torch); they differ in backend, requirements and the implementations that run there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kernel_hub.errors import HubError
from kernel_hub.platform import Platform


@dataclass(frozen=True)
class Variant:
    name: str
    framework: str
    """The framework ``kernels`` reads from the name (``torch``), written to metadata.json."""
    backend: str
    """``kernels`` backend type written to metadata.json (``cpu``, ``tpu``)."""
    platforms: tuple[Platform, ...]
    """Host platforms this variant serves; the first is the one its implementations target."""
    extra_requires: Mapping[str, str] = field(default_factory=dict)
    """Distributions required on top of the kernel manifest's ``requires``."""


# Preference order when picking one for a host.
VARIANTS: tuple[Variant, ...] = (
    Variant("torch-tpu", "torch", "tpu", ("tpu",), {"libtpu": ""}),
    # The CPU build carries the portable XLA implementation, which JAX also runs on GPU hosts.
    Variant("torch-cpu", "torch", "cpu", ("cpu", "gpu")),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)


def get_variant(name: str) -> Variant:
    for variant in VARIANTS:
        if variant.name == name:
            return variant
    raise HubError(f"unknown build variant {name!r}; valid variants: {', '.join(VARIANT_NAMES)}")


def select_variant(
    available: Iterable[str], platform: Platform, requested: str | None = None
) -> Variant:
    """The variant to download for ``platform`` among ``available`` (or ``requested`` if given)."""
    available = sorted(set(available))
    if requested is not None:
        variant = get_variant(requested)
        if variant.name not in available:
            raise HubError(
                f"build variant {requested!r} is not in this build; "
                f"it has: {', '.join(available) or '(none)'}"
            )
        return variant
    for variant in VARIANTS:
        if platform in variant.platforms and variant.name in available:
            return variant
    fitting = [v.name for v in VARIANTS if platform in v.platforms]
    raise HubError(
        f"no build variant fits this {platform} host (it needs one of {', '.join(fitting)}); "
        f"the build has: {', '.join(available) or '(none)'}"
    )
