"""The promotion gate evaluates on the test split streamed in batches, a few row groups at a
time, and finds the values reading the split whole gives; serving asks about the first test
row without reading the split."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ringflow.engine import DataSpec, evaluate
from ringflow.engine.worker import evaluate_module
from ringflow.models.digits import SCHEMA, DigitsClassifier, write_digits_csv
from ringflow.storage import dataset
from ringflow.storage.checkpoint import load_model, save_model
from ringflow.storage.dataset import preprocess, read_split
from ringflow.storage.registry import dataset_fingerprint
from ringflow.storage.stream import SplitStream
from ringflow.tasks import registry as registry_tasks
from ringflow.tasks.serve import _first_test_row

DIGITS = "ringflow.models.digits:DigitsClassifier"


@pytest.fixture(scope="module")
def sharded(digits, tmp_path_factory):
    """The digits of the ``digits`` fixture, the same rows in the same splits, in shards of 40
    rows: the test split spans several row groups."""
    root = str(tmp_path_factory.mktemp("sharded-digits"))
    write_digits_csv(f"{root}/raw/digits.csv")
    result = preprocess(f"{root}/raw/digits.csv", root, SCHEMA, seed=0, rows_per_shard=40)
    return DataSpec(dataset_url=result.dataset_url, schema=SCHEMA, stream=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> list[str]:
    """Two different (untrained) digits classifiers, committed."""
    root = tmp_path_factory.mktemp("models")
    uris = []
    for seed in range(2):
        torch.manual_seed(seed)
        uris.append(
            save_model(str(root / f"m{seed}"), DigitsClassifier(hidden=8), hparams={"hidden": 8})
        )
    return uris


@pytest.fixture
def whole_reads(monkeypatch) -> list[str]:
    """The splits read whole (``read_split``) while the test runs."""
    reads: list[str] = []
    real = dataset.read_split

    def read_split(dataset_url, split, *args, **kwargs):
        reads.append(split)
        return real(dataset_url, split, *args, **kwargs)

    monkeypatch.setattr(dataset, "read_split", read_split)
    return reads


def test_streamed_evaluation_gives_the_whole_split_values_on_the_digits(digits, sharded, models):
    whole = evaluate(
        models[0], dataclasses.replace(digits, stream=False), batch_size=64, model=DIGITS
    )
    streamed = evaluate(models[0], sharded, batch_size=64, model=DIGITS)
    assert set(whole) == {"test_loss", "test_accuracy"}
    assert streamed == pytest.approx(whole, rel=1e-6)
    # Bounded memory: each row group read once, in batches, at most two held at a time.
    module, _ = load_model(models[0], allowed=DIGITS)
    stream = sharded.samples("test")
    assert isinstance(stream, SplitStream)
    assert len(stream.layout.blocks) > 3
    evaluate_module(module, stream, split="test", batch_size=64)
    assert stream.row_groups_read == len(stream.layout.blocks)
    assert len(stream._direct) <= 2


def test_the_gate_judges_on_the_streamed_test_split(digits, sharded, models, tmp_path, whole_reads):
    storage = str(tmp_path / "storage")
    registered = []
    for uri, data in zip(models, (digits, sharded), strict=True):
        registered.append(
            registry_tasks.register.fn(
                uri,
                storage,
                metrics=evaluate(uri, data, model=DIGITS),
                dataset_url=data.dataset_url,
                run_key=uri,
                model="digits",
            )
        )
    whole_reads.clear()
    assert registry_tasks.promote.fn(
        registered[0]["version"], storage, model="digits", allowed=[DIGITS]
    )["promoted"]
    assert dataset_fingerprint(sharded.dataset_url) != dataset_fingerprint(digits.dataset_url)

    decision = registry_tasks.promote.fn(
        registered[1]["version"], storage, model="digits", allowed=[DIGITS]
    )

    assert decision["basis"] == "re-evaluated"  # other data: both judged on the candidate's
    assert whole_reads == []  # streamed, never read whole
    expected = [
        evaluate(uri, dataclasses.replace(digits, stream=False), model=DIGITS) for uri in models
    ]
    assert decision["candidate_value"] == pytest.approx(expected[1]["test_accuracy"], rel=1e-6)
    assert decision["production_value"] == pytest.approx(expected[0]["test_accuracy"], rel=1e-6)


def test_serving_asks_about_the_first_test_row_read_from_its_row_group(digits, sharded):
    features, labels = read_split(digits.dataset_url, "test", SCHEMA)
    row, label = _first_test_row(sharded.dataset_url, SCHEMA)
    assert row.tolist() == features[0].tolist()
    assert label.item() == labels[0].item()
