"""Hot swap: the Serve app follows the registry's production pointer, under load.

One Serve application (its own name and route prefix; Serve itself only started, and shut
down, when no other module already runs it) serves ``{storage}/registry/digits``. The tests
run in file order and tell one story: v1 (weak) serves; v2 (better) is promoted while a
second process loads the server, with zero failed requests; v3 (shuffled training labels)
is refused by the gate and v2 keeps answering; a damaged v4 forced into production is
skipped by the replica, and so is a v5 whose manifest names another class (never imported);
the rollback command goes back to v2 and then v1; the next flow run's serve step, under load,
finds the app it would deploy already running and waits for it to follow the pointer instead
of redeploying it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from ringflow.engine import DataSpec
from ringflow.engine import evaluate as evaluate_model
from ringflow.serving import serve_registry, shutdown_serving
from ringflow.storage.fs import join
from ringflow.storage.registry import ModelRegistry
from ringflow.tasks import registry as registry_tasks
from tests.support.net import free_port
from tests.support.trust import clear_marks, marks, name_planted_class
from tests.test_registry import _corrupt_training_labels, _train

APP = "ringflow-hot-swap"
DIGITS = "ringflow.models.digits:DigitsClassifier"
PREFIX = "/hot"
UNSET_TOKEN_ENV = "RINGFLOW_TEST_HOT_SWAP_TOKEN_NEVER_SET"
POLL_S = 0.5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def storage(tmp_path_factory, digits) -> str:
    """Pipeline storage whose registry has v1 in production: a deliberately weak model."""
    storage = str(tmp_path_factory.mktemp("hot-swap"))
    weak = _train(digits, join(storage, "runs", "weak"), epochs=1, hidden=4)
    _register_and_gate(storage, weak, digits, run_key="weak")
    return storage


@pytest.fixture(scope="module")
def registry(storage) -> ModelRegistry:
    return registry_tasks.model_registry(storage, "digits")


@pytest.fixture(scope="module")
def endpoint(ray_session, storage):
    from ray import serve
    from ray.serve.context import _get_global_client

    running = _get_global_client(raise_if_no_controller_running=False)
    port = running.http_config.port if running is not None else free_port()
    url = _serve_step(storage, port)
    yield url
    shutdown_serving(APP)
    if running is None:
        serve.shutdown()  # only the Serve this module started


def _serve_step(storage: str, port: int) -> str:
    """What the pipeline's serve step calls, with this module's app name and route."""
    return serve_registry(
        join(storage, "registry"),
        "digits",
        allowed=DIGITS,
        port=port,
        app_name=APP,
        route_prefix=PREFIX,
        poll_s=POLL_S,
        token_env=UNSET_TOKEN_ENV,
    )


def _deployed_at() -> float:
    """When Serve last deployed the app: a redeploy changes it."""
    from ray import serve

    return serve.status().applications[APP].last_deployed_time_s


def _start_load(endpoint: str, seconds: int) -> subprocess.Popen:
    load = subprocess.Popen(
        [sys.executable, "-m", "bench.serve", "load", "--url", endpoint]
        + ["--duration", str(seconds), "--concurrency", "8"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert "first answer" in load.stderr.readline()  # the load runs on the old version first
    return load


def _load_result(load: subprocess.Popen) -> dict:
    try:
        out, err = load.communicate(timeout=60)
    finally:
        load.kill()
    assert load.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def http(endpoint):
    with httpx.Client(base_url=endpoint, timeout=30.0, trust_env=False) as client:
        yield client


def _register_and_gate(storage: str, checkpoint: str, data: DataSpec, *, run_key: str) -> dict:
    record = registry_tasks.register.fn(
        checkpoint,
        storage,
        metrics=evaluate_model(checkpoint, data, model=DIGITS),
        dataset_url=data.dataset_url,
        run_key=run_key,
        model="digits",
    )
    return registry_tasks.promote.fn(record["version"], storage, model="digits", allowed=[DIGITS])


def _wait_for_version(http: httpx.Client, version: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        info = http.get("/model").json()
        if info["version"] == version or time.monotonic() > deadline:
            return info
        time.sleep(0.2)


def _answers(http: httpx.Client, n: int = 5) -> set[str]:
    versions = set()
    for i in range(n):
        response = http.post("/predict", json={"pixels": [float(i % 17)] * 64})
        assert response.status_code == 200, response.text
        assert response.headers["x-model-version"] == response.json()["model"]["version"]
        versions.add(response.json()["model"]["version"])
    return versions


@pytest.mark.ray
def test_serves_the_production_version(http, registry):
    info = http.get("/model").json()
    v1 = registry.get("v0001")
    assert info["version"] == "v0001"
    assert info["trained_at"] == v1.trained_at
    assert info["metrics"] == v1.metrics
    assert info["uri"] == v1.uri
    assert _answers(http) == {"v0001"}


@pytest.mark.ray
def test_promotion_under_load_fails_no_request(http, endpoint, storage, digits, registry):
    better = _train(digits, join(storage, "runs", "better"), epochs=6, hidden=32)
    load = _start_load(endpoint, 8)
    time.sleep(1.0)
    decision = _register_and_gate(storage, better, digits, run_key="better")
    promoted_at = time.monotonic()
    info = _wait_for_version(http, "v0002")
    switch_s = time.monotonic() - promoted_at
    result = _load_result(load)
    print(
        f"\nload during promotion: {result['requests']} requests, {result['failed_requests']} "
        f"failed, {result['rps']} rps, p50 {result['p50_ms']} ms, p90 {result['p90_ms']} ms, "
        f"p99 {result['p99_ms']} ms, max {result['max_ms']} ms; versions {result['versions']}; "
        f"pointer to /model showing v0002: {switch_s:.2f} s"
    )
    assert decision["promoted"], decision
    assert info["version"] == "v0002"
    assert result["failed_requests"] == 0, result["errors"]
    assert result["requests"] > 50
    assert result["version_order"] == ["v0001", "v0002"], result
    assert result["last_versions"] == ["v0002"], result
    assert info["metrics"]["test_accuracy"] > registry.get("v0001").metrics["test_accuracy"]


@pytest.mark.ray
def test_retrain_on_shuffled_labels_is_refused_and_v2_keeps_serving(
    http, storage, digits, registry, tmp_path
):
    shuffled = DataSpec(
        dataset_url=_corrupt_training_labels(digits.dataset_url, str(tmp_path / "shuffled")),
        schema=digits.schema,
    )
    bad = _train(shuffled, join(storage, "runs", "shuffled"), epochs=6, hidden=32)
    decision = _register_and_gate(storage, bad, shuffled, run_key="shuffled")
    assert not decision["promoted"], decision
    assert decision["candidate"] == "v0003"
    assert decision["candidate_value"] < 0.5 < decision["production_value"]
    time.sleep(4 * POLL_S)
    assert registry.production().version == "v0002"
    assert http.get("/model").json()["version"] == "v0002"
    assert _answers(http) == {"v0002"}


@pytest.mark.ray
def test_damaged_version_in_production_is_skipped_by_the_replica(http, storage, registry):
    record = registry.register(
        registry.get("v0002").uri, metrics={}, data_fingerprint=None, run_key="damaged"
    )
    weights = os.path.join(storage, "registry", "digits", "versions", record.version, "model")
    with open(os.path.join(weights, "model.safetensors"), "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 16)
    registry.promote(record.version, reason="forced by hand, without the gate")
    time.sleep(4 * POLL_S)
    assert http.get("/model").json()["version"] == "v0002"
    assert _answers(http) == {"v0002"}


@pytest.mark.ray
def test_version_naming_another_class_is_skipped_by_the_replica_unimported(http, registry):
    record = registry.register(
        registry.get("v0002").uri, metrics={}, data_fingerprint=None, run_key="planted"
    )
    name_planted_class(record.uri)
    clear_marks()
    registry.promote(record.version, reason="a writer of the bucket")
    time.sleep(4 * POLL_S)
    try:
        assert http.get("/model").json()["version"] == "v0002"
        assert _answers(http) == {"v0002"}
        assert marks() == []  # no process, the replica included, imported the named class
    finally:
        registry.rollback(reason="back to the damaged version, as the next test expects")


@pytest.mark.ray
def test_rollback_command_swaps_back(http, storage):
    command = [
        sys.executable,
        "-m",
        "ringflow.tasks.registry",
        "rollback",
        "--storage-url",
        storage,
    ]
    for expected in ("v0002", "v0001"):
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout.strip().splitlines()[-1])["production"] == expected
        assert _wait_for_version(http, expected)["version"] == expected
        assert _answers(http) == {expected}


@pytest.mark.ray
def test_next_flow_runs_serve_step_follows_in_place_under_load(http, endpoint, storage, registry):
    assert http.get("/model").json()["version"] == "v0001"  # where the rollbacks left it
    deployed_at = _deployed_at()
    load = _start_load(endpoint, 6)
    time.sleep(1.0)
    registry.promote("v0002", reason="the next flow run's gate")
    port = int(endpoint.rsplit(":", 1)[1].split("/", 1)[0])
    assert _serve_step(storage, port) == endpoint
    served = http.get("/model").json()["version"]  # the serve step returned once it swapped
    result = _load_result(load)
    assert served == "v0002"
    assert _deployed_at() == deployed_at  # followed the pointer: no redeploy
    assert result["failed_requests"] == 0, result["errors"]
    assert result["version_order"] == ["v0001", "v0002"], result
