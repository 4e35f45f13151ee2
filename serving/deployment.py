"""Deploying a model on Ray Serve: :func:`serve_model` (one checkpoint), :func:`serve_registry`
(whatever a registry's production pointer names, followed in place), :func:`shutdown_serving`;
the token, the Serve instance on 127.0.0.1, and a deployment digest that makes deploying
what already runs a no-op.
"""

# No ``from __future__ import annotations`` here: Serve pickles ModelServer by value, and
# FastAPI must then resolve its routes' annotations (``request: Request``) as objects, since
# the pickled methods' globals no longer hold every name a string annotation could refer to.

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import httpx
import torch
from ray import serve

from ringflow.serving.replica import (
    DEPLOYMENT_HEADER,
    FixedModel,
    ModelServer,
    RegistryModel,
    ServerOptions,
    TokenCheck,
    probe,
)
from ringflow.serving.schema import InputSpec, OutputSpec, ServingError, TableInput, request_specs
from ringflow.storage.checkpoint import CheckpointError, ModelCheckpoint, class_path, load_model

logger = logging.getLogger(__name__)

_HEALTH_DEADLINE_S = 60.0


_HEALTH_POLL_S = 0.25


_FOLLOW_WAIT_S = 30.0  # beyond two polls: load and check a version in the replica


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
    source = FixedModel(uri=model_uri, allowed=_allowed(allowed))
    # CheckpointError propagates before anything deploys
    module, ckpt = load_model(model_uri, allowed=source.allowed)
    _check_servable(module, ckpt)
    options = ServerOptions(
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
    source = RegistryModel(
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
    options = ServerOptions(
        max_batch_size=max_batch_size, batching=batching, max_body_bytes=max_body_bytes
    )
    token = _read_token(token_env, token_file)
    address = (host, port, route_prefix)
    url = _endpoint(host, port, route_prefix)
    digest = _deployment_digest(source, options, token=token, address=address, app_name=app_name)
    if _follows_in_place(
        url, token, digest, source, wanted=record.version, specs=request_specs(module, ckpt)
    ):
        logger.info("%r at %s already serves %s; it follows the pointer", app_name, url, source)
        return url
    return _deploy(source, options, token=token, address=address, app_name=app_name)


def _deploy(
    source: "FixedModel | RegistryModel",
    options: "ServerOptions",
    *,
    token: str | None,
    address: tuple[str, int, str],
    app_name: str,
) -> str:
    host, port, route_prefix = address
    auth = TokenCheck.for_token(token) if token is not None else None
    _start_serve(host, port)
    url = _endpoint(host, port, route_prefix)
    digest = _deployment_digest(source, options, token=token, address=address, app_name=app_name)
    if isinstance(source, FixedModel) and _running_digest(url, token) == digest:
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
    source: "FixedModel | RegistryModel",
    options: "ServerOptions",
    *,
    token: str | None,
    address: tuple[str, int, str],
    app_name: str,
) -> str:
    """What identifies a deployment: equal digests mean redeploying would change nothing.

    The token enters only as a hash; the serving package's own source does too, so new
    serving code is always redeployed.
    """
    package = os.path.dirname(os.path.abspath(__file__))
    source_digest = hashlib.sha256()
    for name in sorted(n for n in os.listdir(package) if n.endswith(".py")):
        with open(os.path.join(package, name), "rb") as f:
            source_digest.update(name.encode() + b"\0" + f.read())
    code = source_digest.hexdigest()
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
    return reply.headers.get(DEPLOYMENT_HEADER) if reply.status_code == 200 else None


def _follows_in_place(
    url: str,
    token: str | None,
    digest: str,
    source: "RegistryModel",
    *,
    wanted: str,
    specs: "tuple[InputSpec | TableInput, OutputSpec]",
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
    source: "RegistryModel", version: str, specs: "tuple[InputSpec | TableInput, OutputSpec]"
) -> bool:
    """Whether the registry's ``version`` takes the input and gives the answer ``specs`` do."""
    from ringflow.storage.registry import ModelRegistry, RegistryError

    try:
        uri = ModelRegistry(source.url, source.model).get(version).uri
        module, ckpt = load_model(uri, allowed=source.allowed)
    except (CheckpointError, RegistryError, OSError, ValueError):
        return False
    old_spec, old_output = request_specs(module, ckpt)
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
    spec, output = request_specs(module, ckpt)
    probe(module, spec, output, ckpt.uri)


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
