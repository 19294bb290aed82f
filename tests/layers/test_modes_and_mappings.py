"""Mode parsing and kernel_mapping overrides (no models, no kernels loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from kernel_hub import KernelHubError, Mode, kernel_mapping
from kernel_hub.errors import UnknownNameError
from kernel_hub.loading.mappings import active_overrides, parse_override
from kernel_hub.registry.registry import load_registry


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("inference", Mode.INFERENCE),
        ("Training", Mode.TRAINING),
        ("inference+torch_compile", Mode.INFERENCE | Mode.TORCH_COMPILE),
        ("torch_compile | training", Mode.TRAINING | Mode.TORCH_COMPILE),
    ],
)
def test_mode_strings(text: str, mode: Mode) -> None:
    assert Mode.parse(text) == mode
    assert Mode.parse(mode.label) == mode


def test_unknown_mode_string_names_the_valid_ones() -> None:
    with pytest.raises(UnknownNameError, match=r"'inferance'.*Did you mean 'inference'.*training"):
        Mode.parse("inferance")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("inference+training", "exclude each other"),
        ("torch_compile", "needs INFERENCE or TRAINING"),
        (Mode.TORCH_COMPILE, "needs INFERENCE or TRAINING"),
    ],
)
def test_mode_needs_exactly_one_of_inference_and_training(bad: object, message: str) -> None:
    with pytest.raises(KernelHubError, match=message):
        Mode.parse(bad)


def test_mode_or_rejects_inference_with_training() -> None:
    with pytest.raises(KernelHubError, match="exclude each other"):
        _ = Mode.INFERENCE | Mode.TRAINING


def test_mode_of_wrong_type() -> None:
    with pytest.raises(KernelHubError, match="got int 3"):
        Mode.parse(3)


def test_override_values(tmp_path: Path) -> None:
    assert parse_override("rmsnorm", "OFF").off
    assert parse_override("rmsnorm", "1.0.0").version == SpecifierSet("==1.0.0")
    assert parse_override("rmsnorm", ">=1.0,<2").version == SpecifierSet(">=1.0,<2")
    assert parse_override("rmsnorm", 1).version == SpecifierSet(">=1,<2")
    assert parse_override("rmsnorm", tmp_path).kernel_dir == tmp_path
    assert parse_override("rmsnorm", str(tmp_path)).kernel_dir == tmp_path


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (4.2, "got float 4.2"),
        ("sometimes", "neither 'off', a version"),
        (Path("/no/such/kernel/dir"), "is not a directory"),
    ],
)
def test_bad_override_values(value: object, message: str) -> None:
    with pytest.raises(KernelHubError, match=message), kernel_mapping({"rmsnorm": value}):
        pass


def test_mapping_must_be_a_mapping() -> None:
    with pytest.raises(KernelHubError, match="takes a mapping"), kernel_mapping(["rmsnorm"]):
        pass


def test_nested_mappings_inner_wins_and_exit_restores() -> None:
    registry = load_registry()
    assert active_overrides(registry) == {}
    with kernel_mapping({"rmsnorm": "off"}):
        assert active_overrides(registry)["rmsnorm"].off
        with kernel_mapping({"RMSNorm": "1.0.0"}):  # a layer name means the op providing it
            inner = active_overrides(registry)["rmsnorm"]
            assert not inner.off and inner.version == SpecifierSet("==1.0.0")
        assert active_overrides(registry)["rmsnorm"].off
    assert active_overrides(registry) == {}


def test_alias_keys_resolve_to_the_op() -> None:
    with kernel_mapping({"rms-norm": "off"}):
        assert set(active_overrides(load_registry())) == {"rmsnorm"}


def test_unknown_mapping_key_is_an_error_with_suggestions() -> None:
    with (
        kernel_mapping({"RMSNrom": "off"}),
        pytest.raises(UnknownNameError, match=r"'RMSNrom'.*Did you mean 'RMSNorm'"),
    ):
        active_overrides(load_registry())
