"""``kernel-hub doctor``: every area reported, each gap with what to do, the hub probed."""

from __future__ import annotations

import json

import pytest

from kernel_hub.cli import main
from kernel_hub.cli.doctor_cmds import MISSING, doctor
from kernel_hub.hub.server import serve


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
    assert checks["pinned keys"].status == MISSING
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
    assert check.status == MISSING and check.todo.startswith("pip install 'kernel-hub[bench]'")


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
