"""The ``huggingface_hub`` client kernel-hub uses, and its errors turned into ``HubError``s."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from packaging.version import Version

from kernel_hub.errors import HubError, IntegrityError, KernelHubError
from kernel_hub.version import __version__

from . import network, settings
from .lockfile import COMMIT
from .versions import version_of_tag

if TYPE_CHECKING:
    from huggingface_hub import HfApi

REPO_TYPE = "kernel"
"""Kernel repos are the hub's ``kernel`` repo type, as Hugging Face ``kernels`` expects."""


def hub_api(token: str | bool | None = None) -> HfApi:
    """An ``HfApi`` bound to the endpoint the environment names now (see ``settings``)."""
    from huggingface_hub import HfApi

    return HfApi(
        endpoint=settings.endpoint(),
        token=token,
        library_name="kernel-hub",
        library_version=__version__,
    )


@contextlib.contextmanager
def hub_errors(what: str) -> Iterator[None]:
    """Re-raise ``huggingface_hub``/network failures as ``HubError`` starting with ``what``."""
    import httpx2
    from huggingface_hub.errors import (
        HfHubHTTPError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = settings.endpoint()
    try:
        yield
    except KernelHubError:
        raise
    except RepositoryNotFoundError:
        raise HubError(f"{what}: repository not found on {endpoint}") from None
    except RevisionNotFoundError as exc:
        raise HubError(f"{what}: revision not found on {endpoint} ({_first_line(exc)})") from None
    except RemoteEntryNotFoundError as exc:
        raise HubError(f"{what}: file not found on {endpoint} ({_first_line(exc)})") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise HubError(f"{what}: the hub at {endpoint} answered HTTP {status}") from exc
    except httpx2.HTTPError as exc:
        raise HubError(
            f"{what}: cannot reach the hub at {endpoint} ({type(exc).__name__}: {exc}); "
            "set HF_HUB_OFFLINE=1 to use cached builds only"
        ) from exc
    except OSError as exc:  # interrupted or inconsistent downloads, missing cache entries
        raise HubError(f"{what}: {type(exc).__name__}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def list_refs(
    repo: str, token: str | bool | None = None
) -> tuple[dict[Version, str], dict[str, str], dict[str, str]]:
    """(version tag -> commit, branch -> commit, tag -> commit) of ``repo``, every commit id
    checked to be 40 hex (a bounded request: :mod:`.network`)."""
    what = f"listing versions of {repo}"
    answer = network.get_json(network.api_url(REPO_TYPE, repo, "refs"), what, token=token)
    refs: dict[str, dict[str, str]] = {}
    for kind in ("tags", "branches"):
        listed = answer.get(kind) if isinstance(answer, dict) else None
        if not isinstance(listed, list) or not all(
            isinstance(ref, dict) and isinstance(ref.get("name"), str) for ref in listed
        ):
            raise IntegrityError(
                f"{what}: the hub at {settings.endpoint()} answered a malformed list of {kind}"
            )
        for ref in listed:
            commit = ref.get("targetCommit")
            if not isinstance(commit, str) or not COMMIT.match(commit):
                raise IntegrityError(
                    f"{what}: the hub at {settings.endpoint()} answered {commit!r} as the commit "
                    f"of {ref['name']!r}, not a 40-hex commit id"
                )
        refs[kind] = {ref["name"]: ref["targetCommit"] for ref in listed}
    tags, branches = refs["tags"], refs["branches"]
    versions = {
        v: commit for name, commit in tags.items() if (v := version_of_tag(name)) is not None
    }
    return versions, branches, tags
