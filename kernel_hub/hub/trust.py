"""Who may run code on this machine: downloaded kernels come from allowlisted publishers only.

The allowlist is ``$KERNEL_HUB_TRUSTED_PUBLISHERS`` (comma-separated organisations; default: the
project's own ``kernel-hub``). ``trust_remote_code=True`` trusts any repo; a list of
organisations or ``org/name`` repo ids trusts those in addition. The check needs no network, so
it runs offline too, and it runs before anything is downloaded.
"""

from __future__ import annotations

from collections.abc import Iterable

from kernel_hub.errors import UntrustedSourceError

from . import settings

TrustRemoteCode = bool | Iterable[str]


def check_trusted(repo: str, trust_remote_code: TrustRemoteCode = False) -> None:
    if trust_remote_code is True:
        return
    publisher = repo.split("/", 1)[0]
    trusted = set(settings.trusted_publishers())
    if trust_remote_code is not False:
        trusted.update(trust_remote_code)
    if publisher in trusted or repo in trusted:
        return
    listing = ", ".join(sorted(settings.trusted_publishers())) or "(none)"
    raise UntrustedSourceError(
        f"{repo} is published by {publisher!r}, which is not a trusted publisher "
        f"(trusted: {listing}); refusing to import its code. Pass trust_remote_code=True or "
        f"trust_remote_code=[{repo!r}], or add {publisher!r} to ${settings.ENV_TRUSTED_PUBLISHERS}"
    )
