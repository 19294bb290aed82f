"""Every read request of kernel-hub's hub client, bounded in time and in size.

``huggingface_hub``'s session has no timeout, its retries honour any ``Retry-After`` and it
decompresses answers and follows listing pages without a cap (docs/trust.md, availability). Here
every GET goes through :func:`get`, on ``huggingface_hub``'s session (its proxies, certificates and
client factory still apply) but with:

* connect and read timeouts (``HF_HUB_DOWNLOAD_TIMEOUT`` for files, ``HF_HUB_ETAG_TIMEOUT`` for API
  answers), retries of 429/5xx answers and transport failures with a capped ``Retry-After``
  (``KERNEL_HUB_MAX_RETRY_AFTER``) and a capped total wait (``KERNEL_HUB_RETRY_TIME``);
* every body decoded by kernel-hub, stopped at a cap on the decoded bytes (a gzip bomb ends at the
  cap, not in memory); listings stop after ``KERNEL_HUB_MAX_PAGES`` pages;
* one deadline for a whole fetch (:func:`deadline`, ``KERNEL_HUB_FETCH_DEADLINE``), lock waits
  included.

Each limit reached is a ``HubError`` naming the limit and the variable that changes it.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from kernel_hub.errors import HubError
from kernel_hub.version import __version__

from . import settings

ATTEMPTS = 5
"""Tries of one request (the first and four retries), within the retry time and deadline."""
RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})
_CHUNK = 1 << 16
_NEXT_PAGE = re.compile(r'<([^>]*)>\s*;\s*rel="?next"?')


class MissingOnHub(HubError):
    """The hub answered that the file does not exist at that commit."""


class Unreachable(HubError):
    """No connection to the hub could be made (after the retries): the network or the hub is
    down, as opposed to a hub that answered."""


@dataclass
class _Budget:
    seconds: float
    ends: float
    """``time.monotonic()`` at the deadline."""
    retry_left: float


_budget: ContextVar[_Budget | None] = ContextVar("kernel_hub_fetch_budget", default=None)


@contextlib.contextmanager
def deadline() -> Iterator[None]:
    """Everything inside is one fetch: one deadline and one retry allowance. Nested, the outer
    one holds; a request made outside any gets its own."""
    if _budget.get() is not None:
        yield
        return
    seconds = settings.fetch_deadline()
    token = _budget.set(_Budget(seconds, time.monotonic() + seconds, settings.retry_time()))
    try:
        yield
    finally:
        _budget.reset(token)


def remaining(what: str) -> float:
    """Seconds left before the current fetch's deadline; past it, the ``HubError``."""
    budget = _budget.get()
    if budget is None:
        return settings.fetch_deadline()
    left = budget.ends - time.monotonic()
    if left <= 0:
        raise deadline_error(what)
    return left


def deadline_error(what: str) -> HubError:
    budget = _budget.get()
    seconds = budget.seconds if budget is not None else settings.fetch_deadline()
    return HubError(
        f"{what}: gave up at the fetch deadline of {seconds:g} s "
        f"(set {settings.ENV_FETCH_DEADLINE} to change it)"
    )


def api_url(repo_type: str, repo: str, *parts: str) -> str:
    quoted = "/".join(quote(part, safe="") for part in parts)
    return f"{settings.endpoint()}/api/{repo_type}s/{repo}/{quoted}"


def get_json(url: str, what: str, *, token: str | bool | None = None) -> Any:
    """One API answer, parsed (at most ``KERNEL_HUB_MAX_API_BYTES`` decoded bytes)."""
    return _get_json_page(url, what, token)[0]


def get_pages(url: str, what: str, *, token: str | bool | None = None) -> Iterator[Any]:
    """A paginated API listing, page by page (the ``Link: rel=next`` header), at most
    ``KERNEL_HUB_MAX_PAGES`` pages, each only from the hub's own origin."""
    origin = urlsplit(settings.endpoint())[:2]
    cap = settings.max_pages()
    for page in range(1, cap + 2):
        if page > cap:
            raise HubError(
                f"{what}: the listing has more than {cap} pages "
                f"(set {settings.ENV_MAX_PAGES} to follow more)"
            )
        data, headers = _get_json_page(url, what, token)
        yield data
        found = _NEXT_PAGE.search(headers.get("Link", ""))
        if found is None:
            return
        url = found.group(1)
        if urlsplit(url)[:2] != origin:
            raise HubError(f"{what}: the next listing page is on another host ({url!r})")


def _get_json_page(url: str, what: str, token: str | bool | None) -> tuple[Any, Mapping]:
    cap = settings.max_api_bytes()
    chunks: list[bytes] = []
    headers = get(
        url,
        what,
        limit=cap,
        sink=chunks.append,
        restart=chunks.clear,
        download=False,
        token=token,
        too_large=lambda: HubError(
            f"{what}: the answer is larger than {cap} bytes "
            f"(set {settings.ENV_MAX_API_BYTES} to allow more)"
        ),
    )
    try:
        return json.loads(b"".join(chunks)), headers
    except ValueError:
        raise HubError(
            f"{what}: the hub at {settings.endpoint()} answered something that is not JSON"
        ) from None


class _Retry(Exception):
    def __init__(self, reason: str, wait: float, unreachable: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.wait = wait
        self.error = Unreachable if unreachable else HubError


def get(
    url: str,
    what: str,
    *,
    limit: int,
    sink: Callable[[bytes], None],
    restart: Callable[[], None],
    download: bool,
    too_large: Callable[[], Exception],
    token: str | bool | None = None,
) -> Mapping[str, str]:
    """GET ``url`` into ``sink`` (decoded bytes, at most ``limit``, else ``too_large()``);
    retried from the start (``restart`` empties the sink) on 429/5xx answers and transport
    failures. Returns the answer's headers. ``what`` starts error messages."""
    with deadline():
        for attempt in range(ATTEMPTS):
            try:
                return _get_once(url, what, limit, sink, download, too_large, token, attempt)
            except _Retry as retry:
                if attempt == ATTEMPTS - 1:
                    raise retry.error(
                        f"{what}: {retry.reason} (gave up after {ATTEMPTS} tries)"
                    ) from None
                _wait(retry, what)
            restart()
    raise AssertionError("unreachable")  # pragma: no cover


def _wait(retry: _Retry, what: str) -> None:
    budget = _budget.get()
    assert budget is not None  # get() runs inside deadline()
    if retry.wait > budget.retry_left:
        raise retry.error(
            f"{what}: {retry.reason}; retrying would wait past the retry time of "
            f"{settings.retry_time():g} s (set {settings.ENV_RETRY_TIME} to change it)"
        )
    if retry.wait >= remaining(what):
        raise deadline_error(what) from None
    budget.retry_left -= retry.wait
    time.sleep(retry.wait)


def _get_once(url, what, limit, sink, download, too_large, token, attempt) -> Mapping[str, str]:
    import httpx2
    from huggingface_hub.utils import build_hf_headers, get_session

    timeout = settings.download_timeout() if download else settings.api_timeout()
    variable = settings.ENV_DOWNLOAD_TIMEOUT if download else settings.ENV_API_TIMEOUT
    headers = build_hf_headers(token=token, library_name="kernel-hub", library_version=__version__)
    headers["Accept-Encoding"] = "identity"  # gzip sent anyway is still decoded under the cap
    backoff = float(min(8, 2**attempt))
    try:
        with get_session().stream(
            "GET",
            url,
            headers=headers,
            timeout=httpx2.Timeout(min(timeout, remaining(what))),
            follow_redirects=True,
        ) as answer:
            status = answer.status_code
            if status in RETRIED_STATUSES:
                reason = f"the hub at {settings.endpoint()} answered HTTP {status}"
                raise _Retry(reason, max(backoff, _retry_after(answer.headers, what, reason)))
            if status >= 400:
                raise _status_error(status, answer.headers, what)
            declared = answer.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > limit:
                raise too_large()
            _read(answer, what, limit, sink, too_large)
            return answer.headers
    except httpx2.TimeoutException as exc:
        if remaining(what) <= timeout:
            raise deadline_error(what) from None
        reason = f"no answer from {settings.endpoint()} within {timeout:g} s ({type(exc).__name__})"
        connect = isinstance(exc, httpx2.ConnectTimeout)
        raise _Retry(f"{reason}; set {variable} to wait longer", backoff, connect) from None
    except httpx2.TransportError as exc:
        reason = f"cannot reach the hub at {settings.endpoint()} ({type(exc).__name__}: {exc})"
        unreachable = isinstance(exc, httpx2.ConnectError)
        raise _Retry(
            f"{reason}; set HF_HUB_OFFLINE=1 to use cached builds only", backoff, unreachable
        ) from None


def _retry_after(headers: Mapping[str, str], what: str, reason: str) -> float:
    value = headers.get("Retry-After", "").strip()
    if not value.isdigit():
        return 0.0
    cap = settings.max_retry_after()
    if int(value) > cap:
        raise HubError(
            f"{what}: {reason} with Retry-After: {value} s, longer than the {cap:g} s kernel-hub "
            f"waits (set {settings.ENV_MAX_RETRY_AFTER} to wait longer)"
        )
    return float(value)


def _status_error(status: int, headers: Mapping[str, str], what: str) -> HubError:
    endpoint = settings.endpoint()
    if status == 404:
        code = headers.get("X-Error-Code", "")
        if code == "RepoNotFound":
            return HubError(f"{what}: repository not found on {endpoint}")
        if code == "RevisionNotFound":
            return HubError(f"{what}: revision not found on {endpoint}")
        return MissingOnHub(f"{what}: file not found on {endpoint}")
    return HubError(f"{what}: the hub at {endpoint} answered HTTP {status}")


def _read(answer, what: str, limit: int, sink, too_large) -> None:
    """The body into ``sink``, decoded here (gzip/deflate a bounded chunk at a time)."""
    encoding = answer.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity", "gzip", "deflate"):
        raise HubError(
            f"{what}: the hub sent Content-Encoding {encoding!r}; kernel-hub asked for "
            "identity and decodes only gzip and deflate"
        )
    decoder = zlib.decompressobj(wbits=47) if encoding in ("gzip", "deflate") else None
    size = 0

    def emit(data: bytes) -> None:
        nonlocal size
        size += len(data)
        if size > limit:
            raise too_large()
        sink(data)

    try:
        for raw in answer.iter_raw():  # as it arrives, so the deadline is checked
            remaining(what)
            if decoder is None:
                emit(raw)
                continue
            emit(decoder.decompress(raw, _CHUNK))
            while decoder.unconsumed_tail:
                emit(decoder.decompress(decoder.unconsumed_tail, _CHUNK))
        if decoder is not None:
            while data := decoder.decompress(b"", _CHUNK):
                emit(data)
            emit(decoder.flush())
    except zlib.error as exc:
        raise HubError(
            f"{what}: the hub sent a body that is not valid {encoding} ({exc})"
        ) from None
