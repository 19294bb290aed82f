"""kernel-hub's user caches: where each lives, switched off by its variable, one warning per
cache and directory."""

from __future__ import annotations

import inspect
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
