"""Hub settings read from the environment at call time, not at import.

``huggingface_hub`` reads ``HF_ENDPOINT``, ``HF_HUB_CACHE``/``HF_HOME`` and ``HF_HUB_OFFLINE`` once,
when it is imported. kernel-hub reads them again on every call and passes the endpoint, the cache
directory and ``local_files_only`` to ``huggingface_hub`` explicitly, so a setting made after import
(a notebook, a test) is honoured and kernel-hub never talks to a different hub than the one the
environment names. Unset variables fall back to ``huggingface_hub.constants``.
"""

from __future__ import annotations

import os
from pathlib import Path

from kernel_hub.errors import KernelHubError

DEFAULT_TRUSTED_PUBLISHERS = ("kernel-hub",)
LOCK_FILE_NAME = "kernel-hub.lock"
SOURCES = ("local", "hub")

# kernel-hub's own variables (documented in kernel_hub/hub/__init__.py).
ENV_SOURCE = "KERNEL_HUB_SOURCE"
ENV_LOCAL_KERNELS = "KERNEL_HUB_LOCAL_KERNELS"
ENV_TRUSTED_PUBLISHERS = "KERNEL_HUB_TRUSTED_PUBLISHERS"
ENV_LOCK = "KERNEL_HUB_LOCK"
ENV_VARIANT = "KERNEL_HUB_VARIANT"

_TRUE = {"1", "on", "yes", "true"}


def endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def cache_dir() -> Path:
    """The Hugging Face hub cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    if value is None:
        return bool(constants.HF_HUB_OFFLINE)
    return value.strip().lower() in _TRUE


def source() -> str | None:
    """``$KERNEL_HUB_SOURCE`` (``local`` or ``hub``), or None when unset."""
    value = os.environ.get(ENV_SOURCE, "").strip()
    if not value:
        return None
    if value not in SOURCES:
        raise KernelHubError(f"{ENV_SOURCE}={value!r}; valid values: {', '.join(SOURCES)}")
    return value


def trusted_publishers() -> tuple[str, ...]:
    """Hub organisations whose kernels are imported without ``trust_remote_code``."""
    value = os.environ.get(ENV_TRUSTED_PUBLISHERS)
    if value is None:
        return DEFAULT_TRUSTED_PUBLISHERS
    return tuple(org.strip() for org in value.split(",") if org.strip())


def local_kernel_overrides() -> dict[str, Path]:
    """``$KERNEL_HUB_LOCAL_KERNELS`` = ``op=/path,op2=/path``: ops loaded from a directory."""
    value = os.environ.get(ENV_LOCAL_KERNELS, "").strip()
    overrides: dict[str, Path] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        op, sep, path = item.partition("=")
        if not sep or not op.strip() or not path.strip():
            raise KernelHubError(
                f"{ENV_LOCAL_KERNELS}: bad entry {item!r}; expected 'op=/path[,op2=/path]'"
            )
        overrides[op.strip()] = Path(path.strip()).expanduser()
    return overrides


def lock_path() -> Path | None:
    """``$KERNEL_HUB_LOCK``, else ``./kernel-hub.lock`` if it exists, else None."""
    if os.environ.get(ENV_LOCK):
        return Path(os.environ[ENV_LOCK]).expanduser()
    candidate = Path.cwd() / LOCK_FILE_NAME
    return candidate if candidate.is_file() else None


def lock_named() -> bool:
    """Whether ``$KERNEL_HUB_LOCK`` names the lock: an explicit choice, unlike ./kernel-hub.lock."""
    return bool(os.environ.get(ENV_LOCK))


def variant_override() -> str | None:
    return os.environ.get(ENV_VARIANT, "").strip() or None
