"""model-bench's figure cache: a program compiled once is read back, anything that decides the
compile makes a new key, refusals are kept, damaged entries are compiled again and replaced, and
nothing half-written is left. Programs here compile for the host CPU: the cache reads only the
lowered text and the compiled program's analyses, whichever backend compiled it."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from kernel_hub.bench import figure_cache as fc
from kernel_hub.bench.overflow import memory_overflow

HBM_REFUSAL = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
    "temporaries (18.22G) exceeds available HBM (15.75G)."
)


class Counting:
    """A lowered program that counts its compiles."""

    def __init__(self, rows: int = 256, error: str | None = None):
        self.lowered = (
            jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0))
            .trace(jax.ShapeDtypeStruct((rows, 128), jnp.float32))
            .lower()
        )
        self.error, self.compiles = error, 0

    def as_text(self) -> str:
        return self.lowered.as_text()

    def compile(self):
        self.compiles += 1
        if self.error is not None:
            raise RuntimeError(self.error)
        return self.lowered.compile()


def _entries(directory) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def test_a_program_compiled_once_is_read_back_not_compiled(tmp_path):
    first, again = Counting(), Counting()
    compiled = fc.compile_figures(first, "v5e topology=None tp=None", tmp_path)
    read = fc.compile_figures(again, "v5e topology=None tp=None", tmp_path)
    assert (first.compiles, again.compiles) == (1, 0)
    assert read == compiled
    assert compiled.figures.flops >= 2 * 256 * 256 * 128  # the matmul, counted by XLA
    assert compiled.figures.argument_bytes == 256 * 128 * 4
    key = fc.program_key(first.as_text(), "v5e topology=None tp=None")
    assert _entries(tmp_path) == [f"{key}.json"]  # one entry, no temporary file left


def test_another_program_target_or_compiler_setting_compiles_again(tmp_path, monkeypatch):
    fc.compile_figures(Counting(), "v5e", tmp_path)
    for program, target in ((Counting(rows=384), "v5e"), (Counting(), "v6e")):
        fc.compile_figures(program, target, tmp_path)
        assert program.compiles == 1
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
    flagged = Counting()
    fc.compile_figures(flagged, "v5e", tmp_path)
    assert flagged.compiles == 1
    assert len(_entries(tmp_path)) == 4


def test_a_memory_refusal_is_kept_and_raised_again_with_libtpu_message(tmp_path):
    refused = Counting(error=HBM_REFUSAL)
    with pytest.raises(RuntimeError, match="Ran out of memory on HBM"):
        fc.compile_figures(refused, "v5e", tmp_path)
    again = Counting(error=HBM_REFUSAL)
    with pytest.raises(fc.CompileRefused) as raised:
        fc.compile_figures(again, "v5e", tmp_path)
    assert again.compiles == 0
    assert memory_overflow(str(raised.value)).space == "HBM"


def test_another_compile_failure_is_not_kept(tmp_path):
    for _ in range(2):
        failing = Counting(error="INTERNAL: something else")
        with pytest.raises(RuntimeError, match="something else"):
            fc.compile_figures(failing, "v5e", tmp_path)
        assert failing.compiles == 1
    assert _entries(tmp_path) == []


@pytest.mark.parametrize(
    "damage",
    [
        lambda entry: '{"format": 1, "key": ',  # cut short
        lambda entry: json.dumps({**entry, "figures": {**entry["figures"], "flops": "many"}}),
        lambda entry: json.dumps({**entry, "loops": 1}),
        lambda entry: json.dumps({**entry, "key": "0" * 64}),  # another program's entry
        lambda entry: json.dumps({**entry, "format": fc.FORMAT + 1}),
        lambda entry: json.dumps({k: v for k, v in entry.items() if k != "collectives"}),
    ],
    ids=["truncated", "not-a-number", "loops-not-bool", "other-key", "other-format", "missing"],
)
def test_an_entry_that_does_not_read_back_is_compiled_again_and_replaced(tmp_path, damage):
    seeded = fc.compile_figures(Counting(), "v5e", tmp_path)
    (path,) = tmp_path.iterdir()
    path.write_text(damage(json.loads(path.read_text())))
    program = Counting()
    assert fc.compile_figures(program, "v5e", tmp_path) == seeded
    assert program.compiles == 1
    reread = Counting()
    assert fc.compile_figures(reread, "v5e", tmp_path) == seeded and reread.compiles == 0


def test_an_unwritable_cache_warns_once_and_the_figures_still_come(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    directory = blocker / "cache"  # cannot be made: its parent is a file
    with pytest.warns(RuntimeWarning, match="figure cache .* is not used: it cannot be created"):
        fc.compile_figures(Counting(), "v5e", directory)
    program = Counting()
    fc.compile_figures(program, "v5e", directory)  # warned once per directory and process
    assert program.compiles == 1
    assert _entries(tmp_path) == ["a-file"]


def test_without_a_directory_every_program_compiles_and_nothing_is_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        program = Counting()
        fc.compile_figures(program, "v5e", None)
        assert program.compiles == 1
    assert _entries(tmp_path) == []


def test_the_cache_directory_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(fc.DIR_ENV, raising=False)
    monkeypatch.delenv(fc.ENABLE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fc.default_cache_dir() == tmp_path / "xdg" / "kernel-hub" / "model-bench"
    monkeypatch.setenv(fc.DIR_ENV, str(tmp_path / "mine"))
    assert fc.default_cache_dir() == tmp_path / "mine"
    for off in ("0", "off", "False", "no"):
        monkeypatch.setenv(fc.ENABLE_ENV, off)
        assert fc.default_cache_dir() is None


@pytest.mark.parametrize(
    ("option", "expected"), [(None, "env"), ("off", None), ("~/figures", "home")]
)
def test_the_command_takes_a_directory_or_off(tmp_path, monkeypatch, option, expected):
    from kernel_hub.cli.model_bench_cmds import _figure_cache

    monkeypatch.setenv(fc.DIR_ENV, str(tmp_path / "env"))
    monkeypatch.setenv("HOME", str(tmp_path))
    wanted = {"env": tmp_path / "env", "home": tmp_path / "figures", None: None}[expected]
    assert _figure_cache(option) == wanted


def test_a_directory_others_can_write_is_not_read(tmp_path):
    """An entry someone else planted would be reported as libtpu's figures: in a directory the
    group or everyone may write, the cache is not used (said once) and every program compiles."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    fc.compile_figures(Counting(), "v5e", shared)  # an entry, as a neighbour could write one
    (entry,) = shared.iterdir()
    planted = json.loads(entry.read_text())
    planted["figures"]["flops"] = 1.0
    entry.write_text(json.dumps(planted))
    program = Counting()
    assert fc.compile_figures(program, "v5e", shared).figures.flops == 1.0  # read while private
    shared.chmod(0o770)
    with pytest.warns(RuntimeWarning, match=r"figure cache .* is not used: others can write it"):
        figures = fc.compile_figures(program, "v5e", shared).figures
    assert program.compiles == 1 and figures.flops > 1.0
    assert json.loads(entry.read_text())["figures"]["flops"] == 1.0  # nothing written there


def test_an_entry_that_cannot_be_written_is_said_once(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fc.tempfile, "NamedTemporaryFile", full)
    with pytest.warns(RuntimeWarning, match="is not written \\(No space left on device\\)"):
        fc.compile_figures(Counting(), "v5e", tmp_path)
    program = Counting()
    fc.compile_figures(program, "v5e", tmp_path)  # warned once
    assert program.compiles == 1 and _entries(tmp_path) == []
