"""``kernel-hub doctor``: every area reported, each gap with what to do, the hub probed."""

from __future__ import annotations

import json

import pytest

from kernel_hub.cli import main
from kernel_hub.cli.doctor_cmds import MISSING, OPTIONAL, doctor, verdict
from kernel_hub.hub.server import serve
from kernel_hub.platform import accelerator_present


def _by_area(checks) -> dict:
    return {c.area: c for c in checks}


def test_reports_every_area_and_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    checks = _by_area(doctor())
    for area in (
        "runtime: TorchTPU (device 'tpu')",
        "runtime: torchax (device 'jax')",
        "runtime: PyTorch/XLA (device 'xla')",
        "runtime: CPU (DLPack)",
        "libtpu",
        "TPU",
        "extra [hub]",
        "extra [tpu]",
        "registry",
        "pinned keys",
        "hub cache",
        "hub",
    ):
        assert area in checks, area
    for check in checks.values():
        assert check.status != MISSING or check.todo, check  # every gap says what to do
    # the built-in registry pins no publisher key: hub loads are refused, and it says so
    assert checks["pinned keys"].status == OPTIONAL
    assert "docs/hub-walkthrough.md" in checks["pinned keys"].todo
    assert checks["hub"].found.startswith("offline (HF_HUB_OFFLINE)")


def test_missing_extra_names_its_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    check = _by_area(doctor())["extra [bench]"]
    assert check.status == OPTIONAL and check.todo.startswith("pip install 'kernel-hub[bench]'")


def test_probes_the_hub_endpoint(
    monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = serve(tmp_path)
    server.start_in_thread()
    try:
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        assert main(["doctor", "--json"]) == 0
        hub = {c["area"]: c for c in json.loads(capsys.readouterr().out)}["hub"]
        assert hub["status"] == "ok" and hub["found"].startswith(f"{server.url} answers")
    finally:
        server.shutdown()
        server.server_close()
    monkeypatch.setenv("HF_ENDPOINT", server.url)  # nobody listens there now
    hub = _by_area(doctor(timeout=1))["hub"]
    assert hub.status == MISSING
    assert "unreachable" in hub.found and "HF_ENDPOINT" in hub.todo


def test_caches_must_be_writable_and_the_verdict_says_what_to_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KERNEL_HUB_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("KERNEL_HUB_STATE_DIR", str(tmp_path / "state"))
    checks = doctor()
    if not accelerator_present():  # a correct CPU install: nothing alarming, TPU parts optional
        assert {c.status for c in checks} <= {"ok", OPTIONAL, "info"}
    assert _by_area(checks)["hub cache"].found == f"{tmp_path / 'hub'} (to be made in {tmp_path})"
    assert verdict(checks).startswith("verdict: ready: kernel-hub runs its kernels here")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KERNEL_HUB_COMPILATION_CACHE_DIR", str(blocker / "jax"))
    monkeypatch.setenv("HF_HUB_CACHE", str(blocker / "hub"))
    monkeypatch.setenv("KERNEL_HUB_STATE_DIR", str(blocker / "state"))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("verdict: 3 to fix (compilation cache, hub cache, hub state)"), last
    checks = _by_area(doctor())
    for area, variable in (
        ("compilation cache", "KERNEL_HUB_COMPILATION_CACHE_DIR"),
        ("hub cache", "HF_HUB_CACHE"),
        ("hub state", "KERNEL_HUB_STATE_DIR"),
    ):
        assert checks[area].status == MISSING, checks[area]
        assert f"{blocker} is not a directory" in checks[area].found
        assert variable in checks[area].todo


def test_a_compilation_cache_others_can_write_is_to_fix(monkeypatch, tmp_path) -> None:
    """The bridge does not use it (a neighbour could plant executables): doctor says so."""
    shared = tmp_path / "jax"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KERNEL_HUB_COMPILATION_CACHE_DIR", str(shared))
    check = _by_area(doctor())["compilation cache"]
    assert check.status == MISSING, check
    assert (
        check.found == f"{shared}: not used, others can write it (mode 777; chmod go-w fixes that)"
    )
    assert "only you can write" in check.todo
    shared.chmod(0o700)
    assert _by_area(doctor())["compilation cache"].found == f"{shared} (writable)"
