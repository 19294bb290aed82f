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
ENV_FETCH_DEADLINE = "KERNEL_HUB_FETCH_DEADLINE"
ENV_RETRY_TIME = "KERNEL_HUB_RETRY_TIME"
ENV_MAX_RETRY_AFTER = "KERNEL_HUB_MAX_RETRY_AFTER"
ENV_MAX_PAGES = "KERNEL_HUB_MAX_PAGES"
ENV_MAX_API_BYTES = "KERNEL_HUB_MAX_API_BYTES"
ENV_STATE_DIR = "KERNEL_HUB_STATE_DIR"
# huggingface_hub's own timeout variables, honoured by kernel-hub's requests too.
ENV_DOWNLOAD_TIMEOUT = "HF_HUB_DOWNLOAD_TIMEOUT"
ENV_API_TIMEOUT = "HF_HUB_ETAG_TIMEOUT"

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


def state_dir() -> Path:
    """This user's kernel-hub state, kept outside the (possibly shared) hub cache:
    ``$KERNEL_HUB_STATE_DIR``, else ``$XDG_STATE_HOME/kernel-hub`` (``~/.local/state``)."""
    if os.environ.get(ENV_STATE_DIR):
        return Path(os.environ[ENV_STATE_DIR]).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base).expanduser() / "kernel-hub"


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


def _positive(name: str, default: float) -> float:
    """A positive number of seconds (or bytes, pages) from ``$name``, else ``default``."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number > 0 or number == float("inf"):
        raise KernelHubError(f"{name}={value!r}: expected a positive number")
    return number


def download_timeout() -> float:
    """Seconds to connect, and to wait for each part of a file (``HF_HUB_DOWNLOAD_TIMEOUT``)."""
    return _positive(ENV_DOWNLOAD_TIMEOUT, 10.0)


def api_timeout() -> float:
    """Seconds to connect, and to wait for each part of an API answer (``HF_HUB_ETAG_TIMEOUT``)."""
    return _positive(ENV_API_TIMEOUT, 10.0)


def fetch_deadline() -> float:
    """Seconds one whole fetch (resolve, list, download, verify, lock waits) may take."""
    return _positive(ENV_FETCH_DEADLINE, 900.0)


def retry_time() -> float:
    """Seconds one fetch may spend waiting between retries, all retries together."""
    return _positive(ENV_RETRY_TIME, 60.0)


def max_retry_after() -> float:
    """The longest ``Retry-After`` honoured; a hub asking for more is an error, not a wait."""
    return _positive(ENV_MAX_RETRY_AFTER, 30.0)


def max_pages() -> int:
    """Listing pages followed before the listing is refused."""
    return int(_positive(ENV_MAX_PAGES, 100))


def max_api_bytes() -> int:
    """Decoded bytes of one API answer (a listing page, refs) before it is refused."""
    return int(_positive(ENV_MAX_API_BYTES, 16 * 1024 * 1024))
