"""The kernelize API is reachable from ``kernel_hub`` and importing it stays cheap."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kernel_hub
from kernel_hub.layers import kernelize as layers
from kernel_hub.layers import modes
from kernel_hub.layers import report as layer_report
from kernel_hub.loading import mappings

EXPORTS = {
    "kernelize": layers,
    "unkernelize": layers,
    "use_kernel_forward": layers,
    "mark_layer": layers,
    "unmark_layer": layers,
    "kernelize_report": layers,
    "Mode": modes,
    "kernel_mapping": mappings,
    "KernelizeReport": layer_report,
}


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_exported(name: str) -> None:
    assert getattr(kernel_hub, name) is getattr(EXPORTS[name], name)
    assert name in kernel_hub.__all__


def test_from_pretrained_exported() -> None:
    assert kernel_hub.from_pretrained is layers.from_pretrained


def test_package_and_cli_parser_do_not_import_torch() -> None:
    code = (
        "import sys, kernel_hub, kernel_hub.cli as cli; cli.build_parser(); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True)
