"""``kernel-hub build / publish / lock / versions / verify / get`` with ``--json``."""

from __future__ import annotations

import json

from kernel_hub.cli import main

from .hub_helpers import REPO


def run_json(capsys, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_round_trip(hub_env, kernel_copy, capsys, tmp_path, keys):
    sign = ["--sign-key", str(keys["publisher"].private_path)]
    built = run_json(capsys, "build", str(kernel_copy("1.0.0")), "--out", str(tmp_path / "out"))
    assert sorted(v["variant"] for v in built["variants"]) == ["torch-cpu", "torch-tpu"]

    first = run_json(capsys, "publish", str(kernel_copy("1.0.0")), "--repo", REPO, *sign)
    assert first["signed_by"] == keys["publisher"].key_id
    assert (first["tag"], first["branch"]) == ("v1.0.0", "v1")
    assert main(["publish", str(kernel_copy("1.0.0")), "--repo", REPO, *sign]) == 2
    assert "already published" in capsys.readouterr().err

    locked = run_json(capsys, "lock")
    assert locked["ops"]["rmsnorm"]["commit"] == first["commit"]
    assert (tmp_path / "kernel-hub.lock").is_file()
    second = run_json(capsys, "publish", str(kernel_copy("1.1.0")), "--repo", REPO, *sign)

    versions = run_json(capsys, "versions", "rmsnorm")
    assert [(v["version"], v["commit"]) for v in versions["versions"]] == [
        ("1.1.0", second["commit"]),
        ("1.0.0", first["commit"]),
    ]
    assert all(v["in_registry_range"] for v in versions["versions"])

    verified = run_json(capsys, "verify", "rmsnorm")  # the lock in cwd pins 1.0.0
    assert verified["version"] == "1.0.0" and verified["checked_against"] == [
        "signature by a pinned key",
        "signed metadata digest",
        "lock file",
    ]
    assert verified["signed_by"] == keys["publisher"].key_id
    newest = run_json(capsys, "verify", "rmsnorm", "--no-lock", "--version", ">=1,<2")
    assert newest["commit"] == second["commit"] and newest["variant"] == "torch-cpu"

    got = run_json(capsys, "get", "rmsnorm", "--no-lock", "--version", "1.1.0")
    assert (got["source"], got["version"], got["commit"]) == ("hub", "1.1.0", second["commit"])

    cached = tmp_path / "hf-cache" / "kernels--kernel-hub--rmsnorm" / "snapshots" / second["commit"]
    layers = (cached / "build" / "torch-cpu" / "rmsnorm" / "layers.py").resolve()
    layers.write_text(layers.read_text() + "# edited\n")
    assert main(["verify", "rmsnorm", "--no-lock", "--version", "1.1.0"]) == 2
    assert "changed: build/torch-cpu/rmsnorm/layers.py" in capsys.readouterr().err
