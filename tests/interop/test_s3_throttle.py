"""Throttling on S3: a small HTTP proxy between ckpt and `moto_server` answers chosen requests
with S3's throttling reply (HTTP 503 `SlowDown`, or 429) and forwards everything else unchanged.

Transient throttling is retried with backoff and the run's output is byte for byte what a local
run writes; throttling that does not clear ends the run with exit 1 and an error naming the
object and the status, and a failed upload leaves no object under the output name and no open
multipart upload."""

from __future__ import annotations

import http.client
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from test_s3 import BUCKET, S3Server, download_tree, fixture, run, same_tree, upload_tree

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
)
TOO_MANY = b"<Error><Code>TooManyRequests</Code><Message>Too Many Requests</Message></Error>"

# Headers that belong to one hop: the proxy sets its own framing.
HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


class Request:
    """What the proxy saw of one request: method, key (path without the bucket), query names."""

    def __init__(self, method: str, target: str, range_: str | None = None):
        parts = urlsplit(target)
        self.method = method
        self.range = range_  # the Range header, `bytes=A-B`
        self.path = parts.path
        self.key = parts.path.removeprefix(f"/{BUCKET}").removeprefix("/")
        self.query = parse_qs(parts.query, keep_blank_values=True)

    @property
    def kind(self) -> str:
        """The S3 operation, as far as the tests need it."""
        if self.method == "PUT" and "partNumber" in self.query:
            return "UploadPart"
        if self.method == "POST" and "uploads" in self.query:
            return "CreateMultipartUpload"
        if self.method == "POST" and "uploadId" in self.query:
            return "CompleteMultipartUpload"
        if self.method == "DELETE" and "uploadId" in self.query:
            return "AbortMultipartUpload"
        return self.method


class ThrottlingProxy:
    """A proxy on 127.0.0.1 and a free port in front of `upstream` (a moto_server). `throttle`
    decides per request: a status (503 or 429) to answer with S3's throttling reply, or None to
    forward the request unchanged (method, path, query, headers with Range and the SigV4
    signature, body) and return moto's status, headers and body unchanged."""

    def __init__(self, upstream: S3Server, throttle):
        self.upstream = upstream
        self.throttle = throttle
        self.lock = threading.Lock()
        self.seen: list[tuple[Request, int]] = []  # every request and the status it got
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as reqwest's pool expects

            def log_message(self, *args):
                pass

            def handle_one(self):
                req = Request(self.command, self.path, self.headers.get("Range"))
                body = self.read_body()
                with proxy.lock:
                    status = proxy.throttle(req)
                if status is not None:
                    reply = SLOW_DOWN if status == 503 else TOO_MANY
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(reply)))
                    if status == 429:
                        self.send_header("Retry-After", "0")
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(reply)
                else:
                    status = self.forward(body)
                with proxy.lock:
                    proxy.seen.append((req, status))

            def read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        chunk = self.rfile.read(size)
                        self.rfile.readline()
                        if size == 0:
                            return out
                        out += chunk
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def forward(self, body: bytes) -> int:
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream.port, timeout=60)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for k, v in self.headers.items():
                        if k.lower() not in HOP:
                            conn.putheader(k, v)
                    if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                        conn.putheader("Content-Length", str(len(body)))
                    conn.endheaders(body if body or "Content-Length" in self.headers else None)
                    r = conn.getresponse()
                    data = r.read()
                    self.send_response(r.status, r.reason)
                    for k, v in r.getheaders():
                        if k.lower() not in HOP and k.lower() != "content-length":
                            self.send_header(k, v)
                    # A HEAD reply keeps the object's length; moto's own framing otherwise.
                    length = r.getheader("Content-Length") if self.command == "HEAD" else None
                    self.send_header("Content-Length", length or str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                    return r.status
                finally:
                    conn.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = handle_one

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.env = dict(upstream.env, AWS_ENDPOINT_URL=f"http://127.0.0.1:{self.port}")

    def count(self, status: int | None = None, **match) -> int:
        """Requests seen that answered `status` (any if None) and match `kind`/`key`/`method`."""
        with self.lock:
            return sum(
                1
                for req, got in self.seen
                if (status is None or got == status)
                and all(getattr(req, k) == v for k, v in match.items())
            )

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    try:
        c = server.client()
        c.create_bucket(Bucket=BUCKET)
        upload_tree(c, fixture("fsdp2_adamw"), BUCKET, "dcp")
        yield server
    finally:
        server.stop()


@pytest.fixture
def proxy(s3):
    proxies = []

    def start(throttle):
        p = ThrottlingProxy(s3, throttle)
        proxies.append(p)
        return p

    yield start
    for p in proxies:
        p.stop()


def first(n: int, status: int, want):
    """A throttle answering the first `n` requests of each (operation, key) that `want` picks."""
    seen = Counter()

    def throttle(req: Request):
        if not want(req):
            return None
        seen[req.kind, req.key] += 1
        return status if seen[req.kind, req.key] <= n else None

    return throttle


def data_objects() -> list[str]:
    return sorted(f"dcp/{p.name}" for p in fixture("fsdp2_adamw").iterdir() if p.suffix == ".distcp")


# --- reading ------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [503, 429])
def test_transient_throttling_on_reads_is_retried(s3, proxy, tmp_path, status):
    """The first 3 GETs and HEADs of every object of the checkpoint (.metadata and each
    .distcp) and the first 3 LISTs are throttled: each is retried with backoff, and the output
    is the local run's, byte for byte."""
    want = tmp_path / "local" / "out.safetensors"
    want.parent.mkdir()
    assert run(None, "consolidate", fixture("fsdp2_adamw"), "-o", want).returncode == 0
    p = proxy(first(3, status, lambda r: r.method in ("GET", "HEAD")))
    got = tmp_path / "remote" / "out.safetensors"
    got.parent.mkdir()
    started = time.monotonic()
    proc = run(p, "consolidate", f"s3://{BUCKET}/dcp", "-o", got)
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    assert got.read_bytes() == want.read_bytes()
    for key in data_objects() + ["dcp/.metadata"]:
        # Every object was throttled 3 times and then read: the run got its bytes by retrying.
        assert p.count(status, method="GET", key=key) == 3, key
        assert p.count(200, method="GET", key=key) + p.count(206, method="GET", key=key) >= 1, key
    assert p.count(status, method="GET", key="") == 3  # the LIST of the prefix
    print(f"throttled {p.count(status)} requests; consolidate took {took:.1f} s")


def test_persistent_throttling_on_one_object_is_a_clear_error(s3, proxy, tmp_path):
    """Every GET of one .distcp is throttled: ckpt gives up after its retries, within seconds,
    with exit 1 and an error naming that object, the status and S3's code."""
    victim = data_objects()[-1]
    p = proxy(lambda r: 503 if r.method == "GET" and r.key == victim else None)
    started = time.monotonic()
    proc = run(p, "consolidate", f"s3://{BUCKET}/dcp", "-o", tmp_path / "out.safetensors")
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr
    assert "panicked" not in proc.stderr
    err = proc.stderr
    assert f"s3://{BUCKET}/{victim}" in err, err
    assert "503" in err and "SlowDown" in err, err
    assert "throttled" in err and "--threads" in err, err
    # Each request was sent once and retried 5 times before the run gave up.
    assert p.count(503, key=victim) >= 6, p.count(503, key=victim)
    assert not (tmp_path / "out.safetensors").exists()
    assert took < 30, f"{took:.1f} s to give up"
    print(f"gave up after {took:.1f} s and {p.count(503, key=victim)} throttled GETs:\n{err}")


# --- writing ------------------------------------------------------------------------------------


def uploads_of(client, prefix: str) -> list[str]:
    uploads = client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])
    return [u["Key"] for u in uploads if u["Key"].startswith(prefix)]


def keys_of(client, prefix: str) -> list[str]:
    return [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]


@pytest.mark.parametrize("split", [False, True])
def test_transient_throttling_on_uploads_is_retried(s3, proxy, tmp_path, split):
    """The first 2 of every upload request of each object (create, each part, complete, and
    the plain PUTs of the journal and the split index) are throttled: the output uploaded is
    the local run's, byte for byte, and no upload is left open."""
    name = "split" if split else "model.safetensors"
    extra = ["--max-shard-size", "1KB"] if split else []
    want = tmp_path / "want" / name
    want.parent.mkdir()
    assert run(None, "consolidate", fixture("fsdp2_adamw"), "-o", want, *extra).returncode == 0
    dest = f"up-{name}"
    writes = ("PUT", "UploadPart", "CreateMultipartUpload", "CompleteMultipartUpload")
    p = proxy(first(2, 503, lambda r: r.kind in writes and r.key.lstrip(".").startswith(dest)))
    proc = run(p, "consolidate", fixture("fsdp2_adamw"), "-o", f"s3://{BUCKET}/{dest}", *extra)
    assert proc.returncode == 0, proc.stderr
    c = s3.client()
    if split:
        got = tmp_path / "got"
        got.mkdir()
        download_tree(c, BUCKET, dest, got)
        same_tree(want, got)
    else:
        got = tmp_path / "got.safetensors"
        c.download_file(BUCKET, dest, str(got))
        assert got.read_bytes() == want.read_bytes()
    for kind in writes:
        assert p.count(503, kind=kind) >= 2, kind
    parts = p.count(503, kind="UploadPart")
    assert parts == 2 * len({r.key for r, _ in p.seen if r.kind == "UploadPart"})
    assert not uploads_of(c, dest), "uploads left open"
    assert not [k for k in keys_of(c, f".{dest}") if "ckpt-uploads" in k]


def test_persistent_throttling_on_upload_parts_is_a_clear_error(s3, proxy, tmp_path):
    """Every UploadPart is throttled: exit 1, an error naming the output object and the status,
    no object under the output name, and the multipart upload aborted."""
    dest = "never.safetensors"
    p = proxy(lambda r: 503 if r.kind == "UploadPart" else None)
    started = time.monotonic()
    proc = run(p, "consolidate", fixture("fsdp2_adamw"), "-o", f"s3://{BUCKET}/{dest}")
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr
    assert "panicked" not in err
    assert f"s3://{BUCKET}/{dest}" in err and "503" in err and "SlowDown" in err, err
    assert "throttled" in err, err
    assert p.count(503, kind="UploadPart") >= 6
    c = s3.client()
    assert dest not in keys_of(c, dest)
    assert p.count(kind="AbortMultipartUpload") >= 1
    assert not uploads_of(c, dest), "the multipart upload was not aborted"
    assert not [k for k in keys_of(c, f".{dest}") if "ckpt-uploads" in k], "journal left behind"
    assert took < 30, f"{took:.1f} s to give up"
    print(f"gave up after {took:.1f} s:\n{err}")


def test_an_abort_throttled_past_its_retries_is_left_to_the_next_run(s3, proxy, tmp_path):
    """Every UploadPart and every AbortMultipartUpload is throttled: the run fails (exit 1) and
    cannot abort its upload, so it keeps the journal that lists it; the next run into the same
    place aborts that upload and writes the output."""
    dest = "stuck.safetensors"
    c = s3.client()
    p = proxy(lambda r: 503 if r.kind in ("UploadPart", "AbortMultipartUpload") else None)
    proc = run(p, "consolidate", fixture("fsdp2_adamw"), "-o", f"s3://{BUCKET}/{dest}")
    assert proc.returncode == 1, proc.stderr
    assert f"s3://{BUCKET}/{dest}" in proc.stderr and "throttled" in proc.stderr, proc.stderr
    assert p.count(503, kind="AbortMultipartUpload") >= 6
    assert dest not in keys_of(c, dest)
    stuck = uploads_of(c, dest)
    assert stuck == [dest], stuck
    assert [k for k in keys_of(c, f".{dest}.ckpt-uploads/")], "the journal of the open upload is gone"

    again = run(s3, "consolidate", fixture("fsdp2_adamw"), "-o", f"s3://{BUCKET}/{dest}")
    assert again.returncode == 0, again.stderr
    assert not uploads_of(c, dest), "the stuck upload was not aborted by the next run"
    assert not keys_of(c, f".{dest}.ckpt-uploads/")
    want = tmp_path / "want.safetensors"
    assert run(None, "consolidate", fixture("fsdp2_adamw"), "-o", want).returncode == 0
    got = tmp_path / "got.safetensors"
    c.download_file(BUCKET, dest, str(got))
    assert got.read_bytes() == want.read_bytes()
