"""Storage never chooses which code runs, and secrets stay in the process that reads them.

A checkpoint's manifest names its model class; a writer of the bucket can edit it. Every
loader (``load_model``, the evaluate task, the promotion gate; the Serve replica in
tests/test_hot_swap.py) takes the classes it trusts from its own configuration and refuses
another before importing anything: ``tests.support.planted`` leaves a mark in any process
that imports it, and none may appear. The serving token reaches no Ray process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ringflow.models.digits import DigitsClassifier
from ringflow.storage.checkpoint import (
    ModelClassRefused,
    load_model,
    read_checkpoint,
    save_model,
)
from ringflow.storage.fs import join
from tests.support.trust import PLANTED, clear_marks, marks, name_planted_class

DIGITS = "ringflow.models.digits:DigitsClassifier"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def no_marks():
    clear_marks()
    yield
    assert marks() == [], "a process imported the class a manifest named"
    assert "tests.support.planted" not in sys.modules


def _checkpoint(path: str, *, hidden: int = 8, seed: int = 0) -> str:
    torch.manual_seed(seed)
    return save_model(path, DigitsClassifier(hidden=hidden), hparams={"hidden": hidden})


def test_load_model_refuses_a_class_it_was_not_given_naming_both(tmp_path, no_marks):
    uri = _checkpoint(str(tmp_path / "model"))
    name_planted_class(uri)
    with pytest.raises(ModelClassRefused) as refused:
        load_model(uri, allowed=DIGITS)
    message = str(refused.value)
    assert "\n" not in message
    for named in (PLANTED, DIGITS, uri):
        assert named in message, message


def test_load_model_takes_the_class_by_its_own_path_a_re_export_or_itself(tmp_path):
    uri = _checkpoint(str(tmp_path / "model"), seed=3)
    saved = read_checkpoint(uri).state_dict
    for allowed in (DIGITS, "ringflow.models:DigitsClassifier", DigitsClassifier, [DIGITS]):
        module, ckpt = load_model(uri, allowed=allowed)
        assert type(module) is DigitsClassifier
        assert ckpt.module == DIGITS
        for name, tensor in saved.items():
            assert torch.equal(module.state_dict()[name], tensor), name


def test_the_evaluate_task_refuses_a_checkpoint_naming_another_class(digits, tmp_path, no_marks):
    from ringflow.tasks.train import evaluate

    uri = _checkpoint(str(tmp_path / "model"))
    name_planted_class(uri)
    with pytest.raises(ModelClassRefused, match="tests.support.planted:Planted"):
        evaluate.fn(uri, digits.dataset_url, model=DIGITS)


def test_the_gate_keeps_production_when_its_manifest_names_another_class(
    digits, tmp_path, no_marks
):
    from ringflow.tasks import registry as registry_tasks
    from tests.test_registry import _corrupt_training_labels

    storage = str(tmp_path / "storage")
    registry = registry_tasks.model_registry(storage, "digits")

    def register(checkpoint: str, dataset_url: str, run_key: str) -> str:
        return registry_tasks.register.fn(
            checkpoint,
            storage,
            metrics={"test_accuracy": 0.5},
            dataset_url=dataset_url,
            run_key=run_key,
            model="digits",
        )["version"]

    first = register(_checkpoint(str(tmp_path / "a")), digits.dataset_url, "a")
    assert registry_tasks.promote.fn(first, storage, model="digits", allowed=[DIGITS])["promoted"]
    name_planted_class(registry.get(first).uri)
    other_data = _corrupt_training_labels(digits.dataset_url, str(tmp_path / "other"))
    candidate = register(_checkpoint(str(tmp_path / "b"), seed=1), other_data, "b")

    decision = registry_tasks.promote.fn(candidate, storage, model="digits", allowed=[DIGITS])

    assert not decision["promoted"], decision
    assert decision["basis"] == "refused"
    assert PLANTED in decision["reason"]
    assert f"kept {first}" in decision["reason"]
    assert registry.production().version == first


def test_a_refused_class_in_allowed_models_fails_the_run_before_it_starts():
    done = subprocess.run(
        [sys.executable, "-m", "ringflow.flows.train_pipeline"]
        + ["--allowed-models", "nowhere_at_all.models:Gone", "--no-serve"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "RINGFLOW_DEBUG": "0"},
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: "), line
    assert "nowhere_at_all" in line, line


_NO_TOKEN_IN_RAY = textwrap.dedent(
    """
    import json, os, sys
    import psutil
    from ringflow.engine import DataSpec, TrainConfig, fit
    from ringflow.engine.cluster import connect
    from ringflow.serving import serve_model
    from ringflow.models.digits import SCHEMA, DigitsClassifier

    token = os.environ["RINGFLOW_SERVE_TOKEN"]
    connect(num_cpus=2)

    def ray_processes():
        found = {}
        for proc in psutil.Process().children(recursive=True):
            try:
                with open(f"/proc/{proc.pid}/environ", "rb") as f:
                    found[proc.pid] = (" ".join(proc.cmdline()), f.read())
            except (psutil.Error, OSError):
                pass
        return found

    seen = {}
    def look(_epoch):
        seen.update(ray_processes())
    result = fit(
        DigitsClassifier,
        hparams={"hidden": 8},
        data=DataSpec(dataset_url=sys.argv[1], schema=SCHEMA),
        config=TrainConfig(workers=2, epochs=1, batch_size=256, seed=0),
        checkpoint_uri=sys.argv[2],
        on_epoch=look,
    )
    import httpx
    url = serve_model(result.checkpoint, allowed=DigitsClassifier, port=int(sys.argv[3]))
    seen.update(ray_processes())
    asked = {
        "without": httpx.get(f"{url}/model", trust_env=False).status_code,
        "with": httpx.get(f"{url}/model", headers={"Authorization": f"Bearer {token}"},
                          trust_env=False).status_code,
    }
    print(json.dumps({
        "asked": asked,
        "workers": sum("ray::Worker" in cmd for cmd, _ in seen.values()),
        "replicas": sum("ServeReplica" in cmd for cmd, _ in seen.values()),
        "holding": sorted(cmd[:80] for cmd, env in seen.values() if token.encode() in env),
    }))
    """
)


@pytest.mark.ray
def test_no_ray_process_of_a_local_run_holds_the_serving_token(digits, tmp_path):
    from tests.support.net import free_port

    token = "canary-" + os.urandom(16).hex()
    done = subprocess.run(
        [sys.executable, "-c", _NO_TOKEN_IN_RAY, digits.dataset_url]
        + [join(str(tmp_path), "model"), str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={
            **{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
            "RINGFLOW_SERVE_TOKEN": token,
        },
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["workers"] >= 2, seen  # both kinds of process were looked at
    assert seen["replicas"] >= 1, seen
    assert seen["holding"] == [], seen
    assert seen["asked"] == {"without": 401, "with": 200}  # the replica checks a digest
