"""Batch scoring (``serving.score``): a registered digits model over Parquet and CSV tables,
every row written once (predicted or rejected with its reason), the predictions ``/predict``
gives, committed block by block; a run killed half-way and started again; the Ray Data path
writing the same bytes; bad input refused in one line before anything is written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ringflow.models.digits import SCHEMA, DigitsClassifier
from ringflow.serving import score as scoring
from ringflow.serving.replica import _forward, _load_served
from ringflow.serving.score import ModelSource, ScoringError, ScoringOptions, score
from ringflow.storage.checkpoint import save_model
from ringflow.storage.registry import ModelRegistry

DIGITS = "ringflow.models.digits:DigitsClassifier"
ROWS = 300
BAD = {5: ("p3", 20.0), 131: ("p10", float("nan"))}
"""Rows (0-based) given a value the digits schema refuses: above 16, and not a number."""


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> str:
    """A registry with two digits versions of different weights; v0001 in production."""
    root = str(tmp_path_factory.mktemp("score"))
    registry = ModelRegistry(f"{root}/registry", "digits")
    for seed in (0, 1):
        torch.manual_seed(seed)
        module = DigitsClassifier(hidden=8).eval()
        uri = save_model(
            f"{root}/run{seed}/model",
            module,
            hparams=dict(module.hparams),
            meta={"data_schema": SCHEMA.to_json()},
        )
        registry.register(uri, metrics={"test_accuracy": 0.5}, data_fingerprint="d")
    registry.promote("v0001")
    return root


def _table() -> pa.Table:
    from sklearn.datasets import load_digits

    pixels = load_digits().data[:ROWS].copy()
    for row, (column, value) in BAD.items():
        pixels[row, int(column[1:])] = value
    return pa.table(
        {
            "id": [f"r{i:04d}" for i in range(ROWS)],
            **{f"p{i}": pixels[:, i] for i in range(64)},
            "label": load_digits().target[:ROWS],
        }
    )


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    """The table as a folder of two Parquet files, in small row groups."""
    folder = tmp_path_factory.mktemp("shards")
    table = _table()
    pq.write_table(table.slice(0, 200), folder / "part-0.parquet", row_group_size=50)
    pq.write_table(table.slice(200), folder / "part-1.parquet", row_group_size=50)
    return str(folder)


def _production(storage: str, version: str | None = None) -> ModelSource:
    return ModelSource(registry_url=f"{storage}/registry", name="digits", version=version)


def _output(url: str) -> tuple[pa.Table, pa.Table]:
    """The predictions and the rejects the output's manifest commits, in block order."""
    with open(os.path.join(url, scoring.MANIFEST)) as f:
        manifest = json.load(f)
    tables: dict[str, list[pa.Table]] = {"predictions": [], "rejected": []}
    for entry in manifest["files"]:
        tables[entry["path"].split("/")[0]].append(pq.read_table(os.path.join(url, entry["path"])))
    return pa.concat_tables(tables["predictions"]), pa.concat_tables(tables["rejected"])


def _expected(storage: str, version: str, rows: np.ndarray) -> list[dict]:
    """What ``/predict`` answers for ``rows`` (the replica's own forward pass)."""
    served = _load_served(f"{storage}/registry/digits/versions/{version}/model", (DIGITS,))
    return _forward(served, rows.tolist())


def test_production_scores_every_row_once_as_predict_answers(storage, shards, tmp_path):
    out = str(tmp_path / "out")
    result = score(
        shards,
        out,
        model=_production(storage),
        allowed=DIGITS,
        key_columns=["id"],
        options=ScoringOptions(block_rows=64, batch_size=32, engine="local"),
    )
    assert (result.rows_scored, result.rows_rejected) == (ROWS - len(BAD), len(BAD))
    assert (result.blocks, result.blocks_scored, result.engine) == (6, 6, "local")
    assert result.model["version"] == "v0001"
    predictions, rejected = _output(out)
    ids = Counter(predictions["id"].to_pylist() + rejected["id"].to_pylist())
    assert ids == Counter(f"r{i:04d}" for i in range(ROWS))  # every row exactly once
    assert rejected["id"].to_pylist() == [f"r{i:04d}" for i in sorted(BAD)]
    assert rejected["reason"].to_pylist() == [
        "column p3: 20 is above the maximum 16",
        "column p10: 'nan' is not finite",
    ]
    table = _table()
    keep = [i for i in range(ROWS) if i not in BAD]
    pixels = np.stack([table[f"p{i}"].to_numpy()[keep] for i in range(64)], axis=1)
    expected = _expected(storage, "v0001", pixels)
    assert predictions["digit"].to_pylist() == [a["digit"] for a in expected]
    probabilities = predictions["probabilities"].to_pylist()
    assert probabilities == [a["probabilities"] for a in expected]
    fingerprint = _load_served(result.model["uri"], (DIGITS,)).tag["fingerprint"]
    assert set(predictions["model_version"].to_pylist()) == {"v0001"}
    assert set(predictions["model_name"].to_pylist()) == {"digits"}
    assert set(predictions["model_fingerprint"].to_pylist()) == {fingerprint}


def test_a_committed_output_is_returned_without_scoring_again(storage, shards, tmp_path):
    out = str(tmp_path / "out")
    options = ScoringOptions(block_rows=100, engine="local")
    first = score(shards, out, model=_production(storage), allowed=DIGITS, options=options)
    manifest = os.stat(os.path.join(out, scoring.MANIFEST)).st_mtime_ns
    again = score(shards, out, model=_production(storage), allowed=DIGITS, options=options)
    assert (again.blocks_scored, again.engine) == (0, "committed")
    assert again.rows_scored == first.rows_scored == ROWS - len(BAD)
    assert os.stat(os.path.join(out, scoring.MANIFEST)).st_mtime_ns == manifest


def test_csv_rows_are_keyed_by_their_row_number_and_bad_records_kept(storage, tmp_path):
    source = tmp_path / "rows.csv"
    header = ",".join(f"p{i}" for i in range(64))
    good = ",".join(["1"] * 64)
    source.write_text(f"{header}\n{good}\n1,2,3\n{good.replace('1', 'x', 1)}\n{good}\n")
    out = str(tmp_path / "out")
    result = score(
        str(source),
        out,
        model=_production(storage, "v0002"),
        allowed=DigitsClassifier,
        options=ScoringOptions(block_rows=2, engine="local"),
    )
    assert (result.rows_scored, result.rows_rejected, result.blocks) == (2, 2, 2)
    predictions, rejected = _output(out)
    assert predictions["source_row"].to_pylist() == [1, 4]
    assert rejected["source_row"].to_pylist() == [2, 3]
    assert rejected["reason"].to_pylist() == [
        "expected 64 fields, found 3",
        "column p0: 'x' is not a number",
    ]
    assert set(predictions["model_version"].to_pylist()) == {"v0002"}
    expected = _expected(storage, "v0002", np.ones((2, 64)))
    assert predictions["digit"].to_pylist() == [a["digit"] for a in expected]


def test_a_run_checkpoint_scores_without_a_registry(storage, shards, tmp_path):
    out = str(tmp_path / "out")
    result = score(
        shards,
        out,
        model=ModelSource(checkpoint=f"{storage}/run1/model", name="digits"),
        allowed=DIGITS,
        options=ScoringOptions(engine="local"),
    )
    predictions, _ = _output(out)
    assert result.model["version"] is None
    assert set(predictions["model_version"].to_pylist()) == {None}
    by_version = _load_served(f"{storage}/registry/digits/versions/v0002/model", (DIGITS,))
    assert result.model["fingerprint"] == by_version.tag["fingerprint"]  # the weights registered


# --------------------------------------------------------------------------- bad input


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"drop": "p3"}, "lacks the schema columns ['p3']"),
        ({"key_columns": ["order"]}, "lacks the schema columns ['order']"),
        ({"version": "v0009"}, "has no version v0009 (committed: v0001, v0002)"),
        ({"allowed": "ringflow.models.tabular:TabularMLP"}, "refused without importing it"),
        ({"input": "missing.parquet"}, "does not exist"),
        ({"key_columns": ["digit"]}, "clash with columns the output adds"),
    ],
)
def test_bad_input_is_one_line_before_anything_is_written(
    storage, shards, tmp_path, change, expected
):
    source = shards
    if "drop" in change:
        source = str(tmp_path / "in.parquet")
        pq.write_table(_table().drop_columns([change["drop"]]), source)
    if "input" in change:
        source = str(tmp_path / change["input"])
    out = str(tmp_path / "out")
    with pytest.raises(ScoringError) as err:
        score(
            source,
            out,
            model=_production(storage, change.get("version")),
            allowed=change.get("allowed", DIGITS),
            key_columns=change.get("key_columns", ()),
        )
    assert expected in _one_line(err)
    assert not os.path.exists(out)


def test_another_model_into_a_started_output_is_refused(storage, shards, tmp_path):
    out = str(tmp_path / "out")
    options = ScoringOptions(engine="local")
    score(shards, out, model=_production(storage), allowed=DIGITS, options=options)
    with pytest.raises(ScoringError) as err:
        score(shards, out, model=_production(storage, "v0002"), allowed=DIGITS, options=options)
    assert "holds a run of another plan (its model differ" in _one_line(err)


def test_no_production_version_is_one_line(tmp_path, shards):
    with pytest.raises(ScoringError) as err:
        score(
            shards,
            str(tmp_path / "out"),
            model=ModelSource(registry_url=str(tmp_path / "empty"), name="digits"),
            allowed=DIGITS,
        )
    assert "has no production version to score with" in _one_line(err)


@pytest.mark.parametrize(
    ("field", "value"),
    [("block_rows", 0), ("batch_size", -1), ("engine", "spark"), ("gpus_per_actor", -0.5)],
)
def test_options_name_the_field_refused(field, value):
    with pytest.raises(ValueError, match=field):
        ScoringOptions(**{field: value})


# --------------------------------------------------------------------------- resuming

_CHILD = textwrap.dedent(
    """
    import signal, sys
    from ringflow.serving import score as scoring

    commit_record, commits = scoring.commit_record, []

    def stall_fourth_block(url, record, **kw):
        # The fourth block's shards are written; stop before its record commits it.
        if "/blocks/" in url and len(commits) == 3:
            print("stalled", flush=True)
            signal.pause()
        commit_record(url, record, **kw)
        if "/blocks/" in url:
            commits.append(url)

    scoring.commit_record = stall_fourth_block
    scoring.score(
        sys.argv[1],
        sys.argv[2],
        model=scoring.ModelSource(registry_url=sys.argv[3], name="digits"),
        allowed="ringflow.models.digits:DigitsClassifier",
        key_columns=["id"],
        options=scoring.ScoringOptions(block_rows=40, engine="local"),
    )
    """
)


@pytest.mark.integration  # a process of its own
def test_a_killed_run_started_again_writes_each_row_once(storage, shards, tmp_path, monkeypatch):
    out = str(tmp_path / "out")
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, shards, out, f"{storage}/registry"],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        assert child.stdout.readline().strip() == "stalled"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
    committed = sorted(os.listdir(os.path.join(out, "blocks")))
    assert len(committed) == 3
    assert not os.path.exists(os.path.join(out, scoring.MANIFEST))
    before = {
        name: os.stat(os.path.join(out, "predictions", name)).st_mtime_ns
        for name in os.listdir(os.path.join(out, "predictions"))
    }
    assert len(before) == 4  # the fourth block's shard, left without its record

    read = []
    read_block = scoring._read_block
    monkeypatch.setattr(
        scoring, "_read_block", lambda job, block: read.append(block.id) or read_block(job, block)
    )
    result = score(
        shards,
        out,
        model=_production(storage),
        allowed=DIGITS,
        key_columns=["id"],
        options=ScoringOptions(block_rows=40, engine="local"),
    )
    skipped = {name.removesuffix(".json") for name in committed}
    assert (result.blocks, result.blocks_scored) == (8, 5)
    assert skipped.isdisjoint(read)
    assert len(read) == 5
    for block in skipped:  # committed shards are not written again
        name = f"part-{block}.parquet"
        assert os.stat(os.path.join(out, "predictions", name)).st_mtime_ns == before[name]
    predictions, rejected = _output(out)
    ids = Counter(predictions["id"].to_pylist() + rejected["id"].to_pylist())
    assert ids == Counter(f"r{i:04d}" for i in range(ROWS))


# --------------------------------------------------------------------------- Ray Data


def test_the_ray_data_path_writes_the_same_output(ray_session, storage, shards, tmp_path):
    outputs = {}
    for engine in ("local", "ray"):
        outputs[engine] = str(tmp_path / engine)
        result = score(
            shards,
            outputs[engine],
            model=_production(storage),
            allowed=DIGITS,
            key_columns=["id"],
            options=ScoringOptions(block_rows=64, batch_size=32, engine=engine, concurrency=1),
        )
        assert (result.engine, result.blocks_scored) == (engine, 6)
    manifests = {}
    for engine, url in outputs.items():
        with open(os.path.join(url, scoring.MANIFEST)) as f:
            manifests[engine] = json.load(f)
    assert manifests["ray"]["files"] == manifests["local"]["files"]  # the same bytes
    assert manifests["ray"] == manifests["local"]
