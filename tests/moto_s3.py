"""A real S3 endpoint for tests: moto in server mode behind a proxy that injects faults.

s3fs talks HTTP to :class:`FaultProxy`, which forwards every request to a
moto's threaded server on 127.0.0.1, except that a seeded fraction of requests
is answered with an S3 ``InternalError`` (HTTP 500) or delayed. Half of the injected 500s are
sent *after* moto has applied the request, as when a load balancer loses the reply of a
request that succeeded, so retries must be idempotent. Nothing here listens beyond 127.0.0.1.

moto checks a conditional write's precondition (``If-None-Match: *``, ``If-Match``) and then
writes, with nothing held in between: two such PUTs at once can both succeed, where S3 makes
the check and the write one step. :class:`_Conditional` gives moto S3's guarantee by taking
conditional writes one at a time; everything else stays concurrent.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import logging
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FaultProxy", "Faults", "S3Endpoint", "s3_endpoint"]

_BUCKET = "ringflow-test"
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}
_INTERNAL_ERROR = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error. Please try again.</Message></Error>"
)


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


@dataclass(kw_only=True)
class Faults:
    """What the proxy does to the requests it forwards; change the fields at any time."""

    error_rate: float = 0.0
    """Fraction of requests answered with HTTP 500 (half before, half after forwarding)."""
    slow_rate: float = 0.0
    """Fraction of requests delayed by ``slow_s`` before they are forwarded."""
    slow_s: float = 0.2
    """Delay of a slow request, in seconds."""
    drop_rate: float = 0.0
    """Fraction of requests whose connection is closed without an answer (half before, half
    after forwarding), as when a load balancer or the network drops it."""
    methods: frozenset[str] = frozenset({"GET", "HEAD", "PUT", "POST", "DELETE"})
    """HTTP methods the faults apply to."""
    released: threading.Event = field(default_factory=_set_event)
    """Requests of ``methods`` wait until this is set (30 s at most): clear it to hold them."""
    seed: int = 0
    """Seed of the generator that picks the faulty requests."""
    counts: dict[str, int] = field(
        default_factory=lambda: {"requests": 0, "500": 0, "slow": 0, "dropped": 0}
    )
    """How many requests were seen, answered with 500, delayed and dropped."""


class FaultProxy:
    """A threaded HTTP proxy on 127.0.0.1 in front of ``upstream`` that injects :class:`Faults`."""

    def __init__(self, upstream: tuple[str, int], faults: Faults) -> None:
        self.faults = faults
        self._random = random.Random(faults.seed)
        self._lock = threading.Lock()
        self._activity = threading.Condition()
        self._in_flight = 0
        self._last_request = time.monotonic()
        handler = type("_Handler", (_ProxyHandler,), {"proxy": self, "upstream": upstream})
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def settle(self, quiet_s: float = 0.2, timeout: float = 30.0) -> None:
        """Wait until no request is in flight and none arrived for ``quiet_s`` seconds.

        A request whose client was killed still completes here, as it would on S3: callers
        that check what the killed client left behind must wait for it.
        """
        deadline = time.monotonic() + timeout
        with self._activity:
            while time.monotonic() < deadline:
                quiet_for = time.monotonic() - self._last_request
                if self._in_flight == 0 and quiet_for >= quiet_s:
                    return
                self._activity.wait(max(quiet_s - quiet_for, 0.01))
        raise TimeoutError(f"the S3 proxy still had requests in flight after {timeout}s")

    def track(self, delta: int) -> None:
        """Count a request in (``+1``) or out (``-1``)."""
        with self._activity:
            self._in_flight += delta
            self._last_request = time.monotonic()
            self._activity.notify_all()

    def decide(self, method: str) -> tuple[str | None, bool]:
        """Pick this request's fault: ``("before" | "after" | "drop before" | "drop after" |
        None, slow)``."""
        with self._lock:
            faults = self.faults
            faults.counts["requests"] += 1
            if method not in faults.methods:
                return None, False
            slow = self._random.random() < faults.slow_rate
            error = None
            if self._random.random() < faults.error_rate:
                error = self._random.choice(("before", "after"))
                faults.counts["500"] += 1
            # Drawn only when asked for, so seeded runs without drops see the same faults.
            if error is None and faults.drop_rate and self._random.random() < faults.drop_rate:
                error = self._random.choice(("drop before", "drop after"))
                faults.counts["dropped"] += 1
            faults.counts["slow"] += slow
            return error, slow


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect
    disable_nagle_algorithm = True  # small replies must not wait for a delayed ACK
    proxy: FaultProxy
    upstream: tuple[str, int]

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def _relay(self) -> None:
        self.proxy.track(+1)
        try:
            self._relay_tracked()
        finally:
            self.proxy.track(-1)

    def _relay_tracked(self) -> None:
        try:
            body = self._read_body()
        except (ConnectionError, ValueError):
            self.close_connection = True
            return
        error, slow = self.proxy.decide(self.command)
        if self.command in self.proxy.faults.methods:
            self.proxy.faults.released.wait(timeout=30)
        if slow:
            time.sleep(self.proxy.faults.slow_s)
        if error == "before":
            self._reply(500, {"Content-Type": "application/xml"}, _INTERNAL_ERROR)
            return
        if error == "drop before":
            self.close_connection = True
            return
        status, headers, payload = self._forward(body)
        if error == "drop after":
            self.close_connection = True
            return
        if error == "after":
            self._reply(500, {"Content-Type": "application/xml"}, _INTERNAL_ERROR)
            return
        self._reply(status, headers, payload)

    def handle(self) -> None:
        # The client went away (killed, or timed out): there is no one to answer.
        with contextlib.suppress(ConnectionError):
            super().handle()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _relay

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return self._read_chunked()
        expected = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(expected)
        if len(body) != expected:
            # The client died mid-request. S3 discards such a request; forwarding the part
            # that arrived would store a truncated object S3 never would.
            raise ConnectionAbortedError(f"request body ended after {len(body)}/{expected} bytes")
        return body

    def _read_chunked(self) -> bytes:
        parts = []
        while True:
            size = int(self.rfile.readline().split(b";")[0], 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts)
            part = self.rfile.read(size)
            if len(part) != size:
                raise ConnectionAbortedError("chunked request body ended early")
            parts.append(part)
            self.rfile.readline()

    def _forward(self, body: bytes) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            response = conn.getresponse()
            payload = response.read()
            return response.status, dict(response.getheaders()), payload
        finally:
            conn.close()

    def _reply(self, status: int, headers: dict[str, str], payload: bytes) -> None:
        self.send_response(status)
        for key, value in headers.items():
            if key.lower() not in _HOP_BY_HOP | {"content-length", "date", "server"}:
                self.send_header(key, value)
        # HEAD replies carry the length of the body they do not send.
        length = headers.get("Content-Length", headers.get("content-length"))
        if self.command != "HEAD" or length is None:
            length = str(len(payload))
        self.send_header("Content-Length", length)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)


class _Conditional:
    """WSGI wrapper around moto: a write carrying a precondition runs alone, so its check
    and its write are one step, as on S3."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        conditional = "HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MATCH" in environ
        if not conditional or environ.get("REQUEST_METHOD") in ("GET", "HEAD"):
            return self._app(environ, start_response)
        with self._lock:
            return list(self._app(environ, start_response))  # the body, produced inside


@contextlib.contextmanager
def _moto_server() -> Iterator[tuple[str, int]]:
    """moto's S3 on 127.0.0.1 on a free port, threaded, its conditional writes atomic."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    app = _Conditional(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[:2]
    finally:
        server.shutdown()
        thread.join()


@dataclass(frozen=True, kw_only=True)
class S3Endpoint:
    """A running moto S3 server, its fault proxy, and how to reach them."""

    bucket: str
    """Bucket created for the tests."""
    moto_url: str
    """moto itself, for setup and checks that must not see faults."""
    proxy: FaultProxy
    """The proxy s3fs talks to; set ``proxy.faults`` to inject faults."""

    def storage_options(self, *, direct: bool = False) -> dict[str, Any]:
        """s3fs options that reach the proxy (or moto itself with ``direct=True``)."""
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {
                "endpoint_url": self.moto_url if direct else self.proxy.url,
                "region_name": "us-east-1",
            },
            # Short timeouts so a lost reply costs a retry, not a minute; botocore retries a
            # 500 twice itself before the store's own retries take over.
            "config_kwargs": {
                "connect_timeout": 5,
                "read_timeout": 10,
                "retries": {"max_attempts": 3, "mode": "standard"},
            },
        }

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"


@contextlib.contextmanager
def s3_endpoint(faults: Faults | None = None) -> Iterator[S3Endpoint]:
    """Start moto and the proxy on 127.0.0.1, create the bucket; stop both afterwards.

    Dummy credentials are set in the environment for the duration, as boto-based clients
    refuse to sign requests without any.
    """
    import boto3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

    with (
        pytest_env(
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_DEFAULT_REGION="us-east-1",
        ),
        _moto_server() as (host, port),
    ):
        proxy = FaultProxy((host, port), faults or Faults())
        proxy.start()
        moto_url = f"http://{host}:{port}"
        try:
            boto3.client("s3", endpoint_url=moto_url).create_bucket(Bucket=_BUCKET)
            yield S3Endpoint(bucket=_BUCKET, moto_url=moto_url, proxy=proxy)
        finally:
            proxy.stop()


@contextlib.contextmanager
def pytest_env(**values: str) -> Iterator[None]:
    """Set environment variables for a block and restore the previous values afterwards."""
    import pytest

    with pytest.MonkeyPatch.context() as patch:
        for key, value in values.items():
            patch.setenv(key, value)
        yield
