"""storage.ray_preprocess: the Ray Data job writes the single-process path's dataset, byte for
byte (shards, rejects, manifest), on the session Ray and on a 2-node cluster."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ringflow.storage import dataset as dataset_module
from ringflow.storage.dataset import (
    Column,
    DataError,
    SchemaError,
    TableSchema,
    choose_engine,
    preprocess,
)
from tests.support.net import free_port

ROOT = Path(__file__).resolve().parents[1]

CLASSES = TableSchema(
    features=(
        Column(name="x", dtype="float", min=-5, max=5),
        Column(name="n", dtype="int"),
        Column(name="colour", dtype="category", categories=("blue", "green", "red")),
    ),
    label=Column(name="label", dtype="int", min=0, max=2),
)
NUMBERS = TableSchema(
    features=(Column(name="x", dtype="float"), Column(name="n", dtype="int", min=0)),
    label=Column(name="y", dtype="float"),
    task="regression",
)


def _csv_with_rejects(path: Path, rows: int = 400, seed: int = 1) -> str:
    """Valid rows with bad ones among them: bad numbers, out of range, unknown categories,
    a wrong field count, a blank line and a quoted value spanning lines."""
    rng = np.random.default_rng(seed)
    lines = ["x,n,colour,label,ignored"]
    for i in range(rows):
        x, n = rng.uniform(-4, 4), int(rng.integers(-50, 50))
        colour, label = ("blue", "green", "red")[i % 3], int(rng.integers(0, 3))
        lines.append(f"{x:.6f},{n},{colour},{label},zz")
    lines[7] = "n/a,1,red,0,zz"
    lines[20] = "9.5,2,blue,1,zz"  # above the maximum
    lines[33] = "0.5,2.5,blue,1,zz"  # not an integer
    lines[41] = "0.5,2,purple,7,zz"  # two columns wrong
    lines[52] = "0.5,2,blue"  # too few fields
    lines[60] = '0.25,3,"red",2,"a\nb"'  # a value spanning lines counts as one row
    lines[61] = ""  # a blank line is not a row
    lines[99] = ",4,green,1,zz"  # missing value
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _parquet_directory(root: Path, seed: int = 2) -> str:
    """Three files (one in a subdirectory) with other column types in each, some values bad."""
    rng = np.random.default_rng(seed)
    root.mkdir()
    (root / "more").mkdir()
    for name, rows in (("a.parquet", 150), ("b.parquet", 90), ("more/c.parquet", 120)):
        x = rng.normal(size=rows)
        n = rng.integers(0, 100, size=rows)
        y = rng.normal(size=rows) * 10
        table = pa.table({"x": x, "n": n, "y": y})
        if name == "b.parquet":  # ints as floats, a text column, a null and a negative
            n = n.astype(np.float64)
            n[5] = -3
            x = pa.array([None if i == 9 else str(v) for i, v in enumerate(x)], pa.string())
            table = pa.table({"y": y, "x": x, "n": n, "extra": np.arange(rows)})
        pq.write_table(table, root / name, row_group_size=40)
    (root / "_SUCCESS.parquet").write_bytes(b"not data")  # metadata of another writer: skipped
    return str(root)


def _files(dataset_url: str) -> dict[str, bytes]:
    root = Path(dataset_url)
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _same_dataset(local, ray_result) -> None:
    """Same fingerprint and result, and every file equal byte for byte (manifest included)."""
    assert ray_result.fingerprint == local.fingerprint
    assert (ray_result.rows, ray_result.source_rows, ray_result.rejected_rows) == (
        local.rows,
        local.source_rows,
        local.rejected_rows,
    )
    local_files, ray_files = _files(local.dataset_url), _files(ray_result.dataset_url)
    assert sorted(ray_files) == sorted(local_files)
    different = [name for name in local_files if local_files[name] != ray_files[name]]
    assert not different, different


def test_a_csv_with_rejected_rows_gives_the_same_dataset(ray_session, tmp_path):
    source = _csv_with_rejects(tmp_path / "rows.csv")
    kw = {"fractions": (0.7, 0.2, 0.1), "seed": 3, "rows_per_shard": 64}
    local = preprocess(source, str(tmp_path / "local"), CLASSES, engine="local", **kw)
    on_ray = preprocess(source, str(tmp_path / "ray"), CLASSES, engine="ray", **kw)
    _same_dataset(local, on_ray)
    assert local.rejected_rows == 6
    rejects = pq.read_table(on_ray.rejected_url).to_pylist()
    assert [r["source_row"] for r in rejects] == [7, 20, 33, 41, 52, 98]
    assert "expected 5 fields, found 3" in rejects[4]["reason"]
    assert rejects[3]["reason"] == (
        "column colour: 'purple' is not one of the categories ['blue', 'green', 'red']; "
        "column label: 7 is above the maximum 2"
    )
    manifest = json.loads(Path(on_ray.dataset_url, "_manifest.json").read_text())
    assert [f["path"] for f in manifest["files"]][:3] == [
        "rejected.parquet",
        "train/part-00000.parquet",
        "train/part-00001.parquet",
    ]
    assert max(f["rows"] for f in manifest["files"]) == 64


def test_a_parquet_directory_of_several_files_gives_the_same_dataset(ray_session, tmp_path):
    source = _parquet_directory(tmp_path / "drop")
    kw = {"seed": 5, "rows_per_shard": 50}
    local = preprocess(source, str(tmp_path / "local"), NUMBERS, engine="local", **kw)
    on_ray = preprocess(source, str(tmp_path / "ray"), NUMBERS, engine="ray", **kw)
    _same_dataset(local, on_ray)
    assert local.source_rows == 360
    rejects = pq.read_table(on_ray.rejected_url).to_pylist()
    # Row 156 is b.parquet's row 6 (a.parquet holds 150): numbered across the files.
    assert [(r["source_row"], r["reason"]) for r in rejects] == [
        (156, "column n: -3 is below the minimum 0"),
        (160, "column x: value is missing"),
    ]


def test_an_empty_split_and_a_committed_dataset(ray_session, tmp_path):
    source = _csv_with_rejects(tmp_path / "rows.csv", rows=120)
    kw = {"fractions": (0.9, 0.1, 0.0), "seed": 0}
    local = preprocess(source, str(tmp_path / "local"), CLASSES, engine="local", **kw)
    on_ray = preprocess(source, str(tmp_path / "ray"), CLASSES, engine="ray", **kw)
    _same_dataset(local, on_ray)
    assert on_ray.rows["test"] == 0
    before = {p: p.stat().st_mtime_ns for p in Path(on_ray.dataset_url).rglob("*")}
    again = preprocess(source, str(tmp_path / "ray"), CLASSES, engine="ray", **kw)
    assert again == on_ray
    assert {p: p.stat().st_mtime_ns for p in Path(on_ray.dataset_url).rglob("*")} == before


def test_bad_sources_fail_with_the_single_process_errors(ray_session, tmp_path):
    source = _csv_with_rejects(tmp_path / "rows.csv", rows=120)
    wrong = TableSchema(features=(Column(name="weight", dtype="float"),), label=CLASSES.label)
    messages = []
    for engine in ("local", "ray"):
        with pytest.raises(SchemaError) as caught:
            preprocess(source, str(tmp_path / engine), wrong, engine=engine)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert "lacks the schema columns ['weight']" in messages[1]
    all_bad = tmp_path / "bad.csv"
    all_bad.write_text("x,n,colour,label\nq,1,red,0\n")
    with pytest.raises(DataError, match="all 1 rows of .* were rejected"):
        preprocess(str(all_bad), str(tmp_path / "out"), CLASSES, engine="ray")
    header_only = tmp_path / "empty.csv"
    header_only.write_text("x,n,colour,label\n")
    with pytest.raises(DataError, match="all 0 rows of .* were rejected"):
        preprocess(str(header_only), str(tmp_path / "out"), CLASSES, engine="ray")


def test_the_engine_is_checked_and_chosen_before_any_work(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="engine must be one of 'auto', 'local', 'ray'"):
        preprocess(str(tmp_path / "missing.csv"), str(tmp_path), CLASSES, engine="spark")
    source = _csv_with_rejects(tmp_path / "rows.csv", rows=120)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert choose_engine(source) == "local"
    assert choose_engine(source, "ray") == "ray"
    monkeypatch.setattr(dataset_module, "RAY_PREPROCESS_BYTES", os.path.getsize(source))
    assert choose_engine(source) == "ray"
    assert choose_engine(source, "local") == "local"
    monkeypatch.setattr(dataset_module, "RAY_PREPROCESS_BYTES", 1 << 40)
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert choose_engine(source) == "local"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")  # a cluster: a lower threshold
    assert choose_engine(source) == "local"  # a small source is read here, no job to start
    monkeypatch.setattr(dataset_module, "RAY_CLUSTER_PREPROCESS_BYTES", os.path.getsize(source))
    assert choose_engine(source) == "ray"
    assert choose_engine(str(tmp_path / "missing.csv"), "local") == "local"
    assert choose_engine(source, "auto", "memory://datasets") == "local"  # workers can't see it
    with pytest.raises(ValueError, match="memory:// lives in this process only"):
        preprocess(source, "memory://datasets", CLASSES, engine="ray")


def test_the_flow_refuses_an_unknown_engine_naming_the_parameter():
    from ringflow.flows.preflight import PreflightError, check_parameters
    from ringflow.flows.train_pipeline import train_pipeline

    assert check_parameters(train_pipeline, {"preprocess_engine": "ray"})["preprocess_engine"] == (
        "ray"
    )
    with pytest.raises(PreflightError, match="preprocess_engine"):
        check_parameters(train_pipeline, {"preprocess_engine": "spark"})


def test_the_shard_size_is_part_of_the_fingerprint(tmp_path):
    source = _csv_with_rejects(tmp_path / "rows.csv", rows=120)
    first = preprocess(source, str(tmp_path), CLASSES, engine="local", rows_per_shard=10)
    second = preprocess(source, str(tmp_path), CLASSES, engine="local", rows_per_shard=20)
    assert first.fingerprint != second.fingerprint
    assert first.dataset_url != second.dataset_url


# The driver on the cluster: the Ray Data path (chosen by auto: RAY_ADDRESS names the cluster
# and the sources count as large there) on a CSV and on a Parquet directory, then the SHA-256
# of every file each wrote.
DRIVER = textwrap.dedent(
    """
    import hashlib, json, pathlib, sys
    import ray
    from ringflow.storage import dataset
    from ringflow.storage.dataset import choose_engine, preprocess
    from tests.test_ray_preprocess import CLASSES, NUMBERS

    csv, directory, out = sys.argv[1:4]
    dataset.RAY_CLUSTER_PREPROCESS_BYTES = 1
    ray.init(log_to_driver=False)
    found = {"nodes": sum(1 for n in ray.nodes() if n["Alive"]), "engine": choose_engine(csv)}
    for name, source, schema in (("csv", csv, CLASSES), ("parquet", directory, NUMBERS)):
        result = preprocess(source, out, schema, seed=3, rows_per_shard=64)
        root = pathlib.Path(result.dataset_url)
        found[name] = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                       for p in root.rglob("*") if p.is_file()}
    print(json.dumps(found))
    """
)


@pytest.mark.integration  # a Ray cluster of its own
def test_on_a_two_node_cluster_the_ray_data_path_writes_the_same_dataset(tmp_path):
    csv = _csv_with_rejects(tmp_path / "rows.csv", rows=3_000)
    directory = _parquet_directory(tmp_path / "drop")
    port = free_port(20)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RINGFLOW_"))},
        "RINGFLOW_STATE": str(tmp_path / "state"),
        "RINGFLOW_RAY_PORT": str(port),
        "RAY_ADDRESS": f"127.0.0.1:{port}",
        "RINGFLOW_LOCAL_RAY": "1",
        "PYTHONPATH": str(ROOT),
        "RAY_AUTH_TOKEN_PATH": str(tmp_path / "state" / "ray" / "auth_token"),
        "RAY_AUTH_MODE": "token",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    try:
        _cluster(env, "head", "1")
        _cluster(env, "node", "b", "1", str(port + 10))
        driver = subprocess.run(
            [sys.executable, "-c", DRIVER, csv, directory, str(tmp_path / "ray")],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        _cluster(env, "stop")
    assert driver.returncode == 0, driver.stdout[-4000:] + driver.stderr[-4000:]
    found = json.loads(driver.stdout.strip().splitlines()[-1])
    assert (found["nodes"], found["engine"]) == (2, "ray")
    for name, source, schema in (("csv", csv, CLASSES), ("parquet", directory, NUMBERS)):
        local = preprocess(
            source, str(tmp_path / "local"), schema, seed=3, rows_per_shard=64, engine="local"
        )
        files = _files(local.dataset_url)
        assert found[name] == {n: hashlib.sha256(data).hexdigest() for n, data in files.items()}
        assert {"_manifest.json", "rejected.parquet"} <= set(found[name])


def _cluster(env: dict, *args: str) -> None:
    subprocess.run(
        ["./deployments/ray-cluster.sh", *args], cwd=ROOT, env=env, check=True, timeout=240
    )
