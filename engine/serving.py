"""Serve a model checkpoint, or a registry's production version, over HTTP with Ray Serve.

:func:`serve_model` deploys one Serve application for one checkpoint on an already
initialised Ray; :func:`serve_registry` deploys one that serves whatever the registry's
production pointer names and follows it: each replica polls the pointer (every ``poll_s``),
loads and self-checks a new version in a background thread, then swaps one reference, so
no request fails or mixes models during the switch. A :class:`ModelServer` replica answers
``POST /predict``, ``GET /healthz`` and ``GET /model`` behind a FastAPI ingress. The Serve
controller is detached, so an application deployed on a long-running Ray head keeps
serving after the caller's process exits; :func:`shutdown_serving` deletes it.

Deploying again what already runs (the same source, options, token, name, route and code:
one digest, which every replica reports in ``GET /healthz``'s ``X-Ringflow-Deployment``
header) does not redeploy. For a registry the running replicas are already following the
pointer, so the caller only waits until they serve the production version. Anything else
is a Serve rolling update.

The module is generic over the served model. The request follows the data the model was
trained on: the engine records the dataset's schema in every checkpoint
(``meta["data_schema"]``), and the server takes one input as an object of the named features,
``{"x1": 0.3, "color": "red"}`` (a category as its string), or several as
``{"instances": [...]}``, each an object of features or an array in schema order. A module
that declares an ``input_schema`` class attribute (the digits demo: ``{"name": "pixels",
"shape": [64], ...}``) is sent that named array instead. The answer follows the module:
its own ``predict_step``'s output under ``prediction``; else, for classification, the class
(its category string for a category label) under ``label`` (or the module's
``output_name``) and the softmax ``probabilities``; for regression, ``value``. Every bad
request gets a 4xx with a JSON ``{"error": "..."}`` naming what is wrong; the replica never
dies of one.
"""

# No ``from __future__ import annotations`` here: Serve pickles ModelServer by value, and
# FastAPI must then resolve its routes' annotations (``request: Request``) as objects, since
# the pickled methods' globals no longer hold every name a string annotation could refer to.

import asyncio
import hashlib
import hmac
import inspect
import json
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import torch
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException

from ringflow.storage.checkpoint import CheckpointError, ModelCheckpoint, class_path, load_model
from ringflow.storage.dataset import TableSchema

__all__ = ["ModelServer", "ServingError", "serve_model", "serve_registry", "shutdown_serving"]

logger = logging.getLogger(__name__)

_HEALTH_DEADLINE_S = 60.0
_HEALTH_POLL_S = 0.25
_MAX_INSTANCES = 1024
_BATCH_WAIT_S = 0.005
_INSTANCES = "instances"
_VERSION_HEADER = "X-Model-Version"
_DEPLOYMENT_HEADER = "X-Ringflow-Deployment"
_FOLLOW_WAIT_S = 30.0  # beyond two polls: load and check a version in the replica
_SWAP_RETRY_S = 30.0


class ServingError(RuntimeError):
    """The model cannot be deployed or does not answer once deployed."""


# --------------------------------------------------------------------------- caller side


def serve_model(
    model_uri: str,
    *,
    allowed: str | type | Sequence[str | type],
    host: str = "127.0.0.1",
    port: int = 8000,
    app_name: str = "ringflow",
    route_prefix: str = "/",
    max_batch_size: int = 32,
    batching: bool = True,
    token_env: str = "RINGFLOW_SERVE_TOKEN",
    token_file: str | None = None,
    max_body_bytes: int = 1_000_000,
) -> str:
    """Deploy (or redeploy) the model at ``model_uri``, wait until it answers, return its URL.

    Args:
        model_uri: a checkpoint written by :func:`storage.checkpoint.save_model`.
        allowed: the model class (or classes) the checkpoint may hold, or their import paths
            ``package.module:Class``; a checkpoint naming another is refused unimported.
        host: address Serve's HTTP proxy listens on; loopback unless the caller asks.
        port: port of Serve's HTTP proxy.
        app_name: Serve application name; deploying the same name again replaces it.
        route_prefix: URL prefix of the application, unique among Serve's applications.
        max_batch_size: most single-input requests run together in one forward pass.
        batching: batch concurrent single-input requests on the server (``@serve.batch``);
            off, each runs its own forward pass.
        token_env: environment variable which, when set at deploy time, holds the bearer
            token every request must present.
        token_file: file holding the bearer token (a mounted secret); wins over ``token_env``.
        max_body_bytes: largest request body accepted; larger ones get HTTP 413.

    Returns:
        The endpoint URL, ``http://host:port`` followed by ``route_prefix`` unless it is ``/``.

    Raises:
        CheckpointError: the checkpoint is missing, incomplete or corrupt, or names a class
            not in ``allowed`` (``ModelClassRefused``).
        ServingError: bad arguments, a checkpoint with neither a recorded data schema nor a
            module ``input_schema``, a model that fails its self-check (a forward pass on a
            valid input), Serve already running with other HTTP options, or a deployment that
            fails or never answers ``GET /healthz``.
    """
    _check_arguments(host, port, route_prefix, max_batch_size, max_body_bytes)
    source = _FixedModel(uri=model_uri, allowed=_allowed(allowed))
    # CheckpointError propagates before anything deploys
    module, ckpt = load_model(model_uri, allowed=source.allowed)
    _check_servable(module, ckpt)
    options = _ServerOptions(
        max_batch_size=max_batch_size, batching=batching, max_body_bytes=max_body_bytes
    )
    return _deploy(
        source,
        options,
        token=_read_token(token_env, token_file),
        address=(host, port, route_prefix),
        app_name=app_name,
    )


def serve_registry(
    registry_url: str,
    model: str,
    *,
    allowed: str | type | Sequence[str | type],
    poll_s: float = 1.0,
    host: str = "127.0.0.1",
    port: int = 8000,
    app_name: str = "ringflow",
    route_prefix: str = "/",
    max_batch_size: int = 32,
    batching: bool = True,
    token_env: str = "RINGFLOW_SERVE_TOKEN",
    token_file: str | None = None,
    max_body_bytes: int = 1_000_000,
) -> str:
    """Serve ``model``'s production version from the registry, following the pointer.

    Every replica reads the production pointer every ``poll_s`` seconds. When it names
    another version (a promotion or a rollback), the replica loads it in the background,
    checks that it answers a probe input, takes the same input (the same named array,
    or the same features with the same types and categories) and answers under the same
    keys as the served one, and only then swaps it in; requests in flight finish on the
    model they started with. A version that fails to load or check is logged and skipped;
    the old one keeps serving. The replicas load only checkpoints of the ``allowed`` classes,
    which come with the deployment, never from the registry: a version whose manifest names
    another class is logged and skipped without importing anything.
    ``GET /model`` reports the served version, its training time and its metrics.

    Args:
        registry_url: the registry root (:class:`storage.registry.ModelRegistry`'s ``url``),
            read with fsspec's default credentials (environment, instance profile).
        model: the registered model's name.
        allowed: the model classes its versions may hold, as import paths
            ``package.module:Class`` (the class trained under this name, and earlier ones).
        poll_s: seconds between two reads of the production pointer.
        host, port, app_name, route_prefix, max_batch_size, batching, token_env, token_file,
            max_body_bytes: as for :func:`serve_model`.

    Returns:
        The endpoint URL.

    Raises:
        ServingError: nothing is in production yet, bad arguments, or a failed deployment.
        CheckpointError: the production checkpoint is missing or corrupt, or names a class
            not in ``allowed`` (``ModelClassRefused``).
    """
    from ringflow.storage.registry import ModelRegistry

    _check_arguments(host, port, route_prefix, max_batch_size, max_body_bytes)
    if not (isinstance(poll_s, int | float) and 0.05 <= poll_s <= 3600):
        raise ServingError(f"poll_s must be a number of seconds in 0.05..3600, got {poll_s!r}")
    source = _RegistryModel(
        url=registry_url, model=model, poll_s=float(poll_s), allowed=_allowed(allowed)
    )
    record = ModelRegistry(registry_url, model).production_version()
    if record is None:
        raise ServingError(
            f"{registry_url}/{model} has no production version yet: register one and promote "
            "it (storage.registry.promote_if_better) before serving"
        )
    module, ckpt = load_model(record.uri, allowed=source.allowed)
    _check_servable(module, ckpt)
    options = _ServerOptions(
        max_batch_size=max_batch_size, batching=batching, max_body_bytes=max_body_bytes
    )
    token = _read_token(token_env, token_file)
    address = (host, port, route_prefix)
    url = _endpoint(host, port, route_prefix)
    digest = _deployment_digest(source, options, token=token, address=address, app_name=app_name)
    if _follows_in_place(
        url, token, digest, source, wanted=record.version, specs=_specs(module, ckpt)
    ):
        logger.info("%r at %s already serves %s; it follows the pointer", app_name, url, source)
        return url
    return _deploy(source, options, token=token, address=address, app_name=app_name)


def _deploy(
    source: "_FixedModel | _RegistryModel",
    options: "_ServerOptions",
    *,
    token: str | None,
    address: tuple[str, int, str],
    app_name: str,
) -> str:
    host, port, route_prefix = address
    auth = _TokenCheck.for_token(token) if token is not None else None
    _start_serve(host, port)
    url = _endpoint(host, port, route_prefix)
    digest = _deployment_digest(source, options, token=token, address=address, app_name=app_name)
    if isinstance(source, _FixedModel) and _running_digest(url, token) == digest:
        logger.info("%r at %s already serves %s; not redeployed", app_name, url, source)
        return url
    ongoing = max(100, 2 * options.max_batch_size)
    app = ModelServer.options(max_ongoing_requests=ongoing).bind(
        source, options, auth=auth, deployment=digest
    )
    try:
        serve.run(app, name=app_name, route_prefix=route_prefix)
    except RuntimeError as err:
        details = _deployment_messages(app_name)
        raise ServingError(
            f"Serve application {app_name!r} failed to deploy: {err}{details}"
        ) from err
    _wait_healthy(url, token)
    logger.info("serving %s as %r at %s", source, app_name, url)
    return url


def _deployment_digest(
    source: "_FixedModel | _RegistryModel",
    options: "_ServerOptions",
    *,
    token: str | None,
    address: tuple[str, int, str],
    app_name: str,
) -> str:
    """What identifies a deployment: equal digests mean redeploying would change nothing.

    The token enters only as a hash; this module's own source does too, so new serving code
    is always redeployed.
    """
    with open(__file__, "rb") as f:
        code = hashlib.sha256(f.read()).hexdigest()
    described = {
        "source": {type(source).__name__: asdict(source)},
        "options": asdict(options),
        "token": None if token is None else hashlib.sha256(token.encode()).hexdigest(),
        "address": list(address),
        "app": app_name,
        "code": code,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def _running_digest(url: str, token: str | None) -> str | None:
    """The deployment digest the application at ``url`` reports, or ``None``."""
    if _serve_client() is None:
        return None
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        reply = httpx.get(f"{url}/healthz", headers=headers, timeout=5.0, trust_env=False)
    except httpx.HTTPError:
        return None
    return reply.headers.get(_DEPLOYMENT_HEADER) if reply.status_code == 200 else None


def _follows_in_place(
    url: str,
    token: str | None,
    digest: str,
    source: "_RegistryModel",
    *,
    wanted: str,
    specs: "tuple[_InputSpec | _TableInput, _OutputSpec]",
) -> bool:
    """Whether the running application is this very deployment and comes to serve version
    ``wanted`` without a redeploy: its replicas already follow the pointer, and swap to a
    version that takes the same input and gives the same answer. Waits for the swap."""
    if _running_digest(url, token) != digest:
        return False
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    with httpx.Client(timeout=5.0, trust_env=False, headers=headers) as client:
        served = _served_version(client, url)
        if served not in (None, wanted) and not _same_interface(source, served, specs):
            return False  # the replicas would refuse it: the clients' interface changes
        deadline = time.monotonic() + _FOLLOW_WAIT_S + 2 * source.poll_s
        while time.monotonic() < deadline:
            if _served_version(client, url) == wanted:
                return True
            time.sleep(_HEALTH_POLL_S)
    logger.warning("%s did not swap to %s in time; redeploying", url, wanted)
    return False


def _served_version(client: httpx.Client, url: str) -> str | None:
    try:
        reply = client.get(f"{url}/model")
    except httpx.HTTPError:
        return None
    return reply.json().get("version") if reply.status_code == 200 else None


def _same_interface(
    source: "_RegistryModel", version: str, specs: "tuple[_InputSpec | _TableInput, _OutputSpec]"
) -> bool:
    """Whether the registry's ``version`` takes the input and gives the answer ``specs`` do."""
    from ringflow.storage.registry import ModelRegistry, RegistryError

    try:
        uri = ModelRegistry(source.url, source.model).get(version).uri
        module, ckpt = load_model(uri, allowed=source.allowed)
    except (CheckpointError, RegistryError, OSError, ValueError):
        return False
    old_spec, old_output = _specs(module, ckpt)
    spec, output = specs
    return (old_spec.signature, old_output.signature) == (spec.signature, output.signature)


def shutdown_serving(app_name: str = "ringflow") -> None:
    """Delete the Serve application ``app_name``; a no-op when Serve or the app is absent."""
    if _serve_client() is None:
        return
    serve.delete(app_name)


def _check_arguments(
    host: str, port: int, route_prefix: str, max_batch_size: int, max_body_bytes: int
) -> None:
    if not isinstance(host, str) or not host:
        raise ServingError(f"host must be a non-empty string, got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ServingError(f"port must be an integer in 1..65535, got {port!r}")
    if not route_prefix.startswith("/"):
        raise ServingError(f"route_prefix must start with '/', got {route_prefix!r}")
    if max_batch_size < 1:
        raise ServingError(f"max_batch_size must be at least 1, got {max_batch_size}")
    if max_body_bytes < 1:
        raise ServingError(f"max_body_bytes must be at least 1, got {max_body_bytes}")


def _allowed(allowed: str | type | Sequence[str | type]) -> tuple[str, ...]:
    """The allowed classes as import paths: what a deployment carries to its replicas."""
    entries = (allowed,) if isinstance(allowed, str | type) else tuple(allowed)
    paths = tuple(e if isinstance(e, str) else class_path(e) for e in entries)
    if not paths or not all(":" in p for p in paths):
        raise ServingError(
            "allowed must name the model classes to serve as 'package.module:Class', "
            f"got {allowed!r}"
        )
    return paths


def _check_servable(module: torch.nn.Module, ckpt: ModelCheckpoint) -> None:
    """Derive the request and answer and run the self-check here, before anything deploys,
    so that a model the replica would refuse fails with the replica's message."""
    spec, output = _specs(module, ckpt)
    _probe(module, spec, output, ckpt.uri)


def _read_token(token_env: str, token_file: str | None) -> str | None:
    """The bearer token from ``token_file`` or else ``token_env``; ``None`` when neither.

    Error messages name where the token came from, never the token.
    """
    if token_file is not None:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read()
        except (OSError, UnicodeDecodeError) as err:
            raise ServingError(f"cannot read the bearer token file {token_file}: {err}") from err
        where = f"the token file {token_file}"
    else:
        token = os.environ.get(token_env)
        if token is None:
            return None
        where = token_env
    if not token.strip():
        # An empty secret is more likely a failed substitution than a wish for no auth.
        raise ServingError(f"{where} is set but empty; unset it to serve without a token")
    return token.strip()


def _serve_client() -> Any:
    """The running Serve controller's client, or ``None`` when Serve is not running.

    Ray 2.60 has no public accessor for the running instance's HTTP options (``serve.start``
    only logs a warning when they differ), so this is the one place that uses Serve's
    private context module.
    """
    from ray.serve.context import _get_global_client

    return _get_global_client(raise_if_no_controller_running=False)


def _start_serve(host: str, port: int) -> None:
    """Start Serve on ``host:port``, or check a running Serve already listens there."""
    was_running = _serve_client() is not None
    try:
        serve.start(http_options={"host": host, "port": port})
    except (RuntimeError, TimeoutError) as err:  # the proxy's bind error, wrapped by Ray
        if not was_running:
            serve.shutdown()  # no controller left behind whose proxy never listened
        reason = str(err).strip().splitlines()[-1]
        raise ServingError(
            f"Ray Serve could not listen on {host}:{port} (is the port in use?): {reason}"
        ) from err
    client = _serve_client()
    config = client.http_config if client is not None else None
    if config is not None and (config.host, config.port) != (host, port):
        raise ServingError(
            f"Ray Serve is already running on this cluster with HTTP on "
            f"{config.host}:{config.port}, not {host}:{port}. Serve's HTTP options are fixed "
            f"once it starts: call serve_model with host={config.host!r}, port={config.port}, "
            "or shut Serve down (serve.shutdown()) to restart it elsewhere."
        )


def _deployment_messages(app_name: str) -> str:
    """The replicas' own account of a failed deploy (Serve's error only names the deployment)."""
    app = serve.status().applications.get(app_name)
    if app is None:
        return ""
    messages = [f"{name}: {d.message}" for name, d in app.deployments.items() if d.message]
    return "".join(f"\n{m}" for m in messages)


def _endpoint(host: str, port: int, route_prefix: str) -> str:
    """The URL a client on this machine uses; wildcard listen addresses map to loopback."""
    connect = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in connect:
        connect = f"[{connect}]"
    return f"http://{connect}:{port}{route_prefix.rstrip('/')}"


def _wait_healthy(url: str, token: str | None) -> None:
    """Poll ``GET url/healthz`` until it answers 200."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    deadline = time.monotonic() + _HEALTH_DEADLINE_S
    last = "no answer"
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            try:
                response = client.get(f"{url}/healthz", headers=headers)
            except httpx.HTTPError as err:
                last = f"{type(err).__name__}: {err}"
            else:
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}: {response.text[:200]}"
                if response.status_code in (400, 401, 403):  # waiting will not change these
                    break
            time.sleep(_HEALTH_POLL_S)
    raise ServingError(
        f"the model server at {url} did not answer GET /healthz with 200 within "
        f"{_HEALTH_DEADLINE_S:.0f} s (last: {last})"
    )


# --------------------------------------------------------------------------- replica side


@dataclass(frozen=True, kw_only=True)
class _TokenCheck:
    """What the replica needs to check a bearer token, without the token itself.

    The token travels to the replica as a salted HMAC-SHA256 digest in the deployment's
    init args. Init args are pickled into Serve's deployment state (the controller's
    checkpoint in the GCS) and a ``runtime_env`` env var shows up in the actor's metadata
    and the state API; with a digest, neither place holds anything that authenticates.
    The bearer token is meant to be random and long, so a fast hash is sound.
    """

    salt: bytes
    digest: bytes

    @classmethod
    def for_token(cls, token: str) -> "_TokenCheck":
        salt = secrets.token_bytes(16)
        return cls(salt=salt, digest=_hmac(salt, token))

    def accepts(self, token: str) -> bool:
        return hmac.compare_digest(_hmac(self.salt, token), self.digest)

    def __repr__(self) -> str:
        return "_TokenCheck(<redacted>)"


def _hmac(salt: bytes, token: str) -> bytes:
    return hmac.new(salt, token.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()


class _BadRequest(Exception):
    """A request the server refuses; becomes ``{"error": message}`` with ``status``."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _finite(value: Any, where: str) -> float:
    """``value`` as a finite float, or a 400 naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _BadRequest(f"{where} must be a number, found {_json_type(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf if value > 0 else -math.inf
    if not math.isfinite(number):
        raise _BadRequest(f"{where} must be a finite number, found {value!r}")
    return number


def _check_range(number: float, value: Any, low: float | None, high: float | None, where: str):
    if (low is not None and number < low) or (high is not None and number > high):
        raise _BadRequest(f"{where} = {value!r} is outside [{low}, {high}]")


def _listing(names: Any, most: int = 20) -> str:
    """``names`` as a list for a message, cut after ``most``."""
    names = list(names)
    if len(names) <= most:
        return repr(names)
    return repr(names[:most])[:-1] + f", ...] ({len(names)} in all)"


@dataclass(frozen=True, kw_only=True)
class _InputSpec:
    """A tensor input declared by the module's ``input_schema``: one named array of numbers.

    One input is ``{name: [...]}``, several are ``{"instances": [[...], ...]}``.
    """

    name: str
    shape: tuple[int, ...]
    low: float | None
    high: float | None
    declared: dict[str, Any]
    """The ``input_schema`` as the module declares it, for ``GET /model``."""

    @classmethod
    def of(cls, schema: Any, where: str) -> "_InputSpec":
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
            raise ServingError(
                f"{where}.input_schema must be a dict with a 'name' and a 'shape', got {schema!r}"
            )
        shape = schema.get("shape")
        if not isinstance(shape, list | tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape
        ):
            raise ServingError(f"{where}.input_schema shape must be positive ints: {shape!r}")
        low, high = schema.get("min"), schema.get("max")
        return cls(
            name=schema["name"],
            shape=tuple(shape),
            low=None if low is None else float(low),
            high=None if high is None else float(high),
            declared=dict(schema),
        )

    @property
    def signature(self) -> tuple:
        """What clients send; a swap must keep it."""
        return ("tensor", self.name, self.shape)

    def summary(self) -> str:
        return f"{self.name!r} of shape {list(self.shape)}"

    def describe(self) -> dict[str, Any]:
        return {**self.declared, "kind": "tensor"}

    def parse(self, payload: dict[str, Any]) -> tuple[list[list[float]], bool]:
        """The rows of a request body, and whether it was one input (not ``instances``)."""
        has_single, has_batch = self.name in payload, _INSTANCES in payload
        if has_single == has_batch:
            raise _BadRequest(
                f"request body must have exactly one of the keys {self.name!r} (one "
                f"input) or {_INSTANCES!r} (a list of inputs); found keys {sorted(payload)}"
            )
        if has_single:
            return [self.row(payload[self.name], self.name)], True
        return _instances(self, payload[_INSTANCES]), False

    def row(self, value: Any, where: str) -> list[float]:
        """Check one input against the shape and range; return its numbers flattened."""
        out: list[float] = []
        self._collect(value, self.shape, where, out)
        return out

    def probe_row(self) -> list[float]:
        value = self.low if self.low is not None else min(0.0, self.high or 0.0)
        return [value] * math.prod(self.shape)

    def tensor(self, rows: list[list[float]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), *self.shape)

    def _collect(self, value: Any, shape: tuple[int, ...], where: str, out: list[float]) -> None:
        if not shape:
            number = _finite(value, where)
            _check_range(number, value, self.low, self.high, where)
            out.append(number)
            return
        if not isinstance(value, list):
            raise _BadRequest(
                f"{where} must be an array of {shape[0]} {_element(shape[1:])}, "
                f"found {_json_type(value)}"
            )
        if len(value) != shape[0]:
            raise _BadRequest(
                f"{where} has the wrong length: expected {shape[0]} {_element(shape[1:])}, "
                f"found {len(value)}"
            )
        for i, item in enumerate(value):
            self._collect(item, shape[1:], f"{where}[{i}]", out)


def _element(shape: tuple[int, ...]) -> str:
    return "numbers" if not shape else f"arrays of shape {list(shape)}"


# Beyond these magnitudes the float32 model input would change the value: float32
# overflows to inf; integers are exact in the dataset only up to 2**53.
_FEATURE_LIMITS = {"float": float(torch.finfo(torch.float32).max), "int": 2.0**53}


@dataclass(frozen=True, kw_only=True)
class _Feature:
    """One feature column of the recorded data schema, as a request must give it."""

    name: str
    dtype: str
    low: float | None
    high: float | None
    categories: tuple[str, ...] | None

    def value(self, value: Any, where: str) -> float:
        """The model's number for one request value: the number itself or the category code."""
        if self.categories is not None:
            return self._code(value, where)
        number = _finite(value, where)
        if self.dtype == "int" and not number.is_integer():
            raise _BadRequest(
                f"{where} must be an integer (column {self.name} is 'int'), found {value!r}"
            )
        if abs(number) > _FEATURE_LIMITS[self.dtype]:
            raise _BadRequest(f"{where} = {value!r} is too large for an {self.dtype!r} column")
        _check_range(number, value, self.low, self.high, where)
        return number

    def _code(self, value: Any, where: str) -> float:
        assert self.categories is not None
        allowed = _listing(self.categories)
        if not isinstance(value, str):
            raise _BadRequest(
                f"{where} must be one of the categories of column {self.name} (a string), "
                f"found {_json_type(value)}; allowed: {allowed}"
            )
        try:
            return float(self.categories.index(value))
        except ValueError:
            raise _BadRequest(
                f"{where}: unknown category {value!r} for column {self.name}; allowed: {allowed}"
            ) from None

    def example(self) -> Any:
        """A valid value, for the self-check and ``GET /model``."""
        if self.categories is not None:
            return self.categories[0]
        if self.dtype == "int":
            if self.low is not None:
                return math.ceil(self.low)
            return 0 if self.high is None else math.floor(min(0.0, self.high))
        return self.low if self.low is not None else min(0.0, self.high or 0.0)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "type": self.dtype}
        if self.categories is not None:
            out["categories"] = list(self.categories)
        else:
            out |= {"min": self.low, "max": self.high}
        return out


@dataclass(frozen=True, kw_only=True)
class _TableInput:
    """Named features from the data schema recorded at training (``meta["data_schema"]``).

    One input is an object of features (``{"x1": 0.3, "color": "red"}``); several are
    ``{"instances": [...]}``, each an object of features or an array in schema order. A
    category feature is sent as its category string and fed to the model as its code.
    """

    features: tuple[_Feature, ...]

    @classmethod
    def of(cls, schema: TableSchema) -> "_TableInput":
        return cls(
            features=tuple(
                _Feature(name=c.name, dtype=c.dtype, low=c.min, high=c.max, categories=c.categories)
                for c in schema.features
            )
        )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)

    @property
    def signature(self) -> tuple:
        """What clients send, and what the model makes of a category: a swap must keep it."""
        return ("table", tuple((f.name, f.dtype, f.categories) for f in self.features))

    def summary(self) -> str:
        return "features " + _listing(
            f"{f.name} ({f.dtype}{'' if f.categories is None else ': ' + '|'.join(f.categories)})"
            for f in self.features
        )

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "table",
            "features": [f.describe() for f in self.features],
            "example": {f.name: f.example() for f in self.features},
        }

    def parse(self, payload: dict[str, Any]) -> tuple[list[list[float]], bool]:
        """The rows of a request body, and whether it was one input (not ``instances``)."""
        # A feature may itself be named "instances": its value is never an array.
        batch = _INSTANCES in payload and (
            _INSTANCES not in self.names or isinstance(payload[_INSTANCES], list)
        )
        if not batch:
            return [self._named(payload, "request body", "")], True
        extra = sorted(set(payload) - {_INSTANCES})
        if extra:
            raise _BadRequest(
                f"request body must have either the key {_INSTANCES!r} (a list of inputs) or "
                f"the features of one input, not both; found also {_listing(extra)}"
            )
        return _instances(self, payload[_INSTANCES]), False

    def row(self, value: Any, where: str) -> list[float]:
        """One input of ``instances``: an object of features or an array in schema order."""
        if isinstance(value, dict):
            return self._named(value, where, f"{where}.")
        if not isinstance(value, list):
            raise _BadRequest(
                f"{where} must be an object of features or an array of {len(self.features)} "
                f"values in the order {_listing(self.names)}, found {_json_type(value)}"
            )
        if len(value) != len(self.features):
            raise _BadRequest(
                f"{where} has the wrong length: expected {len(self.features)} values in the "
                f"order {_listing(self.names)}, found {len(value)}"
            )
        return [
            f.value(v, f"{where}[{i}] ({f.name})")
            for i, (f, v) in enumerate(zip(self.features, value, strict=True))
        ]

    def probe_row(self) -> list[float]:
        return self._named({f.name: f.example() for f in self.features}, "probe", "")

    def tensor(self, rows: list[list[float]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), len(self.features))

    def _named(self, value: dict[str, Any], where: str, prefix: str) -> list[float]:
        missing = [n for n in self.names if n not in value]
        unknown = sorted(set(value) - set(self.names))
        problems = []
        if missing:
            problems.append(
                f"{where} is missing the feature(s) {_listing(missing)}; every feature is "
                f"required: {_listing(self.names)}"
            )
        if unknown:
            problems.append(
                f"{where} has unknown feature(s) {_listing(unknown)}; the features are "
                f"{_listing(self.names)}"
            )
        if problems:
            raise _BadRequest("; ".join(problems))
        return [f.value(value[f.name], f"{prefix}{f.name}") for f in self.features]


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a finite number and is not allowed")


def _parse_json(body: bytes) -> Any:
    if not body.strip():
        raise _BadRequest("request body is empty: send a JSON object")
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:
        raise _BadRequest(f"request body is not valid JSON: {err}") from err


async def _read_body(request: Request, limit: int) -> bytes:
    """Read the body, refusing one over ``limit`` bytes by its header or as it streams in."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise _BadRequest(f"Content-Length must be a byte count, found {declared!r}")
        if int(declared) > limit:
            raise _BadRequest(
                f"request body of {int(declared)} bytes is over the limit of {limit} bytes", 413
            )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _BadRequest(f"request body is over the limit of {limit} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def _finite_json(value: Any) -> Any:
    """``value`` with non-finite floats as ``None``, which strict JSON can carry."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_json(v) for v in value]
    return value


# Keys of an answer besides the label: ``output_name`` may not take one of them.
_RESERVED_OUTPUT_NAMES = ("probabilities", "model", _INSTANCES, "predictions")


def _custom_predict_step(module: torch.nn.Module) -> bool:
    """Whether the module defines its own ``predict_step`` (not Lightning's default one)."""
    for cls in type(module).__mro__:
        if "predict_step" in vars(cls):
            return not cls.__module__.startswith(("lightning.", "pytorch_lightning."))
    return False


def _call_predict_step(module: torch.nn.Module, x: torch.Tensor) -> Any:
    """``module.predict_step(x, 0)``, or ``(x)`` for a step that takes no batch index."""
    step = module.predict_step
    try:
        inspect.signature(step).bind(x, 0)
    except (TypeError, ValueError):
        return step(x)
    return step(x, 0)


def _per_row(out: Any, n: int) -> list[Any]:
    """A tensor, or a dict of them, with a first dimension of ``n`` as ``n`` JSON values."""
    if isinstance(out, torch.Tensor):
        if out.ndim == 0 or out.shape[0] != n:
            raise ValueError(
                f"predict_step gave a tensor of shape {list(out.shape)} for {n} input(s); "
                f"it must have one row per input, a first dimension of {n}"
            )
        return out.detach().cpu().tolist()
    if isinstance(out, dict) and out and all(isinstance(k, str) for k in out):
        columns = {k: _per_row(v, n) for k, v in out.items()}
        return [{k: column[i] for k, column in columns.items()} for i in range(n)]
    raise ValueError(
        "predict_step must return a tensor or a dict of tensors (string keys), one row per "
        f"input; it returned {type(out).__name__}"
    )


@dataclass(frozen=True, kw_only=True)
class _OutputSpec:
    """What an answer holds, from the module and the recorded data schema.

    ``prediction``: the module's own ``predict_step`` output for the row. ``classification``:
    ``{key: class id or category string, "probabilities": softmax}``, where ``key`` is the
    module's ``output_name`` or ``"label"``. ``regression``: ``{"value": float}``.
    """

    kind: str
    key: str
    """The answer's main key: the label's name, ``"value"`` or ``"prediction"``."""
    classes: int | None = None
    categories: tuple[str, ...] | None = None
    """The label's categories, answered instead of their codes."""
    label_column: str | None = None

    @property
    def signature(self) -> tuple:
        """What clients read; a swap must keep it."""
        return (self.kind, self.key)

    def summary(self) -> str:
        return f"with {self.key!r} ({self.kind})"

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"task": self.kind, "keys": [self.key]}
        if self.kind == "classification":
            out["keys"].append("probabilities")
            out |= {"classes": self.classes, "label_column": self.label_column}
            if self.categories is not None:
                out["categories"] = list(self.categories)
        elif self.kind == "regression":
            out["label_column"] = self.label_column
        return out

    def raw(self, module: torch.nn.Module, x: torch.Tensor) -> Any:
        with torch.inference_mode():
            if self.kind == "prediction":
                return _call_predict_step(module, x)
            return module(x)

    def check(self, out: Any, n: int) -> None:
        """Raise ValueError unless ``out`` is what this answer needs for ``n`` inputs."""
        if self.kind == "prediction":
            _per_row(out, n)
            return
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"forward returned {type(out).__name__}, not a tensor")
        if self.kind == "regression":
            fits, expected = tuple(out.shape) in ((n,), (n, 1)), f"[{n}] or [{n}, 1]"
        else:
            fits = out.ndim == 2 and out.shape[0] == n
            fits = fits and self.classes in (None, out.shape[1])
            expected = f"[{n}, {self.classes or 'classes'}]"
        if not fits:
            raise ValueError(
                f"a valid input gave scores of shape {list(out.shape)}, expected {expected}"
                + ("" if self.classes is None else f" ({self.classes} classes in the data)")
            )
        if not bool(torch.isfinite(out).all()):
            raise ValueError(f"a valid input gave non-finite scores of shape {list(out.shape)}")

    def answers(self, module: torch.nn.Module, x: torch.Tensor) -> list[dict[str, Any]]:
        out, n = self.raw(module, x), x.shape[0]
        if self.kind == "prediction":
            return [{self.key: row} for row in _per_row(out, n)]
        if self.kind == "regression":
            return [{self.key: v} for v in out.float().reshape(n).tolist()]
        probabilities = torch.softmax(out.float(), dim=-1)
        labels = probabilities.argmax(dim=-1).tolist()
        if self.categories is not None:
            labels = [self.categories[i] for i in labels]
        return [
            {self.key: label, "probabilities": p}
            for label, p in zip(labels, probabilities.tolist(), strict=True)
        ]


def _data_schema(ckpt: ModelCheckpoint) -> TableSchema | None:
    """The data schema recorded at training, ``None`` for a checkpoint without one."""
    raw = ckpt.meta.get("data_schema") if isinstance(ckpt.meta, dict) else None
    if raw is None:
        return None
    try:
        return TableSchema.from_json(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ServingError(
            f"{ckpt.uri}: meta['data_schema'] is not a data schema "
            f"(TableSchema.to_json()): {type(err).__name__}: {err}"
        ) from err


def _output_spec(module: torch.nn.Module, schema: TableSchema | None, where: str) -> _OutputSpec:
    name = getattr(module, "output_name", None)
    if name is not None and (
        not isinstance(name, str) or not name or name in _RESERVED_OUTPUT_NAMES
    ):
        raise ServingError(
            f"{where}.output_name must be a plain name, not one of "
            f"{list(_RESERVED_OUTPUT_NAMES)}, got {name!r}"
        )
    if _custom_predict_step(module):
        return _OutputSpec(kind="prediction", key="prediction")
    if schema is not None and schema.task == "regression":
        return _OutputSpec(kind="regression", key="value", label_column=schema.label.name)
    if schema is None:
        return _OutputSpec(kind="classification", key=name or "label")
    categories = schema.label.categories
    return _OutputSpec(
        kind="classification",
        key=name or "label",
        classes=schema.classes if categories is None else len(categories),
        categories=categories,
        label_column=schema.label.name,
    )


def _specs(
    module: torch.nn.Module, ckpt: ModelCheckpoint
) -> tuple[_InputSpec | _TableInput, _OutputSpec]:
    """The request and the answer: the module's ``input_schema`` when it declares one (the
    digits demo), else the data schema recorded at training (``meta["data_schema"]``)."""
    where = f"{ckpt.uri}: {type(module).__qualname__}"
    schema = _data_schema(ckpt)
    declared = getattr(module, "input_schema", None)
    if declared is not None:
        spec: _InputSpec | _TableInput = _InputSpec.of(declared, where)
    elif schema is not None:
        spec = _TableInput.of(schema)
    else:
        raise ServingError(
            f"{ckpt.uri}: cannot tell what {ckpt.module} takes as input: the checkpoint "
            "records no data schema (meta['data_schema']) and the module declares no "
            "input_schema; train it through ringflow, which records the data schema, or "
            "declare input_schema on the module class"
        )
    return spec, _output_spec(module, schema, where)


def _fingerprint(state_dict: dict[str, torch.Tensor]) -> str:
    """A short digest of the weights: names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _model_info(
    ckpt: ModelCheckpoint,
    spec: _InputSpec | _TableInput,
    output: _OutputSpec,
    fingerprint: str,
    record: Any,
) -> dict:
    """What ``GET /model`` answers; ``record`` is the registry's ModelVersion, if any.

    ``input`` describes the request (the module's ``input_schema``, or the features with
    their types, bounds and categories, and an example), ``output`` names the answer's
    main key and ``answer`` describes the answer."""
    info = {
        "uri": ckpt.uri,
        "module": ckpt.module,
        "fingerprint": fingerprint,
        "version": None,
        "trained_at": None,
        "hparams": ckpt.hparams,
        "metrics": ckpt.metrics,
        "meta": ckpt.meta,
        "input": spec.describe(),
        "output": output.key,
        "answer": output.describe(),
    }
    if record is not None:
        info |= {
            "version": record.version,
            "trained_at": record.trained_at,
            "registered_at": record.registered_at,
            "metrics": record.metrics,
            "training_metrics": ckpt.metrics,
            "data_fingerprint": record.data_fingerprint,
        }
    return _finite_json(info)


@dataclass(frozen=True, kw_only=True)
class _ServerOptions:
    """How a replica serves, whichever model it serves."""

    max_batch_size: int
    batching: bool
    max_body_bytes: int


@dataclass(frozen=True, kw_only=True)
class _FixedModel:
    """Serve one checkpoint for the application's lifetime."""

    uri: str
    allowed: tuple[str, ...]
    """The model classes the checkpoint may hold (``storage.checkpoint.load_model``)."""

    def __str__(self) -> str:
        return self.uri


@dataclass(frozen=True, kw_only=True)
class _RegistryModel:
    """Serve a registry's production version and follow its pointer."""

    url: str
    model: str
    poll_s: float
    allowed: tuple[str, ...]
    """The model classes a version may hold; any other is skipped unimported."""

    def __str__(self) -> str:
        return f"{self.url}/{self.model} (production, polled every {self.poll_s:g} s)"


@dataclass(frozen=True, kw_only=True)
class _Served:
    """A loaded, checked model and everything answers say about it. Replaced as a whole
    on a swap, so a request that took one reference uses one model throughout."""

    module: torch.nn.Module
    spec: _InputSpec | _TableInput
    output: _OutputSpec
    version: str | None
    """The registry version, ``None`` when serving a bare checkpoint."""
    tag: dict[str, Any]
    """``model`` in every answer: uri, module, fingerprint, version."""
    info: dict[str, Any]
    """``GET /model``."""


def _load_served(uri: str, allowed: tuple[str, ...], record: Any = None) -> _Served:
    """Load the checkpoint at ``uri`` (one of the ``allowed`` classes) and check it answers
    a probe before it serves."""
    module, ckpt = load_model(uri, allowed=allowed)
    spec, output = _specs(module, ckpt)
    _probe(module, spec, output, uri)
    fingerprint = _fingerprint(ckpt.state_dict)
    version = None if record is None else record.version
    return _Served(
        module=module,
        spec=spec,
        output=output,
        version=version,
        tag={
            "uri": ckpt.uri,
            "module": ckpt.module,
            "fingerprint": fingerprint,
            "version": version,
        },
        info=_model_info(ckpt, spec, output, fingerprint, record),
    )


def _probe(
    module: torch.nn.Module, spec: _InputSpec | _TableInput, output: _OutputSpec, uri: str
) -> None:
    """Forward passes on valid inputs (one row, then two): the answer must come out of
    them, with finite scores, or the model is refused."""
    for n in (1, 2):
        try:
            rows = [spec.probe_row()] * n
            output.check(output.raw(module, spec.tensor(rows)), n)
        except Exception as err:  # the model's own code: any failure refuses it
            message = str(err).splitlines()[0] if str(err) else ""
            raise ServingError(
                f"{uri} failed its self-check: {type(err).__name__}: {message}"
            ) from err


def _forward(served: _Served, rows: list[list[float]]) -> list[dict[str, Any]]:
    answers = served.output.answers(served.module, served.spec.tensor(rows))
    return [_finite_json(a) for a in answers]


def _instances(spec: _InputSpec | _TableInput, value: Any) -> list[list[float]]:
    if not isinstance(value, list):
        raise _BadRequest(f"{_INSTANCES} must be an array of inputs, found {_json_type(value)}")
    if not value:
        raise _BadRequest(f"{_INSTANCES} is empty: send at least one input")
    if len(value) > _MAX_INSTANCES:
        raise _BadRequest(
            f"{_INSTANCES} has {len(value)} inputs, over the limit of {_MAX_INSTANCES} per request"
        )
    return [spec.row(row, f"{_INSTANCES}[{i}]") for i, row in enumerate(value)]


def _check_compatible(current: _Served, new: _Served, version: str) -> None:
    """Refuse a swap that would change what clients send or read."""
    for part, old, fresh in (
        ("takes", current.spec, new.spec),
        ("answers", current.output, new.output),
    ):
        if fresh.signature != old.signature:
            raise ServingError(
                f"{version} {part} {fresh.summary()}, the served model {old.summary()}; "
                "clients would break, so redeploy with serve_registry instead"
            )


def _registry(source: _RegistryModel) -> Any:
    from ringflow.storage.registry import ModelRegistry

    return ModelRegistry(source.url, source.model)


# Everything ModelServer uses is defined above it: Serve pickles the class when it is
# decorated, so later module globals would be missing in the replica.
_api = FastAPI(title="ringflow model server", docs_url=None, redoc_url=None, openapi_url=None)


@_api.exception_handler(_BadRequest)
async def _bad_request(request: Request, exc: _BadRequest) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, status_code=exc.status)


@_api.exception_handler(RequestValidationError)
async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    problems = "; ".join(
        f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}" for err in exc.errors()
    )
    return JSONResponse({"error": f"invalid request: {problems}"}, status_code=400)


@_api.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse(
        {"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers
    )


def _keep_replica_grpc_on_node_address() -> None:
    """Bind the replica's inter-deployment gRPC server to this node's address.

    Ray Serve 2.60 binds it on ``[::]``, every interface; on one machine that would expose
    the replica beyond loopback. The node address is what other nodes reach it by anyway.
    """
    import ray
    from ray.serve._private import replica as serve_replica

    original = getattr(serve_replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "ringflow_node_address", False):
        return
    host = ray.util.get_node_ip_address()

    def add_port(server, address: str):
        if address.startswith("[::]:"):
            address = f"{host}:{address.removeprefix('[::]:')}"
        return original(server, address)

    add_port.ringflow_node_address = True
    serve_replica.add_port_to_grpc_server = add_port


def _shipped_code_first() -> None:
    """Put the code shipped with this deployment's job (Ray's ``py_modules``, on
    ``PYTHONPATH``) ahead of the directories of the job that started Serve on the cluster:
    a replica imports the trained project's own ``models`` package, not a package of that
    name where an earlier run of another project worked."""
    import sys

    shipped = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = shipped + [p for p in sys.path if p not in shipped]


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(_api)
class ModelServer:
    """One replica: loads the model once, answers predictions, follows a registry pointer.

    Args:
        source: a fixed checkpoint, or a registry whose production version to follow.
        options: batching and body limits.
        auth: the bearer token's digest, or ``None`` to serve without a token.
        deployment: the digest of what was deployed, reported by ``GET /healthz``.
    """

    def __init__(
        self,
        source: _FixedModel | _RegistryModel,
        options: _ServerOptions,
        *,
        auth: _TokenCheck | None,
        deployment: str = "",
    ) -> None:
        _keep_replica_grpc_on_node_address()
        _shipped_code_first()
        self._deployment = deployment
        self._max_body_bytes = options.max_body_bytes
        self._batching = options.batching
        self._auth = auth
        self._predict_one.set_max_batch_size(options.max_batch_size)
        self._stop = threading.Event()
        if isinstance(source, _FixedModel):
            self._served = _load_served(source.uri, source.allowed)
            return
        registry = _registry(source)
        record = registry.production_version()
        if record is None:
            raise ServingError(f"{registry.url} has no production version")
        self._served = _load_served(record.uri, source.allowed, record)
        threading.Thread(
            target=self._follow_production,
            args=(registry, source),
            name="ringflow-follow-production",
            daemon=True,
        ).start()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()

    @_api.get("/healthz")
    async def healthz(self, request: Request, response: Response) -> dict[str, str]:
        self._authorize(request)
        response.headers[_DEPLOYMENT_HEADER] = self._deployment
        return {"status": "ok"}

    @_api.get("/model")
    async def model(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return self._served.info

    @_api.post("/predict")
    async def predict(self, request: Request, response: Response) -> dict[str, Any]:
        self._authorize(request)
        payload = _parse_json(await _read_body(request, self._max_body_bytes))
        if not isinstance(payload, dict):
            raise _BadRequest(f"request body must be a JSON object, found {_json_type(payload)}")
        served = self._served  # a swap keeps the input: only compatible models swap in
        rows, single = served.spec.parse(payload)
        if single:
            if self._batching:
                answer = await self._predict_one(rows[0])
            else:
                answer = (await asyncio.to_thread(self._predict_rows, rows))[0]
        else:
            predictions = await asyncio.to_thread(_forward, served, rows)
            answer = {"predictions": predictions, "model": served.tag}
        response.headers[_VERSION_HEADER] = str(
            answer["model"]["version"] or answer["model"]["fingerprint"]
        )
        return answer

    def _authorize(self, request: Request) -> None:
        if self._auth is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not self._auth.accepts(token.strip()):
            raise HTTPException(
                status_code=401,
                detail="a valid bearer token is required: send 'Authorization: Bearer <token>'",
                headers={"WWW-Authenticate": "Bearer"},
            )

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=_BATCH_WAIT_S)
    async def _predict_one(self, rows: list[list[float]]) -> list[dict[str, Any]]:
        """Run concurrent single-input requests as one forward pass."""
        return await asyncio.to_thread(self._predict_rows, rows)

    def _predict_rows(self, rows: list[list[float]]) -> list[dict[str, Any]]:
        served = self._served  # one model for the whole forward pass, even mid-swap
        return [{**p, "model": served.tag} for p in _forward(served, rows)]

    def _follow_production(self, registry: Any, source: _RegistryModel) -> None:
        """Poll the production pointer; load, check and swap in each new version."""
        retry_at: dict[str, float] = {}
        while not self._stop.wait(source.poll_s):
            try:
                pointer = registry.production()
            except Exception as err:  # storage hiccup: keep serving, read again next poll
                logger.warning("cannot read the production pointer of %s: %s", registry, err)
                continue
            wanted = None if pointer is None else pointer.version
            if wanted in (None, self._served.version) or time.monotonic() < retry_at.get(
                wanted, 0.0
            ):
                continue
            try:
                served = self._load_compatible(registry, wanted, source.allowed)
            except Exception as err:  # a bad version must never take the replica down
                retry_at[wanted] = time.monotonic() + _SWAP_RETRY_S
                logger.warning(
                    "keeping %s: production moved to %s, which did not load or check (%s); "
                    "trying again in %.0f s",
                    self._served.version,
                    wanted,
                    err,
                    _SWAP_RETRY_S,
                )
                continue
            old, self._served = self._served.version, served  # one reference: the swap
            logger.info("swapped %s -> %s (%s)", old, wanted, served.tag["uri"])

    def _load_compatible(self, registry: Any, version: str, allowed: tuple[str, ...]) -> _Served:
        record = registry.get(version)
        served = _load_served(record.uri, allowed, record)
        _check_compatible(self._served, served, version)
        return served
