"""What a new user meets in the first hour: each rough edge as a command (or call) and the message
it must give."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import pytest
import torch
from doc_snippets import ROOT

import kernel_hub
from kernel_hub import get_kernel, kernelize
from kernel_hub.cli import EXTRA_OF_MODULE, main
from kernel_hub.errors import KernelHubError, KernelInputError, RequirementError
from kernel_hub.models.tiny import build_tiny_model
from kernel_hub.platform import accelerator_present

EXTRAS = set(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"kernel-hub {kernel_hub.__version__}\n"


@pytest.mark.skipif(
    accelerator_present(), reason="only a host without TPU/GPU gets the CPU default"
)
def test_commands_print_no_libtpu_start_up() -> None:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = subprocess.run(
        [sys.executable, "-P", "-m", "kernel_hub.cli", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "rmsnorm" in done.stdout


def test_extras_named_for_missing_modules_exist() -> None:
    assert set(EXTRA_OF_MODULE.values()) <= EXTRAS


def test_missing_extra_names_the_pip_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    monkeypatch.delitem(sys.modules, "kernel_hub.bench.plot", raising=False)
    argv = ["bench", "rmsnorm", "--shapes", "decode-b8-h4096-f32", "--impl", "xla"]
    argv += ["--budget", "0.01", "--no-progress", "--plot", str(tmp_path / "p.png")]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "bench needs the 'matplotlib" in err
    assert "pip install 'kernel-hub[bench]'" in err
    assert out == ""  # refused before benchmarking: no table


@pytest.mark.parametrize("command", ["demo", "models"])
def test_commands_needing_transformers_say_so_before_work(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    assert main([command, "--json"]) == 2
    out, err = capsys.readouterr()
    assert err == (
        f"kernel-hub: error: {command} needs the 'transformers' package, which is not "
        "installed: pip install 'kernel-hub[transformers]'\n"
    )
    assert out == ""


def test_missing_libtpu_names_the_tpu_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernel_hub import topologies

    real = topologies.importlib.util.find_spec
    monkeypatch.setattr(
        topologies.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "libtpu" else real(name, *a),
    )
    with pytest.raises(RequirementError, match=r"pip install 'kernel-hub\[tpu\]'"):
        topologies.tpu_devices.__wrapped__("v5e")


def test_bench_says_how_torch_and_jax_threads_differ(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "rmsnorm", "--shapes", "decode-b8-h4096-f32", "--impl", "xla,torch"]
    assert main([*argv, "--budget", "0.01", "--no-progress", "--torch-threads", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the note is wrapped to the terminal
    assert "torch and torch-op ran with torch.set_num_threads(1) (--torch-threads)" in out
    assert "KERNEL_HUB_THREADS=" in out


def test_unknown_names_are_plural_in_english(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "--family", "nope"]) == 2
    assert "Valid families:" in capsys.readouterr().err
    with pytest.raises(KernelHubError, match="Valid implementations of rms_norm:"):
        get_kernel("rmsnorm").rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6, "nope")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: get_kernel(None), r"name must be an op name \(str\), got NoneType None; ops: "),
        (lambda: get_kernel("rmsnorm", variant="torch-cuda"), "valid variants: torch-tpu"),
        (
            lambda: get_kernel("rmsnorm").rms_norm(torch.ones(2, 8), None, 1e-6),
            "rms_norm: weight must be a tensor, got NoneType None",
        ),
        (
            lambda: get_kernel("rmsnorm").rms_norm(torch.ones(2, 8), torch.ones(8), "1e-6"),
            "rms_norm: eps must be a float, got str '1e-6'",
        ),
        (
            lambda: get_kernel("layernorm").layer_norm(
                torch.ones(2, 8), torch.ones(8), torch.zeros(8), "1e-5"
            ),
            "layer_norm: eps must be a float, got str",
        ),
    ],
    ids=["get_kernel-None", "variant", "weight-None", "eps-str", "layernorm-eps-str"],
)
def test_bad_arguments_say_what_is_valid(call, message: str) -> None:
    with pytest.raises(KernelInputError, match=message):
        call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_kernelize_refuses_a_device_the_host_lacks() -> None:
    model = build_tiny_model("llama")
    with pytest.raises(KernelHubError, match=r"this host has no 'cuda' device"):
        kernelize(model, device="cuda")
    with pytest.raises(KernelHubError, match="was never kernelized"):
        kernel_hub.kernelize_report(model)  # refused before anything was swapped


def test_serve_refuses_a_missing_directory(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", str(tmp_path / "nosuchdir"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "nosuchdir is not a directory; make a store with 'kernel-hub mirror --to" in err
    assert not (tmp_path / "nosuchdir").exists()


def test_keygen_refuses_a_missing_directory(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "nonexistent" / "dir" / "k"
    assert main(["keygen", "--out", str(out)]) == 2
    assert f"directory {out.parent} does not exist; create it first" in capsys.readouterr().err
    assert not out.parent.exists()


def test_versions_offline_says_nothing_is_cached(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert main(["versions", "rmsnorm"]) == 0
    assert "kernel-hub/rmsnorm (cache): nothing cached (HF_HUB_OFFLINE is set)" in (
        capsys.readouterr().out
    )


def test_build_takes_an_op_name_and_builds_here(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["build", "rmsnorm", "--variant", "torch-cpu"]) == 0
    assert (tmp_path / "build" / "rmsnorm" / "torch-cpu" / "metadata.json").is_file()
    assert "build/rmsnorm/torch-cpu" in capsys.readouterr().out


def test_cli_errors_name_flags_not_keyword_arguments(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    from kernel_hub.paths import registry_path

    data = yaml.safe_load(registry_path().read_text())
    data["ops"] = {"rmsnorm": {**data["ops"]["rmsnorm"], "repo": "stranger/rmsnorm"}}
    registry = tmp_path / "registry.yaml"
    registry.write_text(yaml.safe_dump(data))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert main(["verify", "rmsnorm", "--registry", str(registry), "--version", ">=1"]) == 2
    err = capsys.readouterr().err
    assert "not a trusted publisher" in err and "Pass --trust-remote-code" in err, err
    assert "trust_remote_code" not in err


def test_thread_policy_error_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernel_hub.bridge.threads import thread_policy

    monkeypatch.setenv("KERNEL_HUB_THREADS", "bogus")
    message = r"Valid thread policies of \$KERNEL_HUB_THREADS: default, inline\.$"
    with pytest.raises(KernelHubError, match=message):
        thread_policy()


def test_asking_for_the_in_tree_version_says_no_builds_are_published(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The built-in registry pins no publisher key: no hub build can load, and the in-tree kernel
    already is version 1.1.0. The message says both, for get_kernel and for kernel_mapping."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # no kernel-hub.lock
    in_tree = get_kernel("rmsnorm").manifest.version
    with pytest.raises(KernelHubError) as refused:
        get_kernel("rmsnorm", version=str(in_tree))
    message = str(refused.value)
    assert "no signed kernel-hub builds are published" in message
    assert f"The in-tree kernel rmsnorm {in_tree} matches version '{in_tree}'" in message
    assert "get_kernel('rmsnorm')" in message and "keygen" not in message
    loads_in_tree = rf"\. get_kernel\('rmsnorm'\) loads the in-tree kernel rmsnorm {in_tree}\."
    with pytest.raises(KernelHubError, match=loads_in_tree):
        get_kernel("rmsnorm", version=">=99")  # no match: only says what loads in-tree
    with kernel_hub.kernel_mapping({"rmsnorm": str(in_tree)}):
        report = kernelize(build_tiny_model("llama"))
    norms = [e for e in report.entries if e.target == "RMSNorm"]
    assert norms and all("matches version" in e.reason for e in norms)


def test_an_op_the_registry_lacks_is_not_reported_as_none(tmp_path) -> None:
    import yaml

    from kernel_hub.paths import registry_path

    data = yaml.safe_load(registry_path().read_text())
    data["ops"] = {"rmsnorm": data["ops"]["rmsnorm"]}
    registry = tmp_path / "registry.yaml"
    registry.write_text(yaml.safe_dump(data))
    report = kernelize(build_tiny_model("llama"), registry=registry)
    (attention, *_) = [e for e in report.entries if e.target == "AttentionInterface"]
    assert attention.reason == "registry.yaml has no op 'attention'", attention.reason


def test_attention_needs_tokamax_only_where_tokamax_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without tokamax the attention kernel loads and runs (XLA on CPU); only its Tokamax
    implementation is refused, saying what to install."""
    monkeypatch.setitem(sys.modules, "tokamax", None)  # import fails as if not installed
    kernel = get_kernel("attention")
    q = torch.randn(1, 2, 8, 16)
    out, _ = kernel.attention_with_lse(q, q, q, causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(out, expected)
    reasons = dict(
        kernel.jax.TABLE.explain(
            *(q.numpy(),) * 3,
            None,
            None,
            spec=kernel.jax.AttentionSpec(causal=True).resolved(16),
            with_lse=False,
            implementation="tokamax",
        )
    )
    assert reasons["tokamax"] == "tokamax is not installed (pip install 'kernel-hub[tokamax]')"


def test_an_unusable_compile_cache_warns_once(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    from kernel_hub import user_cache
    from kernel_hub.bridge import compile_cache

    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the cache directory would have to be made inside a file
    monkeypatch.setattr(compile_cache, "_override", blocker / "jax")
    monkeypatch.setattr(user_cache, "_warned", set())
    message = (
        rf"compilation cache {blocker / 'jax'} is not used: it cannot be created .*Set "
        r"KERNEL_HUB_COMPILATION_CACHE_DIR to a directory only you can write"
    )
    with pytest.warns(RuntimeWarning, match=message), compile_cache.persistent_cache():
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with compile_cache.persistent_cache():  # said once per process
            pass


@pytest.mark.parametrize("columns", [40, 60, 300])
def test_tables_fit_the_terminal_width(
    columns: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kernel_hub.cli.output import print_table

    monkeypatch.setenv("COLUMNS", str(columns))
    layers = "RMSNorm,RMSNormF32Scale,RMSNormZeroCentered,TorchRMSNorm,DiffusersRMSNorm"
    reason = "left alone: kernel for op 'rmsnorm' could not be loaded: " + "x" * 70
    print_table(["op", "layers", "why"], [["rmsnorm", layers, reason], ["rotary", "-", "-"]])
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= columns
    if columns == 300:  # room for every cell on one line
        assert len(lines) == 4 and layers in lines[2] and reason in lines[2]
    else:  # wrapped, nothing cut: each column of the first row holds its whole cell, in order
        spans = [m.span() for m in re.finditer("-+", lines[1])]
        first_row = lines[2 : next(i for i, line in enumerate(lines) if line.startswith("rotary"))]
        for (start, end), cell in zip(spans[1:], (layers, reason), strict=True):
            column = "".join(line[start:end] for line in first_row)
            assert re.sub(r"\s", "", column) == re.sub(r"\s", "", cell)


def test_models_shows_progress_with_elapsed_and_remaining_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kernel_hub.cli.models_cmds import progress_line

    assert progress_line(12, 400, 41.0) == "[12/400 3%] 0:41 elapsed, ~22:06 left"
    assert progress_line(400, 400, 3725.0) == "[400/400 100%] 1:02:05 elapsed, ~0:00 left"
    assert main(["models", "--model-type", "llama,mistral"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"\[1/2 50%\] \d+:\d\d elapsed, ~\d+:\d\d left llama: exact", err[0])
    assert re.fullmatch(r"\[2/2 100%\] \d+:\d\d elapsed, ~0:00 left mistral: exact", err[1])


@pytest.mark.skipif(accelerator_present(), reason="on a TPU host Tokamax may be what runs")
def test_the_first_kernelize_imports_no_tokamax_where_xla_runs() -> None:
    """Importing tokamax costs seconds; on a CPU XLA runs attention, so it is never imported."""
    child = (
        "import sys, torch, kernel_hub\n"
        "from kernel_hub.models.tiny import build_tiny_model\n"
        "model = build_tiny_model('llama')\n"
        "kernel_hub.kernelize(model)\n"
        "model(torch.tensor([[1, 5, 9]]))\n"
        "print('tokamax' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-P", "-c", child],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"


def test_kernelize_takes_hugging_face_kernels_modes() -> None:
    kernels = pytest.importorskip("kernels")
    from kernel_hub.layers.modes import Mode

    assert Mode.parse(kernels.Mode.INFERENCE) == Mode.INFERENCE
    assert Mode.parse(kernels.Mode.TRAINING | kernels.Mode.TORCH_COMPILE) == (
        Mode.TRAINING | Mode.TORCH_COMPILE
    )
    with pytest.raises(KernelHubError, match=r"kernels\.Mode\.FALLBACK has no kernel-hub"):
        Mode.parse(kernels.Mode.FALLBACK)
    report = kernelize(build_tiny_model("llama"), mode=kernels.Mode.INFERENCE)
    assert report.mode == "inference" and report.swapped


def test_hub_layer_mapping_warns_when_kernels_would_swap_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the pinned pair (transformers 5.24, kernels 0.17.2) Transformers' layer marks are
    inert: kernels.kernelize with the mapping leaves every forward stock, and the mapping says
    so instead of letting it pass in silence."""
    import warnings

    kernels = pytest.importorskip("kernels")
    from transformers.utils import import_utils

    from kernel_hub.layers.integrations.hf_kernels import hub_layer_mapping

    if import_utils.is_kernels_available():
        pytest.skip("this transformers accepts this kernels: its layers are marked")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.warns(UserWarning, match=r"kernels\.kernelize swaps no layer") as warned:
        mapping = hub_layer_mapping()
    assert "kernel_hub.kernelize(model)" in str(warned[0].message)
    model = build_tiny_model("llama")
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
    assert not [name for name, m in model.named_modules() if "forward" in vars(m)]
    monkeypatch.setattr(import_utils, "is_kernels_available", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hub_layer_mapping()  # a pair that works together: no warning
