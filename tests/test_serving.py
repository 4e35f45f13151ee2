"""Serving a checkpoint with Ray Serve: real HTTP against a replica on loopback.

One Serve instance per module (Serve takes seconds to start) and one application for the
digits demo; the token tests and the tabular models (a request and an answer derived from
the data schema recorded in the checkpoint) add applications under their own route
prefixes on the same instance.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringflow.models.digits import SCHEMA as DIGITS_SCHEMA
from ringflow.models.digits import DigitsClassifier
from ringflow.models.tabular import TabularMLP
from ringflow.serving import ServingError, serve_model, shutdown_serving
from ringflow.serving.replica import _check_compatible, _forward, _load_served
from ringflow.storage.checkpoint import CheckpointError, save_model
from ringflow.storage.dataset import Column, TableSchema
from tests.support.net import free_port

APP = "ringflow-test"
SECURE_APP = "ringflow-test-secure"
FILE_TOKEN_APP = "ringflow-test-file-token"
REGRESSION_APP = "ringflow-test-regression"
CLASSIFICATION_APP = "ringflow-test-classification"
FILE_TOKEN = "file-token-3a7c9e1f5b2d4068"
UNSET_TOKEN_ENV = "RINGFLOW_TEST_SERVING_TOKEN_NEVER_SET"
ALLOWED = (
    "ringflow.models.digits:DigitsClassifier",
    "ringflow.models.tabular:TabularMLP",
    "tests.test_serving:_Doubler",
)
"""The model classes this module's servers load."""
TOKEN_ENV = "RINGFLOW_TEST_SERVING_TOKEN"
MAX_BODY = 1_000_000
PIXELS = 64


def _pixels(seed: int, n: int) -> list[list[float]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 17, (n, PIXELS), generator=gen).float().tolist()


def _local_digits(module: torch.nn.Module, rows: list[list[float]]) -> list[int]:
    with torch.inference_mode():
        return module(torch.tensor(rows)).argmax(dim=1).tolist()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[torch.nn.Module, str]:
    torch.manual_seed(0)
    module = DigitsClassifier(hidden=16).eval()
    uri = save_model(
        str(tmp_path_factory.mktemp("serving") / "model"),
        module,
        hparams=dict(module.hparams),
        metrics={"val_accuracy": 0.125},
        meta={"step": 7},
    )
    return module, uri


@pytest.fixture(scope="module")
def port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def endpoint(ray_session, model, port):
    from ray import serve

    assert UNSET_TOKEN_ENV not in os.environ
    _, uri = model
    url = serve_model(uri, allowed=ALLOWED, port=port, app_name=APP, token_env=UNSET_TOKEN_ENV)
    yield url
    shutdown_serving(APP)
    shutdown_serving(SECURE_APP)
    shutdown_serving(FILE_TOKEN_APP)
    shutdown_serving(REGRESSION_APP)
    shutdown_serving(CLASSIFICATION_APP)
    serve.shutdown()


@pytest.fixture(scope="module")
def http(endpoint):
    with httpx.Client(base_url=endpoint, timeout=30.0, trust_env=False) as client:
        yield client


# --------------------------------------------------------------------------- good requests


@pytest.mark.ray
def test_port_in_use_is_an_error_and_leaves_no_serve(ray_session, model):
    # First in the module, before the endpoint fixture starts Serve.
    from ray.serve.context import _get_global_client

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServingError, match=f"127.0.0.1:{port}"):
            serve_model(
                model[1], allowed=ALLOWED, port=port, app_name="clash", token_env=UNSET_TOKEN_ENV
            )
    assert _get_global_client(raise_if_no_controller_running=False) is None


@pytest.mark.ray
def test_the_model_listens_on_loopback_only(endpoint, port, http):
    assert endpoint == f"http://127.0.0.1:{port}"
    assert http.get("/healthz").status_code == 200
    listening = _listening_addresses(port)
    assert listening == {"127.0.0.1"}, f"Serve's HTTP proxy listens on {listening}"


def _listening_addresses(port: int) -> set[str]:
    """The local addresses with a socket listening on ``port`` (from /proc/net/tcp{,6})."""
    import ipaddress

    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                address, hex_port = local.split(":")
                if state != "0A" or int(hex_port, 16) != port:
                    continue
                raw = bytes.fromhex(address)
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
                found.add(str(ipaddress.ip_address(words)))
    return found


@pytest.mark.ray
def test_predict_single_matches_local_forward(http, model):
    module, uri = model
    rows = _pixels(seed=1, n=5)
    for row, expected in zip(rows, _local_digits(module, rows), strict=True):
        response = http.post("/predict", json={"pixels": row})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["digit"] == expected
        assert len(body["probabilities"]) == 10
        assert math.isclose(sum(body["probabilities"]), 1.0, rel_tol=1e-5)
        assert body["model"]["uri"] == uri
        assert body["model"]["module"] == "ringflow.models.digits:DigitsClassifier"


@pytest.mark.ray
def test_predict_batch_matches_per_row_argmax(http, model):
    module, _ = model
    rows = _pixels(seed=2, n=20)
    response = http.post("/predict", json={"instances": rows})
    assert response.status_code == 200, response.text
    predictions = response.json()["predictions"]
    assert [p["digit"] for p in predictions] == _local_digits(module, rows)
    for p in predictions:
        assert math.isclose(sum(p["probabilities"]), 1.0, rel_tol=1e-5)


@pytest.mark.ray
def test_concurrent_single_requests_all_answer(endpoint, model):
    module, _ = model
    rows = _pixels(seed=3, n=48)

    def predict(row: list[float]) -> int:
        with httpx.Client(base_url=endpoint, timeout=30.0, trust_env=False) as client:
            response = client.post("/predict", json={"pixels": row})
        assert response.status_code == 200, response.text
        return response.json()["digit"]

    with ThreadPoolExecutor(max_workers=16) as pool:
        digits = list(pool.map(predict, rows))
    assert digits == _local_digits(module, rows)


@pytest.mark.ray
def test_healthz(http):
    response = http.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.ray
def test_model_describes_checkpoint(http, model):
    module, uri = model
    info = http.get("/model").json()
    assert info["uri"] == uri
    assert info["module"] == "ringflow.models.digits:DigitsClassifier"
    assert info["hparams"] == dict(module.hparams)
    assert info["hparams"]["hidden"] == 16
    assert info["metrics"] == {"val_accuracy": 0.125}
    assert info["meta"] == {"step": 7}
    assert info["input"]["name"] == "pixels"
    assert info["output"] == "digit"


@pytest.mark.ray
def test_listens_on_loopback_only(endpoint, port):
    if shutil.which("ss") is None:
        pytest.skip("ss is not installed")
    listing = subprocess.run(["ss", "-tln"], capture_output=True, text=True, check=True).stdout
    addresses = [
        line.split()[3] for line in listing.splitlines()[1:] if line.split()[3].endswith(f":{port}")
    ]
    assert addresses, listing
    assert all(a == f"127.0.0.1:{port}" for a in addresses), addresses


@pytest.mark.ray
def test_no_ray_process_listens_beyond_loopback(endpoint):
    if shutil.which("ss") is None:
        pytest.skip("ss is not installed")
    listing = subprocess.run(["ss", "-tlnp"], capture_output=True, text=True, check=True).stdout
    exposed = [
        line
        for line in listing.splitlines()[1:]
        if ("ray::" in line or "raylet" in line or "gcs_server" in line)
        and not line.split()[3].rsplit(":", 1)[0].strip("[]").endswith("127.0.0.1")
    ]
    assert not exposed, "\n".join(exposed)


# --------------------------------------------------------------------------- bad requests

_ZEROS = [0.0] * PIXELS


def _with(index: int, value: str) -> bytes:
    """A single-input body whose pixel ``index`` is the raw JSON token ``value``."""
    tokens = ["0"] * PIXELS
    tokens[index] = value
    return ('{"pixels": [' + ", ".join(tokens) + "]}").encode()


BAD_BODIES = {
    "empty body": (b"", "empty"),
    "not json": (b"{pixels: [1, 2", "not valid JSON"),
    "not utf-8": (b"\xff\xfe\xfa", "not valid JSON"),
    "too deeply nested": (b"[" * 200_000, "not valid JSON"),
    "json array": (b"[1, 2, 3]", "must be a JSON object"),
    "json string": (b'"pixels"', "must be a JSON object"),
    "missing key": (json.dumps({"pixel": _ZEROS}).encode(), "'pixels'"),
    "both keys": (json.dumps({"pixels": _ZEROS, "instances": [_ZEROS]}).encode(), "exactly one"),
    "pixels not a list": (json.dumps({"pixels": "0" * PIXELS}).encode(), "found a string"),
    "pixels an object": (json.dumps({"pixels": {"a": 1}}).encode(), "found an object"),
    "string pixel": (_with(3, '"7"'), "pixels[3] must be a number, found a string"),
    "boolean pixel": (_with(4, "true"), "pixels[4] must be a number, found a boolean"),
    "null pixel": (_with(5, "null"), "pixels[5] must be a number, found null"),
    "nested pixel": (_with(6, "[1]"), "pixels[6] must be a number, found an array"),
    "too short": (json.dumps({"pixels": _ZEROS[:63]}).encode(), "expected 64 numbers, found 63"),
    "too long": (json.dumps({"pixels": [*_ZEROS, 0.0]}).encode(), "expected 64 numbers, found 65"),
    "NaN": (_with(0, "NaN"), "NaN"),
    "Infinity": (_with(1, "Infinity"), "Infinity"),
    "-Infinity": (_with(2, "-Infinity"), "-Infinity"),
    "overflowing float": (_with(7, "1e999"), "pixels[7] must be a finite number"),
    "huge int": (_with(8, "1" + "0" * 400), "pixels[8]"),
    "above max": (_with(9, "16.5"), "pixels[9] = 16.5 is outside [0.0, 16.0]"),
    "below min": (_with(10, "-1"), "pixels[10] = -1 is outside [0.0, 16.0]"),
    "instances empty": (b'{"instances": []}', "instances is empty"),
    "instances not a list": (b'{"instances": 3}', "instances must be an array"),
    "instance too short": (
        json.dumps({"instances": [_ZEROS, _ZEROS[:10]]}).encode(),
        "instances[1] has the wrong length: expected 64 numbers, found 10",
    ),
    "instance bad value": (
        json.dumps({"instances": [_ZEROS, [*_ZEROS[:-1], 99]]}).encode(),
        "instances[1][63] = 99 is outside",
    ),
    "too many instances": (
        ('{"instances": [' + ",".join(["[" + ",".join("0" * PIXELS) + "]"] * 1025) + "]}").encode(),
        "1025 inputs, over the limit of 1024",
    ),
}


@pytest.mark.ray
@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_input_is_400_with_message(http, name):
    body, message = BAD_BODIES[name]
    response = http.post("/predict", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]


@pytest.mark.ray
def test_oversized_body_by_content_length_is_413(http):
    body = b'{"pixels": [' + b" " * MAX_BODY + b"]}"
    response = http.post("/predict", content=body)
    assert response.status_code == 413
    assert f"limit of {MAX_BODY} bytes" in response.json()["error"]


@pytest.mark.ray
def test_oversized_streamed_body_is_413(http):
    def chunks():  # no Content-Length: sent chunked, counted as it arrives
        yield b'{"pixels": ['
        for _ in range(20):
            yield b" " * 64_000

    response = http.post("/predict", content=chunks())
    assert response.status_code == 413
    assert f"limit of {MAX_BODY} bytes" in response.json()["error"]


@pytest.mark.ray
def test_unknown_route_and_method_are_json_errors(http):
    assert http.get("/nope").json() == {"error": "Not Found"}
    response = http.get("/predict")
    assert response.status_code == 405
    assert "error" in response.json()


@pytest.mark.ray
def test_still_serving_after_bad_requests(http, model):
    module, _ = model
    row = _pixels(seed=4, n=1)[0]
    response = http.post("/predict", json={"pixels": row})
    assert response.status_code == 200
    assert response.json()["digit"] == _local_digits(module, [row])[0]


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
_near_valid = st.fixed_dictionaries(
    {"pixels": st.lists(st.floats() | st.integers(-5, 30), min_size=62, max_size=66)}
) | st.fixed_dictionaries(
    {"instances": st.lists(st.lists(st.integers(-1, 17), min_size=63, max_size=65), max_size=3)}
)


@pytest.mark.ray
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.binary(max_size=200) | (_json_values | _near_valid).map(lambda v: json.dumps(v)))
def test_fuzzed_bodies_never_5xx(http, body):
    content = body.encode() if isinstance(body, str) else body
    response = http.post("/predict", content=content)
    assert response.status_code < 500, response.text
    assert response.status_code == 200 or "error" in response.json()


# --------------------------------------------------------------------------- deployment


def test_missing_checkpoint_raises_before_deploying(tmp_path):
    # No Ray needed: the checkpoint is checked before Serve is touched.
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        serve_model(str(tmp_path / "nothing"), allowed=ALLOWED, port=free_port(), app_name="never")


@pytest.mark.parametrize("port", [0, 65536, -1])
def test_bad_port_is_refused(model, port):
    with pytest.raises(ServingError, match="port must be"):
        serve_model(model[1], allowed=ALLOWED, port=port)


@pytest.mark.ray
def test_missing_checkpoint_leaves_serve_untouched(endpoint, tmp_path):
    from ray import serve

    with pytest.raises(CheckpointError):
        serve_model(str(tmp_path / "nothing"), allowed=ALLOWED, port=free_port(), app_name="never")
    assert "never" not in serve.status().applications


@pytest.mark.ray
def test_serve_on_another_port_is_an_error(endpoint, model, port):
    with pytest.raises(ServingError, match=f"already running .* 127.0.0.1:{port}"):
        serve_model(
            model[1],
            allowed=ALLOWED,
            port=free_port(),
            app_name="elsewhere",
            token_env=UNSET_TOKEN_ENV,
        )


@pytest.mark.ray
def test_bearer_token_guards_every_route(endpoint, model, port, monkeypatch):
    from ray import serve

    token = "test-token-5f1d0c2b9e8a"
    monkeypatch.setenv(TOKEN_ENV, token)
    url = serve_model(
        model[1],
        allowed=ALLOWED,
        port=port,
        app_name=SECURE_APP,
        route_prefix="/secure",
        token_env=TOKEN_ENV,
    )
    assert url == f"http://127.0.0.1:{port}/secure"
    good = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, timeout=30.0, trust_env=False) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
            for method, path in (("GET", "/healthz"), ("GET", "/model"), ("POST", "/predict")):
                response = client.request(method, path, headers=headers, json={"pixels": _ZEROS})
                assert response.status_code == 401, (headers, path)
                assert "token is required" in response.json()["error"]
        assert client.get("/healthz", headers=good).status_code == 200
        info = client.get("/model", headers=good)
        assert info.status_code == 200
        assert token not in info.text
        predicted = client.post("/predict", headers=good, json={"pixels": _ZEROS})
        assert predicted.status_code == 200
    assert token not in repr(serve.status())
    shutdown_serving(SECURE_APP)


# --------------------------------------------------------------------------- token file, fuzzing

_PATHS = (("GET", "/healthz"), ("GET", "/model"), ("POST", "/predict"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("secret") / "token"
    path.write_text(f"{FILE_TOKEN}\n")
    return str(path)


@pytest.fixture(scope="module")
def file_token_http(endpoint, model, port, token_file):
    """A second app with its token from a file, without server-side batching."""
    url = serve_model(
        model[1],
        allowed=ALLOWED,
        port=port,
        app_name=FILE_TOKEN_APP,
        route_prefix="/filetoken",
        token_env=UNSET_TOKEN_ENV,
        token_file=token_file,
        batching=False,
    )
    with httpx.Client(base_url=url, timeout=30.0, trust_env=False) as client:
        yield client


@pytest.mark.parametrize(("content", "match"), [("", "set but empty"), (None, "cannot read")])
def test_bad_token_file_is_refused_without_deploying(model, tmp_path, content, match):
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ServingError, match=match):
        serve_model(
            model[1], allowed=ALLOWED, port=free_port(), app_name="never", token_file=str(path)
        )


@pytest.mark.ray
def test_token_file_guards_and_unbatched_answers_match(file_token_http, model):
    module, _ = model
    good = {"Authorization": f"Bearer {FILE_TOKEN}"}
    assert file_token_http.get("/healthz").status_code == 401
    rows = _pixels(seed=5, n=4)
    digits = [
        file_token_http.post("/predict", headers=good, json={"pixels": row}).json()["digit"]
        for row in rows
    ]
    assert digits == _local_digits(module, rows)


_header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)


@pytest.mark.ray
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scheme=st.sampled_from(["Bearer", "bearer", "Basic", "Token", ""]),
    token=_header_text,
    path=st.sampled_from(_PATHS),
    omit=st.booleans(),
)
def test_fuzzed_tokens_are_401(file_token_http, scheme, token, path, omit):
    if scheme.lower() == "bearer" and token.strip() == FILE_TOKEN:
        return
    value = f"{scheme} {token}".strip()  # h11 refuses edge whitespace before it is sent
    headers = {} if omit or not value else {"Authorization": value}
    response = file_token_http.request(*path, headers=headers, json={"pixels": _ZEROS})
    assert response.status_code == 401, response.text
    assert "token is required" in response.json()["error"]


def _numbers(n: int) -> str:
    return "[" + ",".join(["1"] * n) + "]"


_huge = st.one_of(
    st.integers(65, 700_000).map(lambda n: '{"pixels": ' + _numbers(n) + "}"),
    st.integers(1, 3).map(lambda d: '{"pixels": ' + "[" * d + _numbers(64) + "]" * d + "}"),
    st.tuples(st.integers(1025, 4000), st.integers(1, 64)).map(
        lambda t: '{"instances": [' + ",".join([_numbers(t[1])] * t[0]) + "]}"
    ),
)


@pytest.mark.ray
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_huge | (_json_values | _near_valid).map(lambda v: json.dumps(v)))
def test_fuzzed_bodies_with_a_valid_token_are_4xx_with_a_message(file_token_http, body):
    good = {"Authorization": f"Bearer {FILE_TOKEN}"}
    response = file_token_http.post("/predict", content=body.encode(), headers=good)
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        assert 400 <= response.status_code < 500
        assert response.json()["error"]
    if len(body) > MAX_BODY:
        assert response.status_code == 413


@pytest.mark.ray
def test_still_serving_after_fuzzing_and_token_never_logged(http, file_token_http, model):
    module, _ = model
    row = _pixels(seed=6, n=1)[0]
    good = {"Authorization": f"Bearer {FILE_TOKEN}"}
    for client, headers in ((http, {}), (file_token_http, good)):
        response = client.post("/predict", headers=headers, json={"pixels": row})
        assert response.status_code == 200, response.text
        assert response.json()["digit"] == _local_digits(module, [row])[0]
    import ray

    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    for directory, _, files in os.walk(logs):
        for name in files:
            with open(os.path.join(directory, name), "rb") as f:
                assert FILE_TOKEN.encode() not in f.read(), name


# --------------------------------------------------------------------------- tabular models
# No input_schema on the module: the request and the answer come from the data schema the
# checkpoint records (meta["data_schema"]), as every checkpoint trained by ringflow does.

HOUSES = TableSchema(
    features=(
        Column(name="rooms", dtype="int", min=1, max=12),
        Column(name="area", dtype="float", min=10.0, max=500.0),
        Column(name="age", dtype="float", min=0.0),
    ),
    label=Column(name="price", dtype="float"),
    task="regression",
)
IRISES = TableSchema(
    features=(
        Column(name="petal", dtype="float", min=0.0, max=10.0),
        Column(name="color", dtype="category", categories=("red", "green", "blue")),
        Column(name="width", dtype="float"),
    ),
    label=Column(
        name="species", dtype="category", categories=("setosa", "versicolor", "virginica")
    ),
)
SPECIES = IRISES.label.categories
COLORS = IRISES.features[1].categories


def _save_tabular(root, name: str, module: torch.nn.Module, schema: TableSchema | None) -> str:
    meta = {} if schema is None else {"data_schema": schema.to_json()}
    return save_model(str(root / name), module, hparams=dict(module.hparams), meta=meta)


def _iris_row(petal: float, color: str, width: float) -> list[float]:
    return [petal, float(COLORS.index(color)), width]


@pytest.fixture(scope="module")
def regressor(tmp_path_factory) -> tuple[torch.nn.Module, str]:
    torch.manual_seed(1)
    module = TabularMLP(input_dim=3, hidden=8, depth=1).eval()
    return module, _save_tabular(tmp_path_factory.mktemp("houses"), "model", module, HOUSES)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> tuple[torch.nn.Module, str]:
    torch.manual_seed(2)
    module = TabularMLP(input_dim=3, num_classes=3, hidden=8, depth=1).eval()
    return module, _save_tabular(tmp_path_factory.mktemp("irises"), "model", module, IRISES)


def _app(uri: str, port: int, app_name: str, prefix: str):
    url = serve_model(
        uri,
        allowed=ALLOWED,
        port=port,
        app_name=app_name,
        route_prefix=prefix,
        token_env=UNSET_TOKEN_ENV,
    )
    with httpx.Client(base_url=url, timeout=30.0, trust_env=False) as client:
        yield client
    shutdown_serving(app_name)


@pytest.fixture(scope="module")
def houses_http(endpoint, regressor, port):
    yield from _app(regressor[1], port, REGRESSION_APP, "/houses")


@pytest.fixture(scope="module")
def irises_http(endpoint, classifier, port):
    yield from _app(classifier[1], port, CLASSIFICATION_APP, "/irises")


@pytest.mark.ray
def test_regression_answers_value_for_named_and_array_instances(houses_http, regressor):
    module, uri = regressor
    rows = [[3.0, 120.5, 12.0], [1.0, 10.0, 0.0], [12.0, 500.0, 80.5]]
    with torch.inference_mode():
        expected = module(torch.tensor(rows)).tolist()

    single = houses_http.post("/predict", json={"rooms": 3, "area": 120.5, "age": 12})
    assert single.status_code == 200, single.text
    assert set(single.json()) == {"value", "model"}
    assert math.isclose(single.json()["value"], expected[0], rel_tol=1e-5, abs_tol=1e-6)
    assert single.json()["model"]["uri"] == uri

    instances = [
        {"age": 12.0, "rooms": 3, "area": 120.5},  # any key order
        [1, 10, 0],  # schema order
        {"rooms": 12, "area": 500, "age": 80.5},
    ]
    batch = houses_http.post("/predict", json={"instances": instances})
    assert batch.status_code == 200, batch.text
    predictions = batch.json()["predictions"]
    assert all(set(p) == {"value"} for p in predictions)
    for got, want in zip([p["value"] for p in predictions], expected, strict=True):
        assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.ray
def test_classification_answers_category_label_with_probabilities(irises_http, classifier):
    module, _ = classifier
    inputs = [(1.5, "green", 0.3), (9.0, "red", -2.0), (0.0, "blue", 7.5)]
    with torch.inference_mode():
        scores = module(torch.tensor([_iris_row(*i) for i in inputs]))
    expected = [SPECIES[i] for i in scores.argmax(dim=1).tolist()]

    answers = []
    for petal, color, width in inputs:
        response = irises_http.post(
            "/predict", json={"petal": petal, "color": color, "width": width}
        )
        assert response.status_code == 200, response.text
        answers.append(response.json())
    batch = irises_http.post("/predict", json={"instances": [list(i) for i in inputs]})
    assert batch.status_code == 200, batch.text
    for answer in [*answers, *batch.json()["predictions"]]:
        assert answer["label"] in SPECIES
        assert len(answer["probabilities"]) == 3
        assert math.isclose(sum(answer["probabilities"]), 1.0, rel_tol=1e-5)
    assert [a["label"] for a in answers] == expected
    assert [p["label"] for p in batch.json()["predictions"]] == expected
    assert answers[0]["probabilities"] == pytest.approx(
        torch.softmax(scores[0], dim=0).tolist(), rel=1e-5
    )


@pytest.mark.ray
def test_tabular_model_describes_input_and_output(houses_http, irises_http):
    houses = houses_http.get("/model").json()
    assert houses["input"]["kind"] == "table"
    assert houses["input"]["features"] == [
        {"name": "rooms", "type": "int", "min": 1.0, "max": 12.0},
        {"name": "area", "type": "float", "min": 10.0, "max": 500.0},
        {"name": "age", "type": "float", "min": 0.0, "max": None},
    ]
    assert houses["input"]["example"] == {"rooms": 1, "area": 10.0, "age": 0.0}
    assert houses["output"] == "value"
    assert houses["answer"] == {"task": "regression", "keys": ["value"], "label_column": "price"}
    assert houses["meta"]["data_schema"] == HOUSES.to_json()

    irises = irises_http.get("/model").json()
    assert irises["input"]["features"][1] == {
        "name": "color",
        "type": "category",
        "categories": ["red", "green", "blue"],
    }
    assert irises["output"] == "label"
    assert irises["answer"] == {
        "task": "classification",
        "keys": ["label", "probabilities"],
        "classes": 3,
        "label_column": "species",
        "categories": list(SPECIES),
    }
    # The advertised example is a valid request.
    example = irises_http.post("/predict", json=irises["input"]["example"])
    assert example.status_code == 200, example.text


_IRIS = {"petal": 1.0, "color": "red", "width": 0.5}

TABULAR_BAD = {
    "missing feature": ({"petal": 1.0, "color": "red"}, "missing the feature(s) ['width']"),
    "unknown feature": ({**_IRIS, "colour": "red"}, "unknown feature(s) ['colour']"),
    "missing and unknown": (
        {"petal": 1.0, "colour": "red", "width": 0.5},
        "missing the feature(s) ['color']",
    ),
    "unknown category": (
        {**_IRIS, "color": "purple"},
        "color: unknown category 'purple' for column color; allowed: ['red', 'green', 'blue']",
    ),
    "category as a number": ({**_IRIS, "color": 1}, "color must be one of the categories"),
    "above max": ({**_IRIS, "petal": 10.5}, "petal = 10.5 is outside [0.0, 10.0]"),
    "feature not a number": ({**_IRIS, "width": "wide"}, "width must be a number, found a string"),
    "non-finite feature": (
        '{"petal": 1, "color": "red", "width": 1e999}',
        "width must be a finite number",
    ),
    "empty object": ({}, "missing the feature(s) ['petal', 'color', 'width']"),
    "instances and features": ({"instances": [_IRIS], **_IRIS}, "not both"),
    "instance missing feature": (
        {"instances": [_IRIS, {"petal": 1.0, "width": 0.5}]},
        "instances[1] is missing the feature(s) ['color']",
    ),
    "instance unknown category": (
        {"instances": [[1.0, "red", 0.5], [1.0, "teal", 0.5]]},
        "instances[1][1] (color): unknown category 'teal' for column color; allowed:",
    ),
    "instance wrong length": (
        {"instances": [[1.0, "red"]]},
        "instances[0] has the wrong length: expected 3 values in the order "
        "['petal', 'color', 'width'], found 2",
    ),
    "instance not a row": ({"instances": [3]}, "instances[0] must be an object of features"),
    "pixels to a table model": ({"pixels": [0.0] * 3}, "unknown feature(s) ['pixels']"),
}


@pytest.mark.ray
@pytest.mark.parametrize("name", list(TABULAR_BAD))
def test_tabular_bad_request_is_400_naming_the_problem(irises_http, name):
    body, message = TABULAR_BAD[name]
    content = body if isinstance(body, str) else json.dumps(body)
    response = irises_http.post("/predict", content=content.encode())
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]


@pytest.mark.ray
@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"rooms": 2.5, "area": 50, "age": 1}, "rooms must be an integer"),
        ({"rooms": 0, "area": 50, "age": 1}, "rooms = 0 is outside [1.0, 12.0]"),
        ({"rooms": 2, "area": 50, "age": -1}, "age = -1 is outside [0.0, None]"),
        ({"rooms": 2, "area": 50, "age": 1e39}, "too large for an 'float' column"),
    ],
)
def test_tabular_numeric_bounds_are_checked(houses_http, body, message):
    response = houses_http.post("/predict", json=body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]


_near_iris = st.fixed_dictionaries(
    {},
    optional={
        "petal": st.floats() | st.integers(-3, 12) | st.text(max_size=3),
        "color": st.sampled_from([*COLORS, "RED", ""]) | st.integers(0, 3),
        "width": st.floats() | st.none(),
        "instances": st.lists(
            st.lists(st.sampled_from([0.5, "red", "x", None]), max_size=4), max_size=3
        ),
        "colour": st.just("red"),
    },
)


@pytest.mark.ray
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=(_json_values | _near_iris).map(lambda v: json.dumps(v)))
def test_fuzzed_tabular_bodies_never_5xx(irises_http, body):
    response = irises_http.post("/predict", content=body.encode())
    assert response.status_code < 500, response.text
    assert response.status_code == 200 or response.json()["error"]


@pytest.mark.ray
def test_digits_still_served_beside_tabular_apps(http, model, irises_http):
    module, _ = model
    row = _pixels(seed=7, n=1)[0]
    response = http.post("/predict", json={"pixels": row})
    assert response.status_code == 200, response.text
    assert set(response.json()) == {"digit", "probabilities", "model"}
    assert response.json()["digit"] == _local_digits(module, [row])[0]


# Deploy-time refusals and the swap rule: checked before Serve is touched, so no Ray.


def test_checkpoint_without_any_schema_is_refused_at_deploy(tmp_path):
    module = TabularMLP(input_dim=3, hidden=4, depth=1)
    uri = _save_tabular(tmp_path, "bare", module, None)
    with pytest.raises(ServingError) as err:
        serve_model(
            uri, allowed=ALLOWED, port=free_port(), app_name="never", token_env=UNSET_TOKEN_ENV
        )
    message = str(err.value)
    assert "\n" not in message
    assert "no data schema" in message
    assert "train it through ringflow" in message
    assert "input_schema" in message


@pytest.mark.parametrize(
    ("module", "schema", "match"),
    [
        (TabularMLP(input_dim=3, num_classes=2, hidden=4), IRISES, "expected \\[1, 3\\]"),
        (TabularMLP(input_dim=4, num_classes=3, hidden=4), IRISES, "self-check"),
        (TabularMLP(input_dim=3, num_classes=3, hidden=4), HOUSES, "expected \\[1\\] or"),
    ],
    ids=["too few classes", "wrong input width", "classifier on a regression"],
)
def test_model_that_does_not_fit_its_data_schema_is_refused(tmp_path, module, schema, match):
    uri = _save_tabular(tmp_path, "misfit", module, schema)
    with pytest.raises(ServingError, match=match):
        serve_model(
            uri, allowed=ALLOWED, port=free_port(), app_name="never", token_env=UNSET_TOKEN_ENV
        )


def test_malformed_data_schema_is_refused(tmp_path):
    module = TabularMLP(input_dim=3, hidden=4, depth=1)
    uri = save_model(
        str(tmp_path / "m"), module, hparams=dict(module.hparams), meta={"data_schema": {}}
    )
    with pytest.raises(ServingError, match="meta\\['data_schema'\\] is not a data schema"):
        serve_model(
            uri, allowed=ALLOWED, port=free_port(), app_name="never", token_env=UNSET_TOKEN_ENV
        )


def test_digits_with_recorded_schema_keeps_pixels_and_digit(tmp_path):
    torch.manual_seed(3)
    module = DigitsClassifier(hidden=8).eval()
    uri = save_model(
        str(tmp_path / "digits"),
        module,
        hparams=dict(module.hparams),
        meta={"data_schema": DIGITS_SCHEMA.to_json()},
    )
    served = _load_served(uri, ALLOWED)
    assert served.info["input"]["name"] == "pixels"
    assert served.info["output"] == "digit"
    rows = _pixels(seed=8, n=3)
    answers = _forward(served, served.spec.parse({"instances": rows})[0])
    assert [a["digit"] for a in answers] == _local_digits(module, rows)
    assert all(set(a) == {"digit", "probabilities"} for a in answers)


def test_swap_compares_the_derived_input_and_answer(tmp_path):
    def load(name, module, schema):
        return _load_served(_save_tabular(tmp_path, name, module, schema), ALLOWED)

    serving = load("v1", TabularMLP(input_dim=3, num_classes=3, hidden=4), IRISES)
    retrained = load("v2", TabularMLP(input_dim=3, num_classes=3, hidden=16, depth=3), IRISES)
    _check_compatible(serving, retrained, "v2")  # same data, other weights and width: fine

    recolored = TableSchema(
        features=(
            IRISES.features[0],
            Column(name="color", dtype="category", categories=("blue", "green", "red")),
            IRISES.features[2],
        ),
        label=IRISES.label,
    )
    renamed = TableSchema(
        features=(*IRISES.features[:2], Column(name="height", dtype="float")), label=IRISES.label
    )
    regression = TableSchema(features=IRISES.features, label=HOUSES.label, task="regression")
    for version, schema, num_classes, match in (
        ("v3", recolored, 3, "v3 takes features .*color \\(category: blue\\|green\\|red\\)"),
        ("v4", renamed, 3, "v4 takes features .*height"),
        (
            "v5",
            regression,
            None,
            "v5 answers with 'value' \\(regression\\), the served model with 'label'",
        ),
    ):
        candidate = load(version, TabularMLP(input_dim=3, num_classes=num_classes), schema)
        with pytest.raises(ServingError, match=match):
            _check_compatible(serving, candidate, version)

    digits = _load_served(save_model(str(tmp_path / "d"), DigitsClassifier(), hparams={}), ALLOWED)
    with pytest.raises(ServingError, match="takes 'pixels' of shape \\[64\\]"):
        _check_compatible(serving, digits, "v6")


class _Doubler(TabularMLP):
    """A module with its own predict_step: the answer is its output, under ``prediction``."""

    def predict_step(self, batch: torch.Tensor, batch_idx: int = 0) -> dict[str, torch.Tensor]:
        out = self(batch)
        return {"raw": out, "twice": 2 * out, "rank": out.argsort(dim=-1)}


def test_predict_step_output_is_the_prediction(tmp_path):
    torch.manual_seed(4)
    module = _Doubler(input_dim=3, num_classes=3, hidden=4).eval()
    served = _load_served(_save_tabular(tmp_path, "step", module, IRISES), ALLOWED)
    assert served.info["output"] == "prediction"
    rows, single = served.spec.parse({"petal": 1.0, "color": "blue", "width": 2.0})
    assert single
    (answer,) = _forward(served, rows)
    with torch.inference_mode():
        raw = module(torch.tensor([_iris_row(1.0, "blue", 2.0)]))[0]
    assert set(answer) == {"prediction"}
    assert answer["prediction"]["raw"] == pytest.approx(raw.tolist())
    assert answer["prediction"]["twice"] == pytest.approx((2 * raw).tolist())
    assert answer["prediction"]["rank"] == raw.argsort().tolist()
