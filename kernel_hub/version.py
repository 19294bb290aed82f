"""kernel-hub's package version and the kernel API version kernel builds are checked against.

A leaf: the manifest check and the hub client read these without importing anything else.
"""

__version__ = "0.2.0"

KERNEL_API_VERSION = "1.7"
"""Semantic version of ``kernel_hub.kernel_api``: a minor bump adds names, a major bump removes
or changes one. Kernel manifests ask for it as ``requires: {kernel-hub: ">=1.3"}``."""

UNDECLARED_KERNEL_APIS = ("1.0", "1.1", "1.2")
"""Kernel API versions before the ``KERNEL`` declaration (1.3): builds whose ``kernel-hub`` range
admits one export module attributes instead and are refused before import, naming the range."""

KERNEL_API_REQUIREMENT = "kernel-hub"
"""The ``requires:`` key a manifest names the kernel API version with."""
