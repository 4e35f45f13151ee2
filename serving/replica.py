"""One Serve replica (:class:`ModelServer`): loads the model once, checks each request's token,
answers ``POST /predict``, ``GET /healthz`` and ``GET /model`` behind a FastAPI ingress, and
follows a registry's production pointer, swapping to a new version only once it loaded and
checked it.
"""

# No ``from __future__ import annotations`` here: Serve pickles ModelServer by value, and
# FastAPI must then resolve its routes' annotations (``request: Request``) as objects, since
# the pickled methods' globals no longer hold every name a string annotation could refer to.

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException

from ringflow.serving.schema import (
    BadRequest,
    InputSpec,
    OutputSpec,
    ServingError,
    TableInput,
    finite_json,
    json_type,
    parse_json,
    request_specs,
)
from ringflow.storage.checkpoint import ModelCheckpoint, load_model

logger = logging.getLogger(__name__)

_BATCH_WAIT_S = 0.005


_VERSION_HEADER = "X-Model-Version"


DEPLOYMENT_HEADER = "X-Ringflow-Deployment"


_SWAP_RETRY_S = 30.0


@dataclass(frozen=True, kw_only=True)
class TokenCheck:
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
    def for_token(cls, token: str) -> "TokenCheck":
        salt = secrets.token_bytes(16)
        return cls(salt=salt, digest=_hmac(salt, token))

    def accepts(self, token: str) -> bool:
        return hmac.compare_digest(_hmac(self.salt, token), self.digest)

    def __repr__(self) -> str:
        return "TokenCheck(<redacted>)"


def _hmac(salt: bytes, token: str) -> bytes:
    return hmac.new(salt, token.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()


async def _read_body(request: Request, limit: int) -> bytes:
    """Read the body, refusing one over ``limit`` bytes by its header or as it streams in."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise BadRequest(f"Content-Length must be a byte count, found {declared!r}")
        if int(declared) > limit:
            raise BadRequest(
                f"request body of {int(declared)} bytes is over the limit of {limit} bytes", 413
            )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"request body is over the limit of {limit} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


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
    spec: InputSpec | TableInput,
    output: OutputSpec,
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
    return finite_json(info)


@dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """How a replica serves, whichever model it serves."""

    max_batch_size: int
    batching: bool
    max_body_bytes: int


@dataclass(frozen=True, kw_only=True)
class FixedModel:
    """Serve one checkpoint for the application's lifetime."""

    uri: str
    allowed: tuple[str, ...]
    """The model classes the checkpoint may hold (``storage.checkpoint.load_model``)."""

    def __str__(self) -> str:
        return self.uri


@dataclass(frozen=True, kw_only=True)
class RegistryModel:
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
    spec: InputSpec | TableInput
    output: OutputSpec
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
    spec, output = request_specs(module, ckpt)
    probe(module, spec, output, uri)
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


def probe(
    module: torch.nn.Module, spec: InputSpec | TableInput, output: OutputSpec, uri: str
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
    return [finite_json(a) for a in answers]


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


def _registry(source: RegistryModel) -> Any:
    from ringflow.storage.registry import ModelRegistry

    return ModelRegistry(source.url, source.model)


# Everything ModelServer uses is defined above it: Serve pickles the class when it is
# decorated, so later module globals would be missing in the replica.
_api = FastAPI(title="ringflow model server", docs_url=None, redoc_url=None, openapi_url=None)


@_api.exception_handler(BadRequest)
async def _bad_request(request: Request, exc: BadRequest) -> JSONResponse:
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
        source: FixedModel | RegistryModel,
        options: ServerOptions,
        *,
        auth: TokenCheck | None,
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
        if isinstance(source, FixedModel):
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
        response.headers[DEPLOYMENT_HEADER] = self._deployment
        return {"status": "ok"}

    @_api.get("/model")
    async def model(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return self._served.info

    @_api.post("/predict")
    async def predict(self, request: Request, response: Response) -> dict[str, Any]:
        self._authorize(request)
        payload = parse_json(await _read_body(request, self._max_body_bytes))
        if not isinstance(payload, dict):
            raise BadRequest(f"request body must be a JSON object, found {json_type(payload)}")
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

    def _follow_production(self, registry: Any, source: RegistryModel) -> None:
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
