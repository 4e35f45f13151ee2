"""The model registry and its promotion gate, on file://, memory:// and moto S3.

The gate's real case is at the end: a retrain on training data with shuffled labels is
refused on the clean held-out split, and production stays on the good model.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from ringflow.engine import DataSpec, TrainConfig, fit
from ringflow.models.digits import DigitsClassifier
from ringflow.storage.checkpoint import load_model, save_model
from ringflow.storage.dataset import row_group_entries
from ringflow.storage.fs import sha256
from ringflow.storage.registry import (
    ModelRegistry,
    PointerMovedError,
    RegistryError,
    dataset_fingerprint,
    production_checkpoint,
    promote_if_better,
)
from ringflow.tasks import registry as registry_tasks

DIGITS = "ringflow.models.digits:DigitsClassifier"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[str]:
    """Three small, different checkpoints."""
    root = tmp_path_factory.mktemp("ckpts")
    uris = []
    for seed in range(3):
        torch.manual_seed(seed)
        module = DigitsClassifier(hidden=8)
        uris.append(save_model(str(root / f"m{seed}"), module, hparams={"hidden": 8}))
    return uris


@pytest.fixture(scope="module")
def s3():
    from tests.moto_s3 import s3_endpoint

    with s3_endpoint() as endpoint:
        yield endpoint


@pytest.fixture(params=["file", "memory", "s3"])
def registry(request, tmp_path) -> ModelRegistry:
    if request.param == "file":
        return ModelRegistry(str(tmp_path / "registry"), "digits")
    if request.param == "memory":
        return ModelRegistry(f"memory://registry-{uuid.uuid4().hex}", "digits")
    endpoint = request.getfixturevalue("s3")
    return ModelRegistry(
        endpoint.url(f"registry-{uuid.uuid4().hex}"),
        "digits",
        storage_options=endpoint.storage_options(direct=True),
    )


def _register(registry: ModelRegistry, uri: str, accuracy: float, data: str = "d1", **kw):
    return registry.register(
        uri, metrics={"test_accuracy": accuracy}, data_fingerprint=data, **kw
    ).version


# --------------------------------------------------------------------------- versions


def test_versions_are_numbered_and_hold_what_was_trained(registry, checkpoints):
    first = registry.register(
        checkpoints[0],
        metrics={"test_accuracy": 0.9, "test_loss": float("nan")},
        data_fingerprint="abc",
        dataset_url="file:///data",
        trained_at="2026-01-02T03:04:05+00:00",
        run_key="run-1",
    )
    second = _register(registry, checkpoints[1], 0.8)
    assert (first.version, second) == ("v0001", "v0002")
    got = registry.get("v0001")
    assert got == first
    assert got.metrics == {"test_accuracy": 0.9}  # NaN is dropped, never stored
    assert got.hparams == {"hidden": 8}
    assert got.data_fingerprint == "abc"
    assert got.trained_at == "2026-01-02T03:04:05+00:00"
    assert got.uri == f"{registry.url}/versions/v0001/model"
    assert [v.version for v in registry.versions()] == ["v0001", "v0002"]


def test_registered_checkpoint_loads_back(tmp_path, checkpoints):
    registry = ModelRegistry(str(tmp_path), "digits")
    record = registry.get(_register(registry, checkpoints[2], 0.5))
    module, _ = load_model(record.uri, allowed=DigitsClassifier)
    expected, _ = load_model(checkpoints[2], allowed=DigitsClassifier)
    assert all(torch.equal(module.state_dict()[k], v) for k, v in expected.state_dict().items())


def test_registering_the_same_run_again_is_a_no_op(registry, checkpoints):
    first = _register(registry, checkpoints[0], 0.9, run_key="run-7")
    again = _register(registry, checkpoints[0], 0.9, run_key="run-7")
    other = _register(registry, checkpoints[1], 0.9, run_key="run-7")
    assert (first, again, other) == ("v0001", "v0001", "v0002")


def test_uncommitted_version_is_skipped_and_its_number_never_reused(tmp_path, checkpoints):
    registry = ModelRegistry(str(tmp_path), "digits")
    os.makedirs(tmp_path / "digits" / "versions" / "v0001" / "model")  # a crash mid-register
    assert registry.versions() == []
    assert _register(registry, checkpoints[0], 0.9) == "v0002"
    with pytest.raises(RegistryError, match="no version v0001"):
        registry.get("v0001")


def test_unknown_or_malformed_version_names_are_errors(tmp_path):
    registry = ModelRegistry(str(tmp_path), "digits")
    with pytest.raises(RegistryError, match="no version v0009"):
        registry.get("v0009")
    with pytest.raises(RegistryError, match="named v0001"):
        registry.get("../etc")


@pytest.mark.parametrize("name", ["", "a/b", "../x", ".hidden"])
def test_bad_model_name_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match="model must be"):
        ModelRegistry(str(tmp_path), name)


# --------------------------------------------------------------------------- production pointer


def test_promote_and_rollback_walk_the_history(registry, checkpoints):
    versions = [_register(registry, uri, 0.9) for uri in checkpoints]
    assert registry.production() is None
    for version in versions:
        registry.promote(version, reason=f"ship {version}")
    pointer = registry.production()
    assert (pointer.version, pointer.sequence, pointer.previous) == ("v0003", 3, ("v0001", "v0002"))
    assert registry.rollback().version == "v0002"
    assert registry.rollback(reason="again").version == "v0001"
    with pytest.raises(RegistryError, match="no earlier one"):
        registry.rollback()
    history = registry.production().history
    assert [(e["action"], e["version"]) for e in history] == [
        ("promote", "v0001"),
        ("promote", "v0002"),
        ("promote", "v0003"),
        ("rollback", "v0002"),
        ("rollback", "v0001"),
    ]


def test_rollback_with_nothing_in_production_is_an_error(tmp_path):
    with pytest.raises(RegistryError, match="nothing is in production"):
        ModelRegistry(str(tmp_path), "digits").rollback()


def test_edited_pointer_is_detected(tmp_path, checkpoints):
    registry = ModelRegistry(str(tmp_path), "digits")
    registry.promote(_register(registry, checkpoints[0], 0.9))
    path = tmp_path / "digits" / "production.json"
    body = json.loads(path.read_text())
    body["version"] = "v0002"
    path.write_text(json.dumps(body))
    with pytest.raises(RegistryError, match="fails its checksum"):
        registry.production()


def test_readers_never_see_a_half_written_pointer(tmp_path, checkpoints):
    registry = ModelRegistry(str(tmp_path), "digits")
    versions = [_register(registry, uri, 0.9) for uri in checkpoints[:2]]
    registry.promote(versions[0])
    seen, errors, done = set(), [], threading.Event()

    def read() -> None:
        reader = ModelRegistry(str(tmp_path), "digits")
        while not done.is_set():
            try:
                seen.add(reader.production().version)
            except Exception as err:  # any torn read shows up here
                errors.append(err)

    thread = threading.Thread(target=read)
    thread.start()
    try:
        for i in range(60):
            registry.promote(versions[i % 2])
    finally:
        done.set()
        thread.join()
    assert not errors, errors[:3]
    assert seen <= set(versions)
    assert not [p for p in os.listdir(tmp_path / "digits") if ".tmp-" in p]


def test_production_checkpoint_for_warm_start(tmp_path, checkpoints):
    assert production_checkpoint(str(tmp_path), "digits") is None
    registry = ModelRegistry(str(tmp_path), "digits")
    registry.promote(_register(registry, checkpoints[0], 0.9))
    assert production_checkpoint(str(tmp_path), "digits") == registry.get("v0001").uri


# --------------------------------------------------------------------------- contention


def _racing_registry(store: str, tmp_path, request, name: str) -> ModelRegistry:
    if store == "file":
        return ModelRegistry(f"file://{tmp_path}/{name}", "digits")
    endpoint = request.getfixturevalue("s3")
    return ModelRegistry(
        endpoint.url(f"{name}-{uuid.uuid4().hex}"),
        "digits",
        storage_options=endpoint.storage_options(direct=True),
    )


def _race(registry: ModelRegistry, candidates: list[str], scores: dict[str, float]) -> list:
    """Run the gate on every candidate at once, each in its own thread, every one deciding
    on the same production version: they all read the pointer before any of them moves it."""
    barrier = threading.Barrier(len(candidates), timeout=120)
    waited = set()
    decisions, errors = {}, []

    def evaluate_fn(uri: str) -> dict[str, float]:
        if threading.get_ident() not in waited:  # first judgement only: all have read it
            waited.add(threading.get_ident())
            barrier.wait()
        return {"test_accuracy": scores[uri]}

    def gate(version: str) -> None:
        try:
            decisions[version] = promote_if_better(registry, version, evaluate_fn=evaluate_fn)
        except Exception as err:
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=gate, args=(v,)) for v in candidates]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return [decisions[v] for v in candidates]


@pytest.mark.parametrize("store", ["file", "s3"])
def test_eight_promotions_at_once_one_wins_and_history_keeps_every_winner(
    store, tmp_path, request, checkpoints
):
    registry = _racing_registry(store, tmp_path, request, "race")
    base = _register(registry, checkpoints[0], 0.5, data="base")
    candidates = [_register(registry, checkpoints[i % 3], 0.9, data=f"d{i}") for i in range(8)]
    uris = {v: registry.get(v).uri for v in (base, *candidates)}
    rng = np.random.default_rng(0)
    for _ in range(20):
        registry.promote(base, reason="reset by the test")
        start = registry.production().sequence
        ranks = rng.permutation(8)
        scores = {uris[base]: 0.5}
        scores |= {uris[v]: 0.6 + 0.01 * r for v, r in zip(candidates, ranks, strict=True)}
        decisions = _race(registry, candidates, scores)

        first = [d for d in decisions if not d.lost_to]
        assert len(first) == 1
        assert first[0].promoted
        assert (first[0].production, first[0].sequence) == (base, start + 1)
        winners = sorted((d for d in decisions if d.promoted), key=lambda d: d.sequence)
        for lost in (d for d in decisions if d.lost_to):  # the 7 others, told why
            assert lost.lost_to[0] == first[0].candidate
            assert set(lost.lost_to) <= {w.candidate for w in winners}
            assert lost.reason.startswith(f"lost to {', then '.join(lost.lost_to)}, promoted")
            if not lost.promoted:  # kept the newer version: it scored higher
                assert lost.production_value > lost.candidate_value
        moves = [e for e in registry.history() if e["sequence"] > start]
        assert [(e["sequence"], e["version"]) for e in moves] == [
            (d.sequence, d.candidate) for d in winners
        ]
        assert [e["sequence"] for e in moves] == list(range(start + 1, start + 1 + len(moves)))
        best = candidates[int(np.argmax(ranks))]
        assert registry.production().version == best == winners[-1].candidate
        assert registry.decision(best)["sequence"] == winners[-1].sequence
    history = registry.history()
    assert [e["sequence"] for e in history] == list(range(1, len(history) + 1))
    assert len(history) > 20 * 2


def test_history_beyond_what_the_pointer_carries_comes_from_the_move_files(
    tmp_path, checkpoints, monkeypatch
):
    from ringflow.storage import registry as registry_module

    monkeypatch.setattr(registry_module, "_HISTORY_KEPT", 3)
    registry = ModelRegistry(str(tmp_path), "digits")
    versions = [_register(registry, uri, 0.9) for uri in checkpoints]
    for i in range(7):
        registry.promote(versions[i % 3], reason=f"move {i + 1}")
    assert len(registry.production().history) == 3
    history = registry.history()
    assert [(e["sequence"], e["version"], e["reason"]) for e in history] == [
        (i + 1, versions[i % 3], f"move {i + 1}") for i in range(7)
    ]


def test_concurrent_registrations_get_their_own_numbers(tmp_path, checkpoints):
    registry = ModelRegistry(str(tmp_path), "digits")
    versions, barrier = [], threading.Barrier(6)

    def register(i: int) -> None:
        barrier.wait()
        versions.append(_register(registry, checkpoints[i % 3], 0.9, run_key=f"run-{i}"))

    threads = [threading.Thread(target=register, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(versions) == [f"v{i:04d}" for i in range(1, 7)]
    for version in versions:
        record = registry.get(version)
        module, _ = load_model(
            record.uri, allowed=DigitsClassifier
        )  # the weights verify against their own manifest
        assert record.source == checkpoints[int(record.run_key.split("-")[1]) % 3]


def test_a_stale_rollback_is_refused_and_moves_nothing(tmp_path, checkpoints):
    registry = ModelRegistry(str(tmp_path), "digits")
    versions = [_register(registry, uri, 0.9) for uri in checkpoints]
    for version in versions[:2]:
        registry.promote(version)
    seen = registry.production().sequence
    registry.promote(versions[2], reason="someone else")
    with pytest.raises(PointerMovedError, match="moved to v0003 \\(move 3\\)") as err:
        registry.rollback(expected=seen)
    assert err.value.winner.version == "v0003"
    assert registry.production().version == "v0003"


def test_a_lagging_production_file_is_read_through_the_moves(tmp_path, checkpoints):
    registry = ModelRegistry(str(tmp_path), "digits")
    v1, v2 = (_register(registry, uri, 0.9) for uri in checkpoints[:2])
    registry.promote(v1)
    stale = (tmp_path / "digits" / "production.json").read_bytes()
    registry.promote(v2)
    (tmp_path / "digits" / "production.json").write_bytes(stale)  # a writer died in between
    assert (registry.production().version, registry.production().sequence) == (v2, 2)
    with pytest.raises(PointerMovedError):
        registry.promote(v1, expected=1)
    assert registry.promote(v1).sequence == 3


# --------------------------------------------------------------------------- gate


def test_first_version_is_always_promoted(registry, checkpoints):
    decision = promote_if_better(registry, _register(registry, checkpoints[0], 0.1))
    assert decision.promoted
    assert decision.basis == "first"
    assert registry.production().version == "v0001"
    assert registry.decision("v0001")["promoted"] is True


@pytest.mark.parametrize(
    ("candidate", "tolerance", "promoted"),
    [(0.91, 0.0, True), (0.90, 0.0, True), (0.89, 0.0, False), (0.89, 0.02, True)],
)
def test_gate_on_stored_metrics_of_the_same_data(
    tmp_path, checkpoints, candidate, tolerance, promoted
):
    registry = ModelRegistry(str(tmp_path), "digits")
    promote_if_better(registry, _register(registry, checkpoints[0], 0.90))
    decision = promote_if_better(
        registry, _register(registry, checkpoints[1], candidate), tolerance=tolerance
    )
    assert decision.promoted is promoted
    assert decision.basis == "stored"
    assert (decision.candidate_value, decision.production_value) == (candidate, 0.90)
    assert registry.production().version == ("v0002" if promoted else "v0001")
    assert ("promoted v0002" if promoted else "kept v0001") in decision.reason


def test_gate_minimises_a_loss(tmp_path, checkpoints):
    registry = ModelRegistry(str(tmp_path), "digits")
    for uri, loss in zip(checkpoints, (0.5, 0.7, 0.3), strict=True):
        registry.register(uri, metrics={"test_loss": loss}, data_fingerprint="d")
    decisions = [
        promote_if_better(registry, v, metric="test_loss", mode="min").promoted
        for v in ("v0001", "v0002", "v0003")
    ]
    assert decisions == [True, False, True]


def test_gate_on_other_data_needs_re_evaluation(tmp_path, checkpoints):
    registry = ModelRegistry(str(tmp_path), "digits")
    promote_if_better(registry, _register(registry, checkpoints[0], 0.95, data="old"))
    candidate = _register(registry, checkpoints[1], 0.99, data="new")
    with pytest.raises(RegistryError, match="different data. Pass evaluate_fn"):
        promote_if_better(registry, candidate)
    # Stored numbers say the candidate is better; on the same data it is not.
    scores = {registry.get("v0001").uri: 0.97, registry.get("v0002").uri: 0.96}
    evaluated = []

    def evaluate_fn(uri: str) -> dict[str, float]:
        evaluated.append(uri)
        return {"test_accuracy": scores[uri]}

    decision = promote_if_better(registry, candidate, evaluate_fn=evaluate_fn)
    assert not decision.promoted
    assert decision.basis == "re-evaluated"
    assert (decision.candidate_value, decision.production_value) == (0.96, 0.97)
    assert sorted(evaluated) == sorted(scores)
    assert registry.production().version == "v0001"


def test_gate_refuses_a_candidate_without_a_finite_metric(tmp_path, checkpoints):
    registry = ModelRegistry(str(tmp_path), "digits")
    promote_if_better(registry, _register(registry, checkpoints[0], 0.5))
    candidate = _register(registry, checkpoints[1], 0.9, data="other")
    decision = promote_if_better(
        registry, candidate, evaluate_fn=lambda uri: {"test_accuracy": float("nan")}
    )
    assert not decision.promoted
    assert "no finite test_accuracy" in decision.reason


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"mode": "best"}, "mode"), ({"tolerance": -1}, "tolerance")]
)
def test_gate_arguments_are_checked(tmp_path, checkpoints, kwargs, match):
    registry = ModelRegistry(str(tmp_path), "digits")
    with pytest.raises(ValueError, match=match):
        promote_if_better(registry, _register(registry, checkpoints[0], 0.5), **kwargs)


# --------------------------------------------------------------------------- command line


def test_rollback_command(tmp_path, checkpoints, capsys):
    registry = registry_tasks.model_registry(str(tmp_path), "digits")
    for uri in checkpoints[:2]:
        registry.promote(_register(registry, uri, 0.9))
    assert registry_tasks.main(["rollback", "--storage-url", str(tmp_path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["production"], shown["previous"]) == ("v0001", [])
    assert registry.production().reason == "manual rollback"
    assert registry_tasks.main(["rollback", "--storage-url", str(tmp_path)]) == 1
    assert "no earlier one" in capsys.readouterr().err
    assert registry_tasks.main(["history", "--storage-url", str(tmp_path)]) == 0
    moves = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(m["sequence"], m["action"], m["version"]) for m in moves] == [
        (1, "promote", "v0001"),
        (2, "promote", "v0002"),
        (3, "rollback", "v0001"),
    ]


# --------------------------------------------------------------------------- real training


def _corrupt_training_labels(clean_url: str, dest: str, seed: int = 0) -> str:
    """A copy of the dataset whose training labels are shuffled; other splits untouched."""
    shutil.copytree(clean_url, dest)
    manifest_path = os.path.join(dest, "_manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    rng = np.random.default_rng(seed)
    for entry in manifest["files"]:
        if entry["split"] != "train":
            continue
        path = os.path.join(dest, entry["path"])
        table = pq.read_table(path)
        labels = table["label"].to_numpy().copy()
        rng.shuffle(labels)
        table = table.set_column(table.schema.get_field_index("label"), "label", [labels])
        pq.write_table(table, path)
        with open(path, "rb") as f:
            data = f.read()
        entry.update(size=len(data), sha256=sha256(data))
        # A manifest also vouches for each row group, which a streaming reader checks.
        metadata = pq.read_metadata(path)
        entry["row_groups"] = row_group_entries(metadata, lambda at, n, d=data: d[at : at + n])
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    return dest


def _train(data: DataSpec, uri: str, *, epochs: int = 6, hidden: int = 32) -> str:
    """Train in this process (one worker): a few seconds on the digits."""
    config = TrainConfig(workers=1, epochs=epochs, batch_size=64, seed=0)
    return fit(
        DigitsClassifier,
        hparams={"hidden": hidden, "lr": 0.01},
        data=data,
        config=config,
        checkpoint_uri=uri,
        in_process=True,
    ).checkpoint


def test_retrain_on_shuffled_labels_is_refused(digits, tmp_path):
    from ringflow.engine import evaluate

    storage = str(tmp_path / "storage")
    good = _train(digits, str(tmp_path / "good"))
    good_metrics = evaluate(good, digits, model=DigitsClassifier)
    v1 = registry_tasks.register.fn(
        good,
        storage,
        metrics=good_metrics,
        dataset_url=digits.dataset_url,
        run_key="good",
        model="digits",
    )
    assert registry_tasks.promote.fn(v1["version"], storage, model="digits", allowed=[DIGITS])[
        "promoted"
    ]

    bad_data = _corrupt_training_labels(digits.dataset_url, str(tmp_path / "shuffled"))
    assert dataset_fingerprint(bad_data) != dataset_fingerprint(digits.dataset_url)
    bad_spec = DataSpec(dataset_url=bad_data, schema=digits.schema)
    bad = _train(bad_spec, str(tmp_path / "bad"))
    v2 = registry_tasks.register.fn(
        bad,
        storage,
        metrics=evaluate(bad, bad_spec, model=DigitsClassifier),
        dataset_url=bad_data,
        run_key="bad",
        model="digits",
    )
    decision = registry_tasks.promote.fn(v2["version"], storage, model="digits", allowed=[DIGITS])

    assert good_metrics["test_accuracy"] > 0.85
    assert not decision["promoted"], decision
    assert decision["basis"] == "re-evaluated"  # other data: both judged on one test split
    assert decision["candidate_value"] < 0.5 < decision["production_value"]
    assert decision["production_value"] == pytest.approx(good_metrics["test_accuracy"])
    assert "kept v0001" in decision["reason"]
    assert registry_tasks.model_registry(storage, "digits").production().version == "v0001"
    assert registry_tasks.warm_start_checkpoint(storage, "digits") == v1["uri"]
