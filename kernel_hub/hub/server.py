"""``kernel-hub serve``: the Hub's HTTP API over a :mod:`.store` directory (stdlib only).

It answers what ``huggingface_hub`` calls for what kernel-hub does, so a pod points
``HF_ENDPOINT`` at it and nothing else changes; the test suite runs the real client against it.

* read:  ``GET /api/{type}s/{repo}/refs``, ``GET /api/{type}s/{repo}[/revision/{rev}]``,
         ``GET /api/{type}s/{repo}/tree/{rev}[/{path}]``, ``HEAD``/``GET
         /{prefix}{repo}/resolve/{rev}/{path}`` (``X-Repo-Commit``, ``ETag``, ``X-Linked-Size``;
         ``Range: bytes=N-`` answered with 206, so interrupted downloads resume);
* write: ``POST /api/repos/create``, ``POST /api/{type}s/{repo}/preupload/{rev}`` (every file
         "regular", inlined in the commit), ``POST /api/{type}s/{repo}/commit/{rev}`` (NDJSON),
         ``POST .../tag/{rev}``, ``POST``/``DELETE .../branch/{name}``.

Errors carry the ``X-Error-Code`` the client maps to its exception types (``RepoNotFound``,
``RevisionNotFound``, ``EntryNotFound``).

Safe by default: read-only unless started with a write token, and then every write request must
carry it (``Authorization: Bearer <token>``, what ``huggingface_hub`` sends for ``HF_TOKEN``);
commit bodies are streamed to a file in the store (at most ``max_upload`` bytes), not held in
memory; at most ``max_requests`` requests are answered at once (more get 503 and
``Retry-After: 1``). Reads need no token: clients do not need to trust the server, builds are
verified against keys they hold (see docs/trust.md).
"""

from __future__ import annotations

import base64
import contextlib
import hmac
import json
import re
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO
from urllib.parse import parse_qs, unquote, urlsplit

from .store import Commit, RepoStore, StoredFile, StoreError

# repo type -> prefix of its file URLs (models have none); the API path uses "{type}s".
URL_PREFIXES = {"model": "", "dataset": "datasets/", "space": "spaces/", "kernel": "kernels/"}
_API_TYPES = {f"{t}s": t for t in URL_PREFIXES}
_RANGE = re.compile(r"bytes=(\d+)-")
MAX_JSON_BODY = 1 << 20
"""Request bodies other than commits (repo creation, tags, branches, preupload)."""
DEFAULT_MAX_UPLOAD = 256 << 20
DEFAULT_MAX_REQUESTS = 32
_WRITES = ("POST", "DELETE", "PUT", "PATCH")


class HubServer(ThreadingHTTPServer):
    """``HubServer(store, host, port).serve_forever()``; port 0 picks a free one."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        store: RepoStore,
        host: str = "127.0.0.1",
        port: int = 0,
        handler: type[HubRequestHandler] | None = None,
        *,
        write_token: str | None = None,
        max_upload: int = DEFAULT_MAX_UPLOAD,
        max_requests: int = DEFAULT_MAX_REQUESTS,
    ):
        if write_token is not None and len(write_token) < 16:
            raise ValueError("a write token needs at least 16 characters")
        self.store = store
        self.write_token = write_token
        self.max_upload = max_upload
        self.slots = threading.BoundedSemaphore(max_requests)
        super().__init__((host, port), handler or HubRequestHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start_in_thread(self) -> threading.Thread:
        thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        thread.start()
        return thread


def serve(
    directory: str | Path,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    write_token: str | None = None,
    max_upload: int = DEFAULT_MAX_UPLOAD,
    max_requests: int = DEFAULT_MAX_REQUESTS,
) -> HubServer:
    """A server over the store at ``directory``; read-only unless ``write_token`` is given."""
    return HubServer(
        RepoStore(directory),
        host,
        port,
        write_token=write_token,
        max_upload=max_upload,
        max_requests=max_requests,
    )


def tree_entries(commit: Commit, path: str, recursive: bool) -> list[dict]:
    prefix = path.strip("/") + "/" if path.strip("/") else ""
    if prefix and not any(p.startswith(prefix) for p in commit.files):
        raise StoreError(404, "EntryNotFound", f"{path} does not exist on this revision")
    entries: dict[str, dict] = {}
    for file_path, stored in sorted(commit.files.items()):
        if not file_path.startswith(prefix):
            continue
        rest = file_path[len(prefix) :].split("/")
        for depth in range(1, len(rest)):
            folder = prefix + "/".join(rest[:depth])
            entries.setdefault(folder, {"type": "directory", "path": folder, "oid": "0" * 40})
            if not recursive:
                break
        if recursive or len(rest) == 1:
            entries[file_path] = {
                "type": "file",
                "path": file_path,
                "size": stored.size,
                "oid": stored.oid,
            }
    return list(entries.values())


class HubRequestHandler(BaseHTTPRequestHandler):
    """One request. Subclasses may override ``handle_request`` (tests inject faults there)."""

    server: HubServer
    protocol_version = "HTTP/1.1"
    timeout = 60  # a client that stops talking does not hold a thread forever

    def log_message(self, format, *args) -> None:
        pass  # quiet: the CLI prints one line at start

    # -- plumbing --------------------------------------------------------------------------------
    def send(
        self,
        status: int,
        body: bytes = b"",
        headers: dict | None = None,
        content_type: str = "application/json",
    ) -> None:
        headers = dict(headers or {})
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", headers.pop("Content-Length", str(len(body))))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, data, status: int = 200) -> None:
        self.send(status, json.dumps(data).encode())

    def _length(self, limit: int) -> int:
        length = int(self.headers.get("Content-Length") or 0)
        if length > limit:
            raise StoreError(413, None, f"request body of {length} bytes, over {limit}")
        return length

    def body(self) -> bytes:
        return self.rfile.read(self._length(MAX_JSON_BODY))

    @contextlib.contextmanager
    def body_file(self) -> Iterator[IO[bytes]]:
        """The request body streamed into a temporary file of the store (at most the server's
        ``max_upload`` bytes), positioned at its start."""
        left = self._length(self.server.max_upload)
        with tempfile.TemporaryFile(dir=self.server.store.root) as spool:
            while left:
                chunk = self.rfile.read(min(left, 1 << 16))
                if not chunk:
                    raise StoreError(400, None, "the request body ended before its Content-Length")
                spool.write(chunk)
                left -= len(chunk)
            spool.seek(0)
            yield spool

    def _authorize(self) -> None:
        token = self.server.write_token
        if token is None:
            raise StoreError(403, None, "this server is read-only (started without --write-token)")
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise StoreError(
                401, None, "writes need the server's write token (HF_TOKEN on the client)"
            )

    def _dispatch(self) -> None:
        if not self.server.slots.acquire(blocking=False):
            self.close_connection = True
            self.send(503, b'{"error": "busy"}', {"Retry-After": "1"})
            return
        try:
            self._answer()
        finally:
            self.server.slots.release()

    def _answer(self) -> None:
        split = urlsplit(self.path)
        segments = [unquote(s) for s in split.path.strip("/").split("/")]
        query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        try:
            if self.command in _WRITES:
                self._authorize()
            self.handle_request(segments, query)
        except StoreError as error:
            self.close_connection = True  # the body may be unread
            headers = {"X-Error-Message": str(error)}
            if error.code:
                headers["X-Error-Code"] = error.code
            self.send(error.status, json.dumps({"error": str(error)}).encode(), headers)
        except (ValueError, KeyError, TypeError) as error:  # a malformed request body
            self.send(400, json.dumps({"error": f"bad request: {error}"}).encode())

    do_GET = do_HEAD = do_POST = do_DELETE = _dispatch

    def handle_request(self, seg: list[str], query: dict) -> None:
        if not self.route(seg, query):
            self.send(404, b'{"error": "no such endpoint"}')

    # -- routes ----------------------------------------------------------------------------------
    def route(self, seg: list[str], query: dict) -> bool:
        if self.command == "POST" and seg == ["api", "repos", "create"]:
            self._create_repo()
            return True
        if len(seg) >= 4 and seg[0] == "api" and seg[1] in _API_TYPES:
            return self._api(_API_TYPES[seg[1]], f"{seg[2]}/{seg[3]}", seg[4:], query)
        for repo_type, prefix in URL_PREFIXES.items():
            parts = prefix.strip("/").split("/") if prefix else []
            n = len(parts)
            if (
                seg[:n] == parts
                and len(seg) >= n + 5
                and seg[n + 2] == "resolve"
                and self.command in ("GET", "HEAD")
            ):
                repo_id = f"{seg[n]}/{seg[n + 1]}"
                self._resolve(repo_type, repo_id, seg[n + 3], "/".join(seg[n + 4 :]))
                return True
        return False

    def _create_repo(self) -> None:
        payload = json.loads(self.body())
        repo_type = payload.get("type") or "model"
        org = payload.get("organization") or "user"
        repo_id = f"{org}/{payload['name']}"
        url = f"{self.server.url}/{URL_PREFIXES.get(repo_type, '')}{repo_id}"
        try:
            self.server.store.create_repo(repo_type, repo_id)
        except StoreError as error:
            if error.status != 409:
                raise
            # the client reads the url when exist_ok=True
            self.send(409, json.dumps({"error": str(error), "url": url}).encode())
            return
        self._json({"url": url})

    def _api(self, repo_type: str, repo_id: str, rest: list[str], query: dict) -> bool:
        store = self.server.store
        method = self.command
        refs = store.refs(repo_type, repo_id)  # 404 RepoNotFound first, as the Hub does
        if method == "GET" and (rest == [] or (len(rest) == 2 and rest[0] == "revision")):
            commit = store.resolve(repo_type, repo_id, rest[1] if rest else "main")
            self._json(
                {
                    "id": repo_id,
                    "author": repo_id.split("/")[0],
                    "sha": commit.oid,
                    "private": False,
                    "lastModified": "2025-01-01T00:00:00.000Z",
                }
            )
            return True
        if method == "GET" and rest == ["refs"]:

            def listing(kind: str, names: dict[str, str]) -> list[dict]:
                return [
                    {"name": n, "ref": f"refs/{kind}/{n}", "targetCommit": oid}
                    for n, oid in sorted(names.items())
                ]

            self._json(
                {
                    "branches": listing("heads", refs.branches),
                    "tags": listing("tags", refs.tags),
                    "converts": [],
                }
            )
            return True
        if method == "GET" and len(rest) >= 2 and rest[0] == "tree":
            commit = store.resolve(repo_type, repo_id, rest[1])
            recursive = query.get("recursive", "False").lower() in ("1", "true")
            self._json(tree_entries(commit, "/".join(rest[2:]), recursive))
            return True
        if method == "POST" and len(rest) == 2 and rest[0] == "preupload":
            payload = json.loads(self.body())
            self._json(
                {
                    "files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                        for f in payload["files"]
                    ]
                }
            )
            return True
        if method == "POST" and len(rest) == 2 and rest[0] == "commit":
            commit = self._commit(repo_type, repo_id, rest[1])
            url = f"{self.server.url}/{URL_PREFIXES[repo_type]}{repo_id}/commit/{commit.oid}"
            self._json({"commitUrl": url, "commitOid": commit.oid, "pullRequestUrl": None})
            return True
        if method == "POST" and len(rest) == 2 and rest[0] == "tag":
            payload = json.loads(self.body())
            commit = store.resolve(repo_type, repo_id, rest[1])
            store.set_ref(repo_type, repo_id, "tag", payload["tag"], commit.oid, create=True)
            self._json({})
            return True
        if len(rest) == 2 and rest[0] == "branch" and method in ("POST", "DELETE"):
            body = self.body()
            if method == "DELETE":
                store.set_ref(repo_type, repo_id, "branch", rest[1], None, create=False)
            else:
                payload = json.loads(body or b"{}")
                start = store.resolve(repo_type, repo_id, payload.get("startingPoint") or "main")
                store.set_ref(repo_type, repo_id, "branch", rest[1], start.oid, create=True)
            self._json({})
            return True
        return False

    def _commit(self, repo_type: str, repo_id: str, branch: str) -> Commit:
        header: dict = {}
        added: dict[str, StoredFile] = {}
        deleted: list[str] = []
        folders: list[str] = []
        store = self.server.store
        with self.body_file() as body:
            for line in body:  # one file's content in memory at a time
                if not line.strip():
                    continue
                item = json.loads(line)
                key, value = item["key"], item["value"]
                if key == "header":
                    header = value
                elif key == "file":
                    added[value["path"]] = store.put_blob(base64.b64decode(value["content"]))
                elif key == "deletedFile":
                    deleted.append(value["path"])
                elif key == "deletedFolder":
                    folders.append(value["path"])
                else:
                    raise StoreError(400, None, f"unsupported commit operation {key!r}")
        return store.commit_files(
            repo_type,
            repo_id,
            branch,
            added=added,
            deleted=deleted,
            deleted_folders=folders,
            message=header.get("summary", ""),
            parent=header.get("parentCommit"),
        )

    def file_response(
        self, repo_type: str, repo_id: str, revision: str, path: str
    ) -> tuple[int, bytes, dict]:
        """(status, body, headers) for a file download, honouring ``Range: bytes=N-``."""
        store = self.server.store
        commit = store.resolve(repo_type, repo_id, revision)
        stored = commit.files.get(path)
        if stored is None:
            raise StoreError(404, "EntryNotFound", f"{path} does not exist at {commit.oid}")
        headers = {
            "X-Repo-Commit": commit.oid,
            "ETag": f'"{stored.oid}"',
            "X-Linked-Size": str(stored.size),
            "Accept-Ranges": "bytes",
        }
        if self.command == "HEAD":  # the content is read (and checked) only when sent
            headers["Content-Length"] = str(stored.size)
            return 200, b"", headers
        data = store.read_blob(stored)
        match = _RANGE.fullmatch(self.headers.get("Range", ""))
        if match and int(match.group(1)) < len(data):
            start = int(match.group(1))
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return 206, data[start:], headers
        return 200, data, headers

    def _resolve(self, repo_type: str, repo_id: str, revision: str, path: str) -> None:
        status, body, headers = self.file_response(repo_type, repo_id, revision, path)
        self.send(status, body, headers, content_type="application/octet-stream")
