"""Shared fixtures and the suite's layers.

Every test is in one layer, which ``pytest -m`` selects:

- ``unit``: no Ray, no Prefect server (the default for a test that asks for neither);
- ``integration``: uses the session's one private Ray (``ray_session``) or its module's Ray
  cluster (``launcher_ray``), or starts processes of its own (marked ``integration`` by hand);
- ``e2e``: the real stack (Prefect server, Ray head, process worker) that
  ``tests/support/stack.py`` starts once for the run through ``deployments/`` scripts.

Under pytest-xdist (``./tests/run.sh`` passes ``-n``) each test module runs on one worker
in file order (module fixtures and stories stay whole), and every e2e test runs on the
same worker, first, so that one stack serves them all. Every test runs inside
``tests/support/leaks.guard``, which fails the test that leaves a process group, a Ray
instance, a process, a listener beyond 127.0.0.1 or an environment variable behind.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile

import pytest

from ringflow.engine.cluster import LEAN_RAY_ENV
from tests.support import leaks, ray_cluster

# Offline and quiet before anything imports Ray or Prefect, with Ray's token authentication
# as a flow run asks for it (flows/train_pipeline.py), from a token of this test process's
# own: importing the flow module then changes nothing here.
_RAY_TOKEN_DIR = tempfile.mkdtemp(prefix="ringflow-test-ray-")
atexit.register(shutil.rmtree, _RAY_TOKEN_DIR, ignore_errors=True)
with open(os.path.join(_RAY_TOKEN_DIR, "auth_token"), "w") as _token:
    _token.write(secrets.token_hex(32))
for _key, _value in {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "GLOO_SOCKET_IFNAME": "lo",
    "NCCL_NVLS_ENABLE": "0",  # what bench/ sets by default, so a benchmark run here changes none
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN_PATH": os.path.join(_RAY_TOKEN_DIR, "auth_token"),
    **LEAN_RAY_ENV,  # every Ray the tests start, as those ringflow starts: no idle workers
}.items():
    os.environ.setdefault(_key, _value)
# The tests' S3 is moto's (tests/moto_s3.py), which takes any credentials; boto refuses to
# sign without. Never a real account's.
os.environ.update(
    AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1"
)
leaks.mark_owner()

_LAYERS = ("unit", "integration", "e2e")
# Horovod's own tests: each rank of tests/test_horovod_contract.py runs them, not this session.
collect_ignore = ["horovod_contract"]


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Each test's layer; under xdist, its module's group (all e2e tests in one), e2e first.
    A wrapper, so that xdist's own hook, which reads the groups, finds them."""
    for item in items:
        if item.get_closest_marker("e2e") or "stack" in item.fixturenames:
            item.add_marker("e2e")
            group = "e2e"
        else:
            if not any(item.get_closest_marker(layer) for layer in _LAYERS):
                ray = item.get_closest_marker("ray") or {"ray_session", "launcher_ray"} & set(
                    item.fixturenames
                )
                item.add_marker("integration" if ray else "unit")
            group = item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))
        if getattr(config.option, "loadgroup", False) and "@" not in item.nodeid:
            # What xdist 3.8 does with the mark, by an attribute pytest 9 no longer reads
            # (``_nodeid``; pytest 9.2 keeps ``_id``): grouped by ``--dist loadgroup``.
            from _pytest.nodeid import coerce_node_id

            item._id = coerce_node_id(f"{item.nodeid}@{group}")
    items.sort(key=lambda item: item.get_closest_marker("e2e") is None)  # stable: file order kept
    return (yield)


@pytest.fixture(autouse=True)
def _leaves_nothing_behind(request):
    """Fails the test that leaves something behind (tests/support/leaks.py)."""
    with leaks.guard(session_ray=_SESSION_RAY["up"], clusters=ray_cluster.shared_pids()):
        yield


_SESSION_RAY = {"up": False}


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """The bundled digits, preprocessed once per session, as the engine takes them."""
    from ringflow.engine import DataSpec
    from ringflow.models.digits import SCHEMA, write_digits_csv
    from ringflow.storage.dataset import preprocess

    root = str(tmp_path_factory.mktemp("digits"))
    write_digits_csv(f"{root}/raw/digits.csv")
    result = preprocess(f"{root}/raw/digits.csv", root, SCHEMA, seed=0)
    return DataSpec(dataset_url=result.dataset_url, schema=SCHEMA)


@pytest.fixture(scope="session")
def ray_session():
    """A private local Ray instance (never joins another one on the machine)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    _SESSION_RAY["up"] = True
    yield ray
    _SESSION_RAY["up"] = False
    ray.shutdown()


@pytest.fixture(scope="module")
def launcher_ray():
    """One Ray cluster on 127.0.0.1 (2 CPUs) for the launchers a module's tests start
    (``ringflow-run``, ``horovod.run`` in a script, a flow's ranks), each joining it through
    ``RAY_ADDRESS`` as on a user's cluster instead of starting a private Ray: its address.
    Its workers have ``tests/horovod_scripts`` on their path (code a cluster's nodes have
    installed). The leak guard fails a test that leaves one of its actors running."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    scripts = os.path.join(root, "tests", "horovod_scripts")
    with ray_cluster.shared_cluster(num_cpus=2, cwd=root, python_path=(scripts,)) as cluster:
        yield cluster.address


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """The run's one real stack (tests/support/stack.py), started and deployed on first use;
    at the end stop.sh must leave none of its ports listening."""
    import httpx

    from tests.support.stack import Stack

    stack = Stack(tmp_path_factory.mktemp("stack") / "state")
    try:
        stack.script("start.sh")
        stack.script("deploy.sh")
        yield stack
    finally:
        stack.stop()
    env = stack.env
    for port in (
        env["RINGFLOW_PREFECT_PORT"],
        env["RINGFLOW_RAY_PORT"],
        env["RINGFLOW_RAY_DASHBOARD_PORT"],
    ):
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/", timeout=5, trust_env=False)


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """This test process's own Prefect server (tests/support/prefect_server.py), for flows its
    tests run from the command line: ``PREFECT_API_URL`` in their environment."""
    from tests.support.prefect_server import prefect_server

    with prefect_server(tmp_path_factory.mktemp("prefect-home")) as api:
        yield api


@pytest.fixture
def prefect_server(stack):
    """Flows this process runs report to the stack's Prefect server while the test runs."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: stack.api}):
        yield stack
