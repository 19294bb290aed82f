"""The product's hub server (``kernel-hub serve``) on 127.0.0.1, with test hooks around it.

The server is :class:`kernel_hub.hub.server.HubServer` over a store directory, unchanged; this
module only adds what tests need to play a failing or compromised hub:

* ``inject_fault``: matching requests answer an HTTP status, or get a body cut short, or the
  server dies in the middle of the body (it stops listening, as a crashed process would), or the
  honest answer trickles out a byte every ``delay`` seconds after its headers (a stalled or
  dribbling hub; ``stop`` ends every trickle);
* ``chaos``: a function ``(method, path) -> Fault | None`` asked for every request no injected
  fault matches (random faults under load);
* ``tamper``: rewrite a file inside an existing commit, keeping the commit id (what a
  compromised mirror would serve);
* ``requests``: every request seen, ``(method, path)``;
* ``lie``: a function ``(method, path, status, body, headers) -> (status, body, headers)`` that
  rewrites every answer (a hostile hub: forged ETags, commit ids, listings, sizes).
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from kernel_hub.hub.server import HubRequestHandler, HubServer
from kernel_hub.hub.store import Commit, RepoStore

WRITE_TOKEN = "kernel-hub-test-write-token"
"""The test server's write token (the ``hub_env`` fixture sets it as ``HF_TOKEN``)."""


@dataclass
class Fault:
    """Matching requests get ``status`` with ``headers``, or a body cut after ``truncate_at``
    bytes (``die`` then stops the server), or with ``delay`` the honest answer a byte every
    ``delay`` seconds after its headers. ``times=None``: every matching request."""

    method: str
    path_regex: str
    status: int = 500
    truncate_at: int | None = None
    die: bool = False
    delay: float | None = None
    times: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    hits: int = 0


class _FaultyHandler(HubRequestHandler):
    def setup(self) -> None:
        super().setup()
        with self.server.harness.lock:
            self.server.harness.connections.add(self.connection)

    def finish(self) -> None:
        with self.server.harness.lock:
            self.server.harness.connections.discard(self.connection)
        super().finish()

    delay: float | None = None

    def send(self, status, body=b"", headers=None, content_type="application/json") -> None:
        lie = self.server.harness.lie
        if lie is not None:
            status, body, headers = lie(
                self.command, urlsplit(self.path).path, status, body, dict(headers or {})
            )
            if self.command != "HEAD":
                headers.pop("Content-Length", None)  # the length of the body actually sent
        if self.delay is None:
            super().send(status, body, headers, content_type)
        else:
            super().send(status, b"", {**(headers or {}), "Content-Length": str(len(body))})
            self._trickle(body)

    def _trickle(self, body: bytes) -> None:
        """A byte every ``delay`` seconds, until the body is sent or the server stops."""
        for byte in body:
            if self.server.harness.stopping.wait(self.delay):
                break
            self.wfile.write(bytes([byte]))
            self.wfile.flush()
        self.close_connection = True

    def handle_request(self, seg: list[str], query: dict) -> None:
        hub: TestHub = self.server.harness
        path = urlsplit(self.path).path
        with hub.lock:
            hub.requests.append((self.command, path))
        fault = hub.take_fault(self.command, path)
        if fault is None or fault.delay is not None:
            self.delay = fault.delay if fault is not None else None
            super().handle_request(seg, query)
        elif fault.truncate_at is None:
            self.body()
            self.send(fault.status, b'{"error": "injected fault"}', fault.headers)
        else:
            self._cut_short(seg, fault)

    def _cut_short(self, seg: list[str], fault: Fault) -> None:
        n = 1  # kernels/<org>/<name>/resolve/<rev>/<path>
        status, body, headers = self.file_response(
            "kernel", f"{seg[n]}/{seg[n + 1]}", seg[n + 3], "/".join(seg[n + 4 :])
        )
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body[: fault.truncate_at])
        self.wfile.flush()
        self.close_connection = True
        if fault.die:
            threading.Thread(target=self.server.harness.stop, daemon=True).start()


class TestHub:
    """``with TestHub(directory) as hub:`` serves ``directory`` on a free port of 127.0.0.1."""

    __test__ = False  # not a test class

    def __init__(self, directory: Path, max_requests: int = 1000):
        self.store = RepoStore(directory)
        self.max_requests = max_requests
        self.requests: list[tuple[str, str]] = []
        self.faults: list[Fault] = []
        self.lie: Callable[[str, str, int, bytes, dict], tuple[int, bytes, dict]] | None = None
        self.chaos: Callable[[str, str], Fault | None] | None = None
        self.lock = threading.RLock()
        self.connections: set[socket.socket] = set()
        self._server: HubServer | None = None
        self._port = 0
        self.stopped = threading.Event()
        self.stopping = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> TestHub:
        """Start (or restart, on the same port) the server."""
        self._server = HubServer(
            self.store,
            "127.0.0.1",
            self._port,
            handler=_FaultyHandler,
            write_token=WRITE_TOKEN,
            max_requests=self.max_requests,
        )
        self._server.harness = self
        self._port = self._server.server_address[1]
        self.stopped.clear()
        self.stopping.clear()
        self._server.start_in_thread()
        return self

    def stop(self) -> None:
        """Stop listening and cut every open connection, as a crashed server process would."""
        server, self._server = self._server, None
        self.stopping.set()
        if server is not None:
            server.shutdown()
            server.server_close()
        with self.lock:
            for connection in list(self.connections):
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
        self.stopped.set()

    def __enter__(self) -> TestHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- faults ----------------------------------------------------------------------------------
    def inject_fault(self, fault: Fault) -> Fault:
        with self.lock:
            self.faults.append(fault)
        return fault

    def take_fault(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.method == method and re.search(fault.path_regex, path):
                    fault.hits += 1
                    if fault.times is not None and fault.hits >= fault.times:
                        self.faults.remove(fault)
                    return fault
            return self.chaos(method, path) if self.chaos is not None else None

    def downloads(self, pattern: str = "") -> list[str]:
        """Paths of the file downloads (GET .../resolve/...) seen, optionally filtered."""
        with self.lock:
            return [p for m, p in self.requests if m == "GET" and "/resolve/" in p and pattern in p]

    # -- what the hub holds ----------------------------------------------------------------------
    def tags(self, repo: str) -> dict[str, str]:
        return self.store.refs("kernel", repo).tags

    def branches(self, repo: str) -> dict[str, str]:
        return self.store.refs("kernel", repo).branches

    def files(self, repo: str, revision: str) -> dict[str, bytes]:
        commit = self.store.resolve("kernel", repo, revision)
        return {p: self.store.read_blob(f) for p, f in commit.files.items()}

    def tamper(self, repo: str, revision: str, path: str, data: bytes | None) -> None:
        """Serve ``data`` for ``path`` at ``revision``'s commit from now on (same commit id);
        None removes the file."""
        commit = self.store.resolve("kernel", repo, revision)
        files = dict(commit.files)
        if data is None:
            del files[path]
        else:
            files[path] = self.store.put_blob(data)
        self.store.write_commit(
            "kernel", repo, Commit(commit.oid, commit.parent, commit.message, files)
        )
