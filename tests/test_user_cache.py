"""kernel-hub's user caches: where each lives, switched off by its variable, one warning per
cache and directory."""

from __future__ import annotations

import inspect
import os
import stat
import warnings

import pytest

from kernel_hub import user_cache


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(user_cache, "_warned", set())


def test_a_cache_lives_in_its_folder_of_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("MY_CACHE", raising=False)
    monkeypatch.delenv("MY_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache.user_cache_dir("mine", "MY_CACHE", "MY_CACHE_DIR") == (
        tmp_path / "xdg" / "kernel-hub" / "mine"
    )
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_cache.user_cache_dir("mine", "MY_CACHE", "MY_CACHE_DIR") == (
        tmp_path / "home" / ".cache" / "kernel-hub" / "mine"
    )
    monkeypatch.setenv("MY_CACHE_DIR", "~/elsewhere")
    assert user_cache.user_cache_dir("mine", "MY_CACHE", "MY_CACHE_DIR") == (
        tmp_path / "home" / "elsewhere"
    )


@pytest.mark.parametrize("value", ["0", "off", "OFF", " false ", "no"])
def test_its_variable_switches_it_off(value, monkeypatch):
    monkeypatch.setenv("MY_CACHE", value)
    monkeypatch.setenv("MY_CACHE_DIR", "/somewhere")
    assert user_cache.user_cache_dir("mine", "MY_CACHE", "MY_CACHE_DIR") is None


@pytest.mark.parametrize("value", ["1", "on", "yes", ""])
def test_other_values_leave_it_on(value, monkeypatch):
    monkeypatch.setenv("MY_CACHE", value)
    monkeypatch.setenv("MY_CACHE_DIR", "/somewhere")
    assert str(user_cache.user_cache_dir("mine", "MY_CACHE", "MY_CACHE_DIR")) == "/somewhere"


def test_a_warning_is_given_once_per_cache_and_directory(tmp_path):
    def warn(cache, directory):
        user_cache.warn_once((cache, directory), f"{cache} {directory} is not written")

    with pytest.warns(RuntimeWarning) as caught:
        warn("figure cache", tmp_path)
        warn("figure cache", tmp_path)
        warn("compilation cache", tmp_path)  # another cache in the same directory
        warn("figure cache", tmp_path / "other")
    assert [str(w.message) for w in caught] == [
        f"figure cache {tmp_path} is not written",
        f"compilation cache {tmp_path} is not written",
        f"figure cache {tmp_path / 'other'} is not written",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn("figure cache", tmp_path)


def test_the_warning_points_at_the_callers_line():
    def inner():
        user_cache.warn_once("key", "message", stacklevel=2)  # the line that called inner

    with pytest.warns(RuntimeWarning) as caught:
        calling_line = inspect.currentframe().f_lineno + 1
        inner()
    assert (caught[0].filename, caught[0].lineno) == (__file__, calling_line)


def test_a_cache_directory_is_made_for_this_user_alone(tmp_path):
    directory = tmp_path / "a" / "cache"
    previous = os.umask(0o002)  # a user-private-group umask: new folders group-writable
    try:
        user_cache.make_private_dir(directory)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert user_cache.others_can_write(directory) is None


@pytest.mark.parametrize("mode", [0o770, 0o722, 0o1777])
def test_a_directory_the_group_or_everyone_can_write_is_not_private(tmp_path, mode):
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(mode)
    assert user_cache.others_can_write(directory) == (
        f"others can write it (mode {mode:o}; chmod go-w fixes that)"
    )


def test_a_directory_of_another_user_is_not_private(tmp_path):
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    try:
        os.chown(directory, os.geteuid() + 1, -1)
    except PermissionError:
        pytest.skip("giving a folder to another user needs root")
    assert user_cache.others_can_write(directory) == (
        f"it belongs to user id {os.geteuid() + 1}, not to this user ({os.geteuid()})"
    )


def test_the_compilation_cache_is_off_in_a_directory_others_can_write(tmp_path, monkeypatch):
    """JAX runs a cached executable as it reads it: a shared folder would let a neighbour choose
    a kernel's code, so the bridge compiles without the cache there."""
    import jax

    from kernel_hub.bridge import compile_cache

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setattr(compile_cache, "_override", shared)
    match = rf"compilation cache {shared} is not used: others can write it \(mode 777"
    with pytest.warns(RuntimeWarning, match=match), compile_cache.persistent_cache():
        assert jax.config.jax_compilation_cache_dir is None
        jax.jit(lambda x: x * 3.0 + 1.0)(jax.numpy.ones(3)).block_until_ready()
    assert list(shared.iterdir()) == []
    private = tmp_path / "private"
    monkeypatch.setattr(compile_cache, "_override", private)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with compile_cache.persistent_cache():
            assert jax.config.jax_compilation_cache_dir == str(private)
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
