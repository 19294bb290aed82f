"""registry.yaml parsing: typed entries, lookups, and errors that name file, line and choices."""

from __future__ import annotations

import textwrap

import pytest

from kernel_hub.errors import SourceError, UnknownNameError
from kernel_hub.registry.registry import load_registry, parse_registry

GOOD = """\
schema: 1
ops:
  rmsnorm:
    summary: RMS normalization
    aliases: [rms_norm]
    kernel: rmsnorm
    repo: kernel-hub/rmsnorm
    version: ">=1.0,<2"
    implementations:
      tpu: [pallas, xla]
      cpu: [xla]
    layers: [RMSNorm]
"""


def parse(text: str):
    return parse_registry("registry.yaml", textwrap.dedent(text))


def test_good_registry_is_typed():
    registry = parse(GOOD)
    entry = registry.get("rms_norm")
    assert entry.name == "rmsnorm" and entry.line == 3
    assert entry.implementations_for("tpu") == ("pallas", "xla")
    assert entry.implementations_for("gpu") == ()
    assert entry.version.contains("1.4.0") and not entry.version.contains("2.0.0")
    assert registry.layer_owner("RMSNorm") is entry


def test_in_tree_registry_loads():
    registry = load_registry()
    assert "rmsnorm" in registry


def test_unknown_op_suggests_close_names():
    with pytest.raises(UnknownNameError, match=r"unknown op 'rmsnrom'\. Did you mean 'rmsnorm'"):
        parse(GOOD).get("rmsnrom")


def test_unknown_layer_lists_valid_layers():
    with pytest.raises(UnknownNameError, match="Valid layers: RMSNorm"):
        parse(GOOD).layer_owner("LayerNorm")


@pytest.mark.parametrize(
    ("edit", "line", "message"),
    [
        (
            ('version: ">=1.0,<2"', 'version: "=>1.0"'),
            8,
            "field 'version': invalid version range '=>1.0'",
        ),
        (
            ("kernel: rmsnorm", "kernal: rmsnorm"),
            6,
            "unknown field 'kernal'; valid fields: aliases",
        ),
        (
            ("      cpu: [xla]", "      npu: [xla]"),
            11,
            "unknown field 'npu'; valid fields: cpu, gpu, tpu",
        ),
        (
            ("aliases: [rms_norm]", "aliases: rms_norm"),
            5,
            "field 'aliases': expected list, got str",
        ),
        (("repo: kernel-hub/rmsnorm", "repo: rmsnorm"), 7, "expected 'org/name'"),
        (("schema: 1", "schema: 7"), 1, "unsupported schema 7"),
        (("    kernel: rmsnorm\n", ""), 3, "missing required field 'kernel'"),
        (
            ("    layers: [RMSNorm]", "    layers: [RMSNorm\n"),
            14,
            "(while parsing a flow sequence at line 12)",
        ),
    ],
)
def test_malformed_registry_names_file_line_and_field(edit, line, message):
    with pytest.raises(SourceError) as info:
        parse(GOOD.replace(*edit))
    assert info.value.path == "registry.yaml"
    assert info.value.line == line, str(info.value)
    assert message in str(info.value)


def test_duplicate_op_is_refused_with_both_lines():
    doubled = GOOD + GOOD.split("ops:\n", 1)[1]
    with pytest.raises(
        SourceError, match=r"registry.yaml:13: duplicate key 'rmsnorm' \(first at line 3\)"
    ):
        parse(doubled)


def test_alias_colliding_with_an_op_is_refused():
    text = GOOD + GOOD.split("ops:\n", 1)[1].replace("rmsnorm:", "other:", 1).replace(
        "[rms_norm]", "[rmsnorm]"
    )
    with pytest.raises(SourceError, match="alias 'rmsnorm' is already op 'rmsnorm'"):
        parse(text)


def test_missing_file(tmp_path):
    with pytest.raises(SourceError, match="registry file not found"):
        load_registry(tmp_path / "nope.yaml")
