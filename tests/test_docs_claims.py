"""What README.md says that a test can check: the commands, the layout, the extras, attention's
features. A claim that goes stale fails here instead of misleading a new user."""

from __future__ import annotations

import argparse
import importlib
import re
import tomllib

from doc_snippets import DOC_FILES, ROOT

from kernel_hub.cli import build_parser

README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def test_command_line_section_lists_every_command() -> None:
    (subparsers,) = (
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    listed = set(re.findall(r"^    kernel-hub ([a-z-]+)", _section("Command line"), re.M))
    assert listed == set(subparsers.choices)


def test_layout_section_lists_every_subpackage_and_leaf() -> None:
    layout = _section("Layout")
    listed = set(re.findall(r"^      (\w+)/ ", layout, re.M))
    modules_listed = set(re.findall(r"^      (\w+)\.py ", layout, re.M))
    package = ROOT / "kernel_hub"
    subpackages = {p.parent.name for p in package.glob("*/__init__.py")}
    assert listed == subpackages
    (leaf_line,) = re.findall(r"^      (.+): leaves$", layout, re.M)
    leaves = set(leaf_line.split(", "))
    modules = {p.stem for p in package.glob("*.py")} - {"__init__"}
    assert leaves | modules_listed == modules
    for top in ("registry.yaml", "kernels", "benchmarks", "tests"):
        assert (ROOT / top).exists(), top


def test_install_line_and_extras_table_match_the_package() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    section = _section("Two commands for a fresh machine")
    (install,) = re.findall(r'pip install -q -c constraints.txt "\.\[([\w,-]+)\]"', section)
    # the main job as CI runs it from a fresh environment (scripts/test.sh, .venv-main)
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert f'pip install --quiet -c constraints.txt "$wheel[{install}]"' in script
    named = set(re.findall(r"^\| `([\w-]+)`(?:, `([\w-]+)`)? \|", section, re.M))
    in_table = {name for pair in named for name in pair if name}
    assert in_table == set(extras) - {"test"}


def test_attention_features_named_in_the_readme_are_the_kernels() -> None:
    from kernel_hub import get_kernel

    kernel = get_kernel("attention")
    keywords = importlib.import_module(f"{kernel.__name__}.keywords")
    sentence = README[README.index("attention only where") : README.index("[docs/attention-")]
    implemented, _, not_implemented = sentence.partition("; not")
    for name in ("s_aux", "position_bias", "sliding_window", "softcap"):
        assert f"`{name}`" in implemented and name in keywords.HONOURED, name
    for name in re.findall(r"`(\w+)`", not_implemented):
        assert name in keywords.REFUSED, name


def _doc_texts() -> dict[str, str]:
    return {str(path.relative_to(ROOT)): path.read_text() for path in DOC_FILES}


def test_docs_name_the_shipped_kernel_versions() -> None:
    """'attention 1.3.0', 'the rmsnorm kernel (1.1.0)', 'my-org/rmsnorm 1.1.0': each the version
    in that kernel's kernel.yaml, not one from before a release."""
    from kernel_hub.registry.manifest import load_manifest

    shipped = {
        path.parent.name: str(load_manifest(path.parent).version)
        for path in (ROOT / "kernels").glob("*/kernel.yaml")
    }
    names = "|".join(sorted(map(re.escape, shipped), key=len, reverse=True))
    mention = re.compile(rf"(?<![\w-])(?:[\w-]+/)?`?({names})`?(?: kernel)? \(?(\d+\.\d+\.\d+)")
    stale = [
        f"{doc}: {found.group(0)} (ships {shipped[found.group(1)]})"
        for doc, text in _doc_texts().items()
        for found in mention.finditer(text)
        if found.group(2) != shipped[found.group(1)]
    ]
    assert not stale, stale


def test_docs_name_no_issue_numbers() -> None:
    """A reader has no access to the project's issue tracker; say what is true instead."""
    numbered = re.compile(r"\b[Ii]ssues? #?\d+|(?<![\w/-])#\d+\b")
    found = [
        f"{doc}: {m.group(0)}" for doc, t in _doc_texts().items() for m in numbered.finditer(t)
    ]
    assert not found, found
