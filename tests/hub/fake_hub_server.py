"""A small Hugging Face Hub-compatible HTTP server for tests (stdlib only, 127.0.0.1).

It implements the endpoints that ``huggingface_hub`` 2.4 calls for what kernel-hub does, so the
real client code runs end to end:

* read:   ``GET /api/{type}s/{repo}/refs``, ``GET /api/{type}s/{repo}[/revision/{rev}]``
          (repo info), ``GET /api/{type}s/{repo}/tree/{rev}[/{path}]``,
          ``HEAD``/``GET /{prefix}{repo}/resolve/{rev}/{path}`` (``X-Repo-Commit``, ``ETag``,
          ``X-Linked-Size``, ``Content-Length``; ``Range`` requests answered with 206);
* write:  ``POST /api/repos/create``, ``POST /api/{type}s/{repo}/preupload/{rev}`` (every file
          is "regular", i.e. inlined in the commit), ``POST /api/{type}s/{repo}/commit/{rev}``
          (NDJSON),
          ``POST .../tag/{rev}``, ``POST``/``DELETE .../branch/{name}``.

Errors carry the ``X-Error-Code`` header (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``)
the client maps to its exception types. Repos live in memory; commits are whole snapshots.

Test hooks: ``tamper`` rewrites a file inside an existing commit (what a compromised mirror would
serve), ``inject_fault`` makes matching requests answer an HTTP status or cut a download short,
``requests`` records every request, ``unhandled`` every request no route matched.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

# repo type -> prefix of its file URLs (models have none); the API path uses "{type}s".
_URL_PREFIXES = {"model": "", "dataset": "datasets/", "space": "spaces/", "kernel": "kernels/"}
_API_TYPES = {f"{t}s": t for t in _URL_PREFIXES}
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    oid: str
    parent: str | None
    files: dict[str, bytes]
    message: str


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit | None:
        oid = self.branches.get(revision) or self.tags.get(revision)
        if oid is None and _COMMIT_RE.match(revision):
            oid = revision
        return self.commits.get(oid) if oid else None


@dataclass
class Fault:
    """Matching requests get ``status`` (or a body cut after ``truncate_at`` bytes)."""

    method: str
    path_regex: str
    status: int = 500
    truncate_at: int | None = None
    times: int | None = None  # None: every matching request


class HubError(Exception):
    def __init__(
        self,
        status: int,
        code: str | None,
        message: str,
        commit: str | None = None,
        body: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.code, self.commit, self.body = status, code, commit, body or {}


class FakeHub:
    """The server; ``with FakeHub() as hub:`` starts it on a free port of 127.0.0.1."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], Repo] = {}
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str]] = []
        self.unhandled: list[tuple[str, str]] = []
        self._lock = threading.RLock()
        self._counter = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._server is not None, "server not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- test hooks ------------------------------------------------------------------------------
    def repo(self, repo_id: str, repo_type: str = "kernel") -> Repo:
        return self.repos[(repo_type, repo_id)]

    def tamper(
        self, repo_id: str, revision: str, path: str, data: bytes, repo_type: str = "kernel"
    ):
        """Serve ``data`` for ``path`` at ``revision``'s commit from now on (same commit id)."""
        with self._lock:
            commit = self.repo(repo_id, repo_type).resolve(revision)
            assert commit is not None, f"no revision {revision}"
            commit.files[path] = data

    def inject_fault(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            self.faults.clear()

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.method == method and re.search(fault.path_regex, path):
                    if fault.times is not None:
                        fault.times -= 1
                        if fault.times <= 0:
                            self.faults.remove(fault)
                    return fault
        return None

    # -- repository operations -------------------------------------------------------------------
    def _new_oid(self, *parts: str) -> str:
        self._counter += 1
        return hashlib.sha1("\0".join([str(self._counter), *parts]).encode()).hexdigest()

    def create_repo(self, repo_type: str, repo_id: str) -> Repo:
        with self._lock:
            if (repo_type, repo_id) in self.repos:
                raise HubError(409, None, f"You already created this {repo_type} repo")
            repo = Repo(repo_type, repo_id)
            initial = Commit(
                self._new_oid(repo_id), None, {".gitattributes": b""}, "initial commit"
            )
            repo.commits[initial.oid] = initial
            repo.branches["main"] = initial.oid
            self.repos[(repo_type, repo_id)] = repo
            return repo

    def get_repo(self, repo_type: str, repo_id: str) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise HubError(404, "RepoNotFound", f"Repository {repo_id} not found")
        return repo

    def get_commit(self, repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit

    def commit(self, repo: Repo, branch: str, lines: list[dict]) -> Commit:
        with self._lock:
            if branch not in repo.branches:
                raise HubError(404, "RevisionNotFound", f"Invalid rev id: {branch}")
            head = repo.commits[repo.branches[branch]]
            files = dict(head.files)
            header = {}
            for line in lines:
                key, value = line["key"], line["value"]
                if key == "header":
                    header = value
                elif key == "file":
                    files[value["path"]] = base64.b64decode(value["content"])
                elif key == "deletedFile":
                    if files.pop(value["path"], None) is None:
                        raise HubError(
                            404,
                            "EntryNotFound",
                            f"A file with this name doesn't exist: {value['path']}",
                        )
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    for path in [p for p in files if p.startswith(prefix)]:
                        del files[path]
                else:
                    raise HubError(400, None, f"unsupported commit operation {key!r}")
            parent = header.get("parentCommit")
            if parent is not None and parent != head.oid:
                raise HubError(412, None, f"parent commit {parent} is not the head of {branch}")
            new = Commit(
                self._new_oid(head.oid, header.get("summary", "")),
                head.oid,
                files,
                header.get("summary", ""),
            )
            repo.commits[new.oid] = new
            repo.branches[branch] = new.oid
            return new


def _tree_entries(commit: Commit, path: str, recursive: bool) -> list[dict]:
    prefix = path.strip("/") + "/" if path.strip("/") else ""
    if prefix and not any(p.startswith(prefix) for p in commit.files):
        raise HubError(404, "EntryNotFound", f"{path} does not exist on this revision")
    entries: dict[str, dict] = {}
    for file_path, data in sorted(commit.files.items()):
        if not file_path.startswith(prefix):
            continue
        rest = file_path[len(prefix) :].split("/")
        for depth in range(1, len(rest)):
            folder = prefix + "/".join(rest[:depth])
            entries.setdefault(
                folder,
                {
                    "type": "directory",
                    "path": folder,
                    "oid": hashlib.sha1(folder.encode()).hexdigest(),
                },
            )
            if not recursive:
                break
        if recursive or len(rest) == 1:
            entries[file_path] = {
                "type": "file",
                "path": file_path,
                "size": len(data),
                "oid": git_blob_oid(data),
            }
    return list(entries.values())


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # keep test output clean
        pass

    # -- plumbing --------------------------------------------------------------------------------
    def _send(
        self,
        status: int,
        body: bytes = b"",
        headers: dict | None = None,
        content_type: str = "application/json",
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, data, status: int = 200) -> None:
        self._send(status, json.dumps(data).encode())

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _dispatch(self) -> None:
        split = urlsplit(self.path)
        segments = [unquote(s) for s in split.path.strip("/").split("/")]
        query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        self.hub.requests.append((self.command, split.path))
        fault = self.hub._take_fault(self.command, split.path)
        if fault is not None and fault.truncate_at is None:
            body = self._body() if self.command in ("POST", "PUT") else b""
            del body
            self._send(fault.status, json.dumps({"error": "injected fault"}).encode())
            return
        try:
            if not self._route(segments, query, fault):
                self.hub.unhandled.append((self.command, split.path))
                self._send(404, b'{"error": "no such endpoint"}')
        except HubError as error:
            headers = {"X-Error-Message": str(error)}
            if error.code:
                headers["X-Error-Code"] = error.code
            if error.commit:
                headers["X-Repo-Commit"] = error.commit
            self._send(
                error.status, json.dumps({"error": str(error), **error.body}).encode(), headers
            )

    do_GET = do_HEAD = do_POST = do_DELETE = _dispatch

    # -- routes ----------------------------------------------------------------------------------
    def _route(self, seg: list[str], query: dict, fault: Fault | None) -> bool:
        hub = self.hub
        if self.command == "POST" and seg == ["api", "repos", "create"]:
            payload = json.loads(self._body())
            repo_type = payload.get("type") or "model"
            repo_id = f"{payload['organization']}/{payload['name']}"
            url = f"{self.hub.url}/{_URL_PREFIXES[repo_type]}{repo_id}"
            try:
                hub.create_repo(repo_type, repo_id)
            except HubError as error:
                error.body["url"] = url  # the client reads it when exist_ok=True
                raise
            self._json({"url": url})
            return True
        if len(seg) >= 4 and seg[0] == "api" and seg[1] in _API_TYPES:
            return self._api(_API_TYPES[seg[1]], f"{seg[2]}/{seg[3]}", seg[4:], query)
        for repo_type, prefix in _URL_PREFIXES.items():
            parts = prefix.strip("/").split("/") if prefix else []
            n = len(parts)
            if seg[:n] == parts and len(seg) >= n + 5 and seg[n + 2] == "resolve":
                repo_id = f"{seg[n]}/{seg[n + 1]}"
                if self.command in ("GET", "HEAD"):
                    self._resolve(repo_type, repo_id, seg[n + 3], "/".join(seg[n + 4 :]), fault)
                    return True
        return False

    def _api(self, repo_type: str, repo_id: str, rest: list[str], query: dict) -> bool:
        hub = self.hub
        repo = hub.get_repo(repo_type, repo_id)
        method = self.command
        if method == "GET" and (rest == [] or (len(rest) == 2 and rest[0] == "revision")):
            commit = hub.get_commit(repo, rest[1] if rest else "main")
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

            def refs(kind: str, names: dict[str, str]) -> list[dict]:
                return [
                    {"name": n, "ref": f"refs/{kind}/{n}", "targetCommit": oid}
                    for n, oid in sorted(names.items())
                ]

            self._json(
                {
                    "branches": refs("heads", repo.branches),
                    "tags": refs("tags", repo.tags),
                    "converts": [],
                }
            )
            return True
        if method == "GET" and len(rest) >= 2 and rest[0] == "tree":
            commit = hub.get_commit(repo, rest[1])
            recursive = query.get("recursive", "False").lower() in ("1", "true")
            self._json(_tree_entries(commit, "/".join(rest[2:]), recursive))
            return True
        if method == "POST" and len(rest) == 2 and rest[0] == "preupload":
            payload = json.loads(self._body())
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
            lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
            commit = hub.commit(repo, rest[1], lines)
            url = f"{hub.url}/{_URL_PREFIXES[repo_type]}{repo_id}/commit/{commit.oid}"
            self._json({"commitUrl": url, "commitOid": commit.oid, "pullRequestUrl": None})
            return True
        if method == "POST" and len(rest) == 2 and rest[0] == "tag":
            payload = json.loads(self._body())
            with hub._lock:
                commit = hub.get_commit(repo, rest[1])
                if payload["tag"] in repo.tags:
                    raise HubError(409, None, f"tag {payload['tag']} already exists")
                repo.tags[payload["tag"]] = commit.oid
            self._json({})
            return True
        if len(rest) == 2 and rest[0] == "branch" and method in ("POST", "DELETE"):
            body = self._body()
            with hub._lock:
                if method == "DELETE":
                    if repo.branches.pop(rest[1], None) is None:
                        raise HubError(404, "RevisionNotFound", f"Invalid rev id: {rest[1]}")
                else:
                    payload = json.loads(body or b"{}")
                    if rest[1] in repo.branches:
                        raise HubError(409, None, f"branch {rest[1]} already exists")
                    start = hub.get_commit(repo, payload.get("startingPoint") or "main")
                    repo.branches[rest[1]] = start.oid
            self._json({})
            return True
        return False

    def _resolve(self, repo_type: str, repo_id: str, revision: str, path: str, fault) -> None:
        hub = self.hub
        repo = hub.get_repo(repo_type, repo_id)
        commit = hub.get_commit(repo, revision)
        data = commit.files.get(path)
        if data is None:
            raise HubError(404, "EntryNotFound", f"{path} does not exist", commit=commit.oid)
        headers = {
            "X-Repo-Commit": commit.oid,
            "ETag": f'"{git_blob_oid(data)}"',
            "X-Linked-Size": str(len(data)),
            "Accept-Ranges": "bytes",
        }
        status, body = 200, data
        match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if match and self.command == "GET":
            start = int(match.group(1))
            status, body = 206, data[start:]
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if fault is not None and fault.truncate_at is not None and self.command == "GET":
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body[: fault.truncate_at])
            self.wfile.flush()
            self.close_connection = True
            return
        self._send(status, body, headers, content_type="application/octet-stream")
