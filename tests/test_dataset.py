"""storage.dataset: validation, rejects, stratified splits, manifest commit and idempotence."""

from __future__ import annotations

import gzip
import io
import json
import os
import uuid

import fsspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ringflow.models.digits import SCHEMA, write_digits_csv
from ringflow.storage.dataset import (
    Column,
    DataError,
    SchemaError,
    TableSchema,
    dataset_schema,
    preprocess,
    read_split,
)
from ringflow.storage.fs import join, read_bytes

SPLITS = ("train", "validation", "test")
DIGITS_ROWS = 1_797

SMALL = TableSchema(
    features=(
        Column(name="a", dtype="float"),
        Column(name="b", dtype="float", min=0, max=10),
    ),
    label=Column(name="label", dtype="int", min=0, max=9),
)


@pytest.fixture(scope="module")
def digits_csv(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("digits") / "digits.csv")
    assert write_digits_csv(url) == DIGITS_ROWS
    return url


@pytest.fixture
def memory_root():
    root = f"memory://test-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _rows(features: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Rows as one float64 matrix sorted lexicographically, for order-free comparison."""
    rows = np.column_stack([features.astype(np.float64), labels.astype(np.float64)])
    return rows[np.lexsort(rows.T[::-1])]


def _all_splits(dataset_url: str, schema: TableSchema = SCHEMA) -> dict[str, tuple]:
    return {s: read_split(dataset_url, s, schema) for s in SPLITS}


def _write_csv(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _mtimes(root: str) -> dict[str, int]:
    return {
        os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
        for d, _, files in os.walk(root)
        for f in files
    }


# --------------------------------------------------------------------------- the digits drop


def test_digits_split_80_10_10_with_every_row_once(digits_csv, tmp_path):
    result = preprocess(digits_csv, str(tmp_path / "out"), SCHEMA)

    assert result.source_rows == DIGITS_ROWS
    assert result.rejected_rows == 0
    assert result.rejected_url is None
    assert sum(result.rows.values()) == DIGITS_ROWS
    for split, share in zip(SPLITS, (0.8, 0.1, 0.1), strict=True):
        assert abs(result.rows[split] - share * DIGITS_ROWS) <= 10, result.rows

    splits = _all_splits(result.dataset_url)
    for split, (features, labels) in splits.items():
        assert features.shape == (result.rows[split], 64)
        assert features.dtype == np.float32
        assert labels.shape == (result.rows[split],)
        assert labels.dtype == np.int64
        assert set(labels.tolist()) == set(range(10)), split

    # Same multiset of rows: every source row lands in exactly one split.
    source = np.loadtxt(digits_csv, delimiter=",", skiprows=1)
    together = _rows(
        np.concatenate([f for f, _ in splits.values()]),
        np.concatenate([y for _, y in splits.values()]),
    )
    np.testing.assert_array_equal(together, _rows(source[:, :64], source[:, 64]))


def test_splits_keep_the_class_balance(digits_csv, tmp_path):
    result = preprocess(digits_csv, str(tmp_path), SCHEMA)
    source_share = np.bincount(np.loadtxt(digits_csv, delimiter=",", skiprows=1)[:, 64].astype(int))
    source_share = source_share / source_share.sum()
    for _, labels in _all_splits(result.dataset_url).values():
        share = np.bincount(labels, minlength=10) / len(labels)
        np.testing.assert_allclose(share, source_share, atol=0.01)


def test_same_seed_gives_identical_arrays(digits_csv, tmp_path):
    first = preprocess(digits_csv, str(tmp_path / "one"), SCHEMA, seed=7)
    second = preprocess(digits_csv, str(tmp_path / "two"), SCHEMA, seed=7)

    assert first.fingerprint == second.fingerprint
    for split in SPLITS:
        x1, y1 = read_split(first.dataset_url, split, SCHEMA)
        x2, y2 = read_split(second.dataset_url, split, SCHEMA)
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)


def test_another_seed_gives_another_split(digits_csv, tmp_path):
    first = preprocess(digits_csv, str(tmp_path), SCHEMA, seed=0)
    second = preprocess(digits_csv, str(tmp_path), SCHEMA, seed=1)

    assert first.fingerprint != second.fingerprint
    assert first.dataset_url != second.dataset_url
    x1, _ = read_split(first.dataset_url, "test", SCHEMA)
    x2, _ = read_split(second.dataset_url, "test", SCHEMA)
    assert x1.shape == x2.shape
    assert not np.array_equal(_rows(x1, np.zeros(len(x1))), _rows(x2, np.zeros(len(x2))))


def test_second_call_returns_the_committed_result_without_writing(digits_csv, tmp_path):
    out = str(tmp_path / "out")
    first = preprocess(digits_csv, out, SCHEMA, rows_per_shard=500)
    before = _mtimes(first.dataset_url)
    assert len([p for p in before if p.endswith(".parquet")]) == 3 + 1 + 1  # 1438 train rows

    second = preprocess(digits_csv, out, SCHEMA, rows_per_shard=500)

    assert second == first
    assert _mtimes(first.dataset_url) == before


def test_shards_hold_at_most_rows_per_shard(digits_csv, tmp_path):
    result = preprocess(digits_csv, str(tmp_path), SCHEMA, rows_per_shard=100)
    train = sorted(os.listdir(os.path.join(result.dataset_url, "train")))
    assert train == [f"part-{i:05d}.parquet" for i in range(15)]
    sizes = [pq.read_metadata(os.path.join(result.dataset_url, "train", f)).num_rows for f in train]
    assert max(sizes) == 100
    assert sum(sizes) == result.rows["train"]
    table = pq.read_table(os.path.join(result.dataset_url, "train", train[0]))
    assert str(table.schema.field("p0").type) == "float"
    assert str(table.schema.field("label").type) == "int64"


def test_leftovers_of_an_interrupted_attempt_are_replaced(digits_csv, tmp_path):
    out = str(tmp_path)
    result = preprocess(digits_csv, out, SCHEMA)
    expected = _all_splits(result.dataset_url)
    # Simulate a crash before the commit: no manifest, a torn shard and a stray one.
    os.remove(os.path.join(result.dataset_url, "_manifest.json"))
    with pytest.raises(DataError, match="not a committed dataset"):
        read_split(result.dataset_url, "train", SCHEMA)
    with open(os.path.join(result.dataset_url, "train", "part-00000.parquet"), "wb") as f:
        f.write(b"torn")
    stray = os.path.join(result.dataset_url, "train", "part-00099.parquet")
    with open(stray, "wb") as f:
        f.write(b"stale")

    again = preprocess(digits_csv, out, SCHEMA)

    assert again == result
    assert not os.path.exists(stray)
    for split, (features, labels) in _all_splits(again.dataset_url).items():
        np.testing.assert_array_equal(features, expected[split][0])
        np.testing.assert_array_equal(labels, expected[split][1])


def test_gzipped_csv_reads_like_the_plain_one(digits_csv, tmp_path):
    gz = tmp_path / "digits.csv.gz"
    gz.write_bytes(gzip.compress(read_bytes(digits_csv)))
    plain = preprocess(digits_csv, str(tmp_path / "plain"), SCHEMA)
    zipped = preprocess(str(gz), str(tmp_path / "gz"), SCHEMA)
    assert zipped.rows == plain.rows
    x1, y1 = read_split(plain.dataset_url, "train", SCHEMA)
    x2, y2 = read_split(zipped.dataset_url, "train", SCHEMA)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)


# --------------------------------------------------------------------------- bad input


def test_missing_column_is_a_schema_error_naming_it(tmp_path):
    source = _write_csv(tmp_path / "s.csv", "a,label,extra\n1,2,3\n")
    with pytest.raises(SchemaError, match=r"\['b'\]") as info:
        preprocess(source, str(tmp_path / "out"), SMALL)
    assert "columns found: ['a', 'label', 'extra']" in str(info.value)


def test_malformed_rows_are_counted_and_written_aside(tmp_path):
    source = _write_csv(
        tmp_path / "s.csv",
        "a,b,label,extra\n"
        "1,2,3,x\n"  # row 1: valid
        "abc,2,3,x\n"  # row 2: not a number
        "1,12,3,x\n"  # row 3: above the maximum
        "1,2,3.5,x\n"  # row 4: non-integral label
        "1,2\n"  # row 5: too few fields
        "1,,3,x\n"  # row 6: empty value
        "0.5,0,9,y\n"  # row 7: valid
        "-2,10,0,z\n",  # row 8: valid, bounds are inclusive
    )
    result = preprocess(source, str(tmp_path / "out"), SMALL, fractions=(1, 0, 0))

    assert result.source_rows == 8
    assert result.rejected_rows == 5
    assert result.rows == {"train": 3, "validation": 0, "test": 0}
    rejected = pq.read_table(result.rejected_url).to_pylist()
    assert [r["source_row"] for r in rejected] == [2, 3, 4, 5, 6]
    reasons = [r["reason"] for r in rejected]
    assert reasons[0] == "column a: 'abc' is not a number"
    assert reasons[1] == "column b: 12 is above the maximum 10"
    assert reasons[2] == "column label: '3.5' is not an integer"
    assert reasons[3] == "expected 4 fields, found 2"
    assert reasons[4] == "column b: value is missing"
    assert rejected[0]["a"] == "abc"
    assert rejected[3]["text"] == "1,2"

    features, labels = read_split(result.dataset_url, "train", SMALL)
    np.testing.assert_array_equal(
        _rows(features, labels), _rows(np.array([[1, 2], [0.5, 0], [-2, 10]]), np.array([3, 9, 0]))
    )
    for split in ("validation", "test"):
        features, labels = read_split(result.dataset_url, split, SMALL)
        assert features.shape == (0, 2)
        assert labels.shape == (0,)


def test_blank_lines_do_not_count_as_rows(tmp_path):
    source = _write_csv(tmp_path / "s.csv", "a,b,label\r\n1,2,3\r\n\r\n1,2,x\r\n4,5,6\r\n")
    result = preprocess(source, str(tmp_path / "out"), SMALL, fractions=(1, 0, 0))
    assert result.source_rows == 3
    rejected = pq.read_table(result.rejected_url).to_pylist()
    assert [(r["source_row"], r["reason"]) for r in rejected] == [
        (2, "column label: 'x' is not a number")
    ]


def test_every_row_rejected_is_an_error_after_writing_the_rejects(tmp_path):
    source = _write_csv(tmp_path / "s.csv", "a,b,label\nx,1,1\n1,-1,1\n")
    out = tmp_path / "out"
    with pytest.raises(DataError, match="all 2 rows") as info:
        preprocess(source, str(out), SMALL)
    assert isinstance(info.value, ValueError)
    [rejects] = list(out.glob("datasets/*/rejected.parquet"))
    assert pq.read_table(rejects).column("source_row").to_pylist() == [1, 2]
    assert not list(out.glob("datasets/*/_manifest.json"))


def test_missing_source_names_the_url(tmp_path):
    missing = str(tmp_path / "nope.csv")
    with pytest.raises(DataError, match="does not exist") as info:
        preprocess(missing, str(tmp_path / "out"), SMALL)
    assert missing in str(info.value)


def test_unsupported_format_lists_the_accepted_ones(tmp_path):
    source = _write_csv(tmp_path / "s.txt", "a,b,label\n1,2,3\n")
    with pytest.raises(DataError, match=r"unsupported format.*\.csv.*\.parquet") as info:
        preprocess(source, str(tmp_path / "out"), SMALL)
    assert source in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"fractions": (0.5, 0.5, 0.5)}, "fractions"),
        ({"fractions": (0.9, 0.2, -0.1)}, "fractions"),
        ({"fractions": (0.0, 0.5, 0.5)}, "fractions"),
        ({"fractions": (0.5, 0.5)}, "fractions"),
        ({"rows_per_shard": 0}, "rows_per_shard"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_arguments_are_rejected_up_front(tmp_path, kwargs, argument):
    # The source does not exist: the argument check has to come first.
    with pytest.raises(ValueError, match=argument):
        preprocess(str(tmp_path / "nope.csv"), str(tmp_path), SMALL, **kwargs)


def test_schema_validates_itself():
    label = Column(name="label", dtype="int")
    with pytest.raises(ValueError, match="at least one feature"):
        TableSchema(features=(), label=label)
    with pytest.raises(ValueError, match="repeated: \\['a'\\]"):
        TableSchema(features=(Column(name="a", dtype="float"),) * 2, label=label)
    with pytest.raises(ValueError, match="min"):
        Column(name="a", dtype="float", min=2, max=1)
    assert [c.name for c in SMALL.columns] == ["a", "b", "label"]


# --------------------------------------------------------------------------- other storage


def test_memory_urls_for_source_and_output(digits_csv, memory_root):
    source = join(memory_root, "drop", "digits.csv")
    fsspec.filesystem("memory").pipe_file(source, read_bytes(digits_csv))
    result = preprocess(source, join(memory_root, "out"), SCHEMA)

    assert result.dataset_url.startswith("memory://")
    assert result.source_rows == DIGITS_ROWS
    features, labels = read_split(result.dataset_url, "train", SCHEMA)
    assert features.shape == (result.rows["train"], 64)
    assert preprocess(source, join(memory_root, "out"), SCHEMA) == result


def test_parquet_file_and_directory_input(digits_csv, memory_root):
    frame = pd.read_csv(digits_csv)
    fs = fsspec.filesystem("memory")
    single = join(memory_root, "digits.parquet")
    fs.pipe_file(single, _parquet_bytes(frame))
    folder = join(memory_root, "parts")
    fs.pipe_file(join(folder, "part-0.parquet"), _parquet_bytes(frame.iloc[:1000]))
    fs.pipe_file(join(folder, "part-1.parquet"), _parquet_bytes(frame.iloc[1000:]))
    fs.pipe_file(join(folder, "_SUCCESS"), b"")

    expected = _rows(frame.iloc[:, :64].to_numpy(), frame["label"].to_numpy())
    for source in (single, folder):
        result = preprocess(source, join(memory_root, "out"), SCHEMA)
        assert result.source_rows == DIGITS_ROWS
        assert result.rejected_rows == 0
        splits = _all_splits(result.dataset_url)
        together = _rows(
            np.concatenate([f for f, _ in splits.values()]),
            np.concatenate([y for _, y in splits.values()]),
        )
        np.testing.assert_array_equal(together, expected)


def test_parquet_rows_are_numbered_from_one(memory_root):
    table = pa.table(
        {
            "a": pa.array([1.0, None, 3.0, float("nan")]),
            "b": pa.array([1.0, 2.0, 3.0, 4.0]),
            "label": pa.array([1, 2, 30, 4]),
        }
    )
    source = join(memory_root, "small.parquet")
    with fsspec.open(source, "wb") as f:
        pq.write_table(table, f)
    result = preprocess(source, join(memory_root, "out"), SMALL)
    with fsspec.open(result.rejected_url) as f:
        rejected = pq.read_table(f).to_pylist()
    assert [(r["source_row"], r["reason"]) for r in rejected] == [
        (2, "column a: value is missing"),
        (3, "column label: 30 is above the maximum 9"),
        (4, "column a: 'nan' is not finite"),
    ]


def _parquet_bytes(frame: pd.DataFrame) -> bytes:
    buf = io.BytesIO()
    frame.to_parquet(buf, index=False)
    return buf.getvalue()


# --------------------------------------------------------------------------- read_split


def test_read_split_needs_a_manifest(tmp_path):
    directory = tmp_path / "datasets" / "abc"
    (directory / "train").mkdir(parents=True)
    (directory / "train" / "part-00000.parquet").write_bytes(b"not committed")
    with pytest.raises(DataError, match="_manifest.json is missing"):
        read_split(str(directory), "train", SCHEMA)


def test_read_split_rejects_unknown_split_and_bad_shards(digits_csv, tmp_path):
    result = preprocess(digits_csv, str(tmp_path), SCHEMA)
    with pytest.raises(ValueError, match="train, validation, test"):
        read_split(result.dataset_url, "holdout", SCHEMA)
    shard = os.path.join(result.dataset_url, "test", "part-00000.parquet")
    with open(shard, "ab") as f:
        f.write(b"\0")
    with pytest.raises(DataError, match="does not match"):
        read_split(result.dataset_url, "test", SCHEMA)


# --------------------------------------------------------------------------- categories, tasks

COLORS = TableSchema(
    features=(
        Column(name="size", dtype="float"),
        Column(name="color", dtype="category", categories=("red", "green", "blue")),
    ),
    label=Column(name="label", dtype="int"),
    classes=3,
)


def test_a_value_outside_the_categories_is_rejected_with_its_reason(tmp_path):
    source = _write_csv(
        tmp_path / "s.csv",
        "size,color,label\n1,red,0\n2, blue ,1\n3,mauve,2\n4,Red,0\n5,green,3\n6,green,-1\n",
    )
    result = preprocess(source, str(tmp_path / "out"), COLORS, fractions=(1, 0, 0))

    rejected = pq.read_table(result.rejected_url).to_pylist()
    assert [(r["source_row"], r["reason"]) for r in rejected] == [
        (3, "column color: 'mauve' is not one of the categories ['red', 'green', 'blue']"),
        (4, "column color: 'Red' is not one of the categories ['red', 'green', 'blue']"),
        (5, "column label: 3 is outside the classes 0..2"),
        (6, "column label: -1 is outside the classes 0..2"),
    ]
    features, labels = read_split(result.dataset_url, "train")
    # Category codes are the index in ``categories``, read back as floats.
    expected = _rows(np.array([[1, 0], [2, 2]]), np.array([0, 1]))
    np.testing.assert_array_equal(_rows(features, labels), expected)
    shard = pq.read_table(os.path.join(result.dataset_url, "train", "part-00000.parquet"))
    assert str(shard.schema.field("color").type) == "int64"


def test_a_long_category_list_is_cut_short_in_the_reason(tmp_path):
    schema = TableSchema(
        features=(Column(name="c", dtype="category", categories=[f"v{i}" for i in range(30)]),),
        label=Column(name="label", dtype="int", min=0, max=1),
    )
    source = _write_csv(tmp_path / "s.csv", "c,label\nv3,0\nzz,1\n")
    result = preprocess(source, str(tmp_path / "out"), schema, fractions=(1, 0, 0))
    [rejected] = pq.read_table(result.rejected_url).to_pylist()
    assert rejected["reason"] == (
        "column c: 'zz' is not one of the categories "
        "['v0', 'v1', 'v2', 'v3', 'v4', 'v5', 'v6', 'v7', ... 22 more]"
    )


def test_a_regression_label_is_stored_and_read_as_float32(tmp_path):
    schema = TableSchema(
        features=(Column(name="a", dtype="float"),),
        label=Column(name="y", dtype="int"),
        task="regression",
    )
    source = _write_csv(tmp_path / "s.csv", "a,y\n1,-5\n2,7\n3,1.5\n")
    result = preprocess(source, str(tmp_path / "out"), schema, fractions=(1, 0, 0))
    assert result.rejected_rows == 1  # an "int" label accepts integral values only
    shard = pq.read_table(os.path.join(result.dataset_url, "train", "part-00000.parquet"))
    assert str(shard.schema.field("y").type) == "float"
    features, labels = read_split(result.dataset_url, "train", schema)
    assert labels.dtype == np.float32
    assert sorted(labels.tolist()) == [-5.0, 7.0]


def test_read_split_defaults_to_the_stored_schema_and_checks_a_given_one(digits_csv, tmp_path):
    result = preprocess(digits_csv, str(tmp_path), SCHEMA)
    assert dataset_schema(result.dataset_url) == SCHEMA
    x1, y1 = read_split(result.dataset_url, "test")
    x2, y2 = read_split(result.dataset_url, "test", SCHEMA)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    manifest = json.loads(read_bytes(join(result.dataset_url, "_manifest.json")))
    assert manifest["schema"] == SCHEMA.to_json()

    as_regression = TableSchema(features=SCHEMA.features, label=SCHEMA.label, task="regression")
    with pytest.raises(SchemaError, match="task 'classification'"):
        read_split(result.dataset_url, "test", as_regression)
    as_category = TableSchema(
        features=(Column(name="p0", dtype="category", categories=("0",)),), label=SCHEMA.label
    )
    with pytest.raises(SchemaError, match=r"\['p0'\]"):
        read_split(result.dataset_url, "test", as_category)
