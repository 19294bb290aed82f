"""``kernel-hub serve`` is safe by default: read-only without a write token, every write checked
against it, commit bodies streamed to disk under a size cap, and a cap on requests answered at
once."""

from __future__ import annotations

import base64
import http.client
import json
import socket
import time
import tracemalloc
from contextlib import contextmanager

import pytest

from kernel_hub.hub.server import serve

TOKEN = "a-write-token-for-this-test"
REPO = "org/kernel"


@contextmanager
def running(tmp_path, **options):
    (tmp_path / "store").mkdir(exist_ok=True)
    server = serve(tmp_path / "store", **options)
    server.start_in_thread()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def call(server, method, path, body=b"", token=None):
    host, port = server.server_address[:2]
    connection = http.client.HTTPConnection(host, port, timeout=10)
    headers = {"Content-Length": str(len(body)), "Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    try:
        connection.request(method, path, body=body, headers=headers)
        answer = connection.getresponse()
        return answer.status, answer.read(), dict(answer.getheaders())
    finally:
        connection.close()


def post_headers(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def commit_body(files: dict[str, bytes]) -> bytes:
    lines = [{"key": "header", "value": {"summary": "test"}}]
    lines += [
        {"key": "file", "value": {"path": p, "content": base64.b64encode(d).decode()}}
        for p, d in files.items()
    ]
    return "\n".join(json.dumps(line) for line in lines).encode()


CREATE = (
    "POST",
    "/api/repos/create",
    json.dumps({"type": "kernel", "name": "kernel", "organization": "org"}).encode(),
)
WRITES = [
    CREATE,
    ("POST", f"/api/kernels/{REPO}/commit/main", commit_body({"a.txt": b"a"})),
    ("POST", f"/api/kernels/{REPO}/tag/main", b'{"tag": "v1.0.0"}'),
    ("POST", f"/api/kernels/{REPO}/branch/v1", b"{}"),
    ("DELETE", f"/api/kernels/{REPO}/branch/main", b""),
]


def store_state(tmp_path) -> dict[str, bytes]:
    root = tmp_path / "store"
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(("method", "path", "body"), WRITES)
def test_writes_are_refused_without_the_token(tmp_path, method, path, body):
    with running(tmp_path, write_token=TOKEN) as server:
        assert call(server, *CREATE, token=TOKEN)[0] == 200
        before = store_state(tmp_path)
        for token in (None, "wrong-token-wrong-token"):
            status, answer, _ = call(server, method, path, body, token=token)
            assert status == 401 and b"write token" in answer
        assert store_state(tmp_path) == before
        assert call(server, "GET", f"/api/kernels/{REPO}/refs")[0] == 200  # reads need none


def test_without_a_token_the_server_is_read_only(tmp_path):
    with running(tmp_path) as server:
        before = store_state(tmp_path)
        status, answer, _ = call(server, *CREATE, token="any-token-at-all")
        assert status == 403 and b"read-only" in answer
        assert store_state(tmp_path) == before


def test_a_short_write_token_is_refused(tmp_path):
    with pytest.raises(ValueError, match="16 characters"):
        serve(tmp_path, write_token="short")


def test_commits_are_streamed_to_disk_and_capped(tmp_path):
    files = {f"f{i}.bin": bytes([i]) * (1 << 20) for i in range(16)}  # 16 MiB in 16 files
    body = commit_body(files)
    with running(tmp_path, write_token=TOKEN, max_upload=len(body)) as server:
        assert call(server, *CREATE, token=TOKEN)[0] == 200
        path = f"/api/kernels/{REPO}/commit/main"
        with socket.create_connection(server.server_address[:2], timeout=10) as oversized:
            oversized.sendall(post_headers(path, len(body) + 1))  # refused before any body
            assert oversized.recv(4096).startswith(b"HTTP/1.1 413")
        tracemalloc.start()
        try:
            status, _, _ = call(server, "POST", path, body, token=TOKEN)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert status == 200
        # one file (its base64 line and its bytes) at a time, not the 21 MiB body
        assert peak < len(body) // 2, (peak, len(body))
        tree = json.loads(call(server, "GET", f"/api/kernels/{REPO}/tree/main")[1])
        assert {e["path"] for e in tree} == set(files)


def test_requests_beyond_the_limit_get_503_until_one_ends(tmp_path):
    with running(tmp_path, write_token=TOKEN, max_requests=1) as server:
        assert call(server, *CREATE, token=TOKEN)[0] == 200
        deadline = time.monotonic() + 10
        while not server.slots._value:  # the create's handler frees the slot after it answers
            assert time.monotonic() < deadline
            time.sleep(0.05)
        slow = socket.create_connection(server.server_address[:2])
        slow.sendall(post_headers(f"/api/kernels/{REPO}/commit/main", 100))
        deadline = time.monotonic() + 10
        while server.slots._value:  # the body never comes: this request holds the only slot
            assert time.monotonic() < deadline
            time.sleep(0.05)
        status, _, headers = call(server, "GET", f"/api/kernels/{REPO}/refs")
        assert status == 503 and headers["Retry-After"] == "1"
        slow.close()
        deadline = time.monotonic() + 10
        while call(server, "GET", f"/api/kernels/{REPO}/refs")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
