"""storage.dataset.infer_schema: a user's own CSV or Parquet file, of any shape."""

from __future__ import annotations

import gzip

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from ringflow.storage.dataset import (
    Column,
    DataError,
    SchemaError,
    TableSchema,
    dataset_schema,
    infer_schema,
    preprocess,
    read_split,
)

SPLITS = ("train", "validation", "test")


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _regression_csv(path, rows: int = 200) -> str:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(rows, 2)).round(4)
    y = (3 * x[:, 0] - x[:, 1] + 0.5).round(4)
    lines = ["a,b,target"] + [f"{p},{q},{t}" for (p, q), t in zip(x, y, strict=True)]
    return _write(path, "\n".join(lines) + "\n")


def test_numeric_columns_and_a_class_label(tmp_path):
    source = _write(
        tmp_path / "s.csv",
        "x1,x2,x3,label\n1,0.5,-3,0\n2,1.5,4,2\n3,2,5,1\n4,2.25,6,2\n",
    )
    schema = infer_schema(source)

    assert schema.features == (
        Column(name="x1", dtype="int"),
        Column(name="x2", dtype="float"),
        Column(name="x3", dtype="int"),
    )
    assert schema.label == Column(name="label", dtype="int", min=0, max=2)
    assert schema.task == "classification"
    assert schema.classes == 3
    assert schema.input_dim == 3
    assert TableSchema.from_json(schema.to_json()) == schema


def test_float_target_is_a_regression_read_as_float32(tmp_path):
    source = _regression_csv(tmp_path / "r.csv")
    schema = infer_schema(source, label="target")
    assert schema.task == "regression"
    assert schema.classes is None
    assert schema.label == Column(name="target", dtype="float")

    result = preprocess(source, str(tmp_path / "out"), schema)
    assert result.rejected_rows == 0
    features, labels = read_split(result.dataset_url, "train")
    assert features.dtype == np.float32
    assert features.shape == (result.rows["train"], 2)
    assert labels.dtype == np.float32
    np.testing.assert_allclose(labels, 3 * features[:, 0] - features[:, 1] + 0.5, atol=1e-3)
    assert dataset_schema(result.dataset_url) == schema


def test_int_label_task_rules(tmp_path):
    negative = _write(tmp_path / "n.csv", "x,y\n1,-1\n2,3\n")
    assert infer_schema(negative, label="y").task == "regression"
    many = _write(tmp_path / "m.csv", "x,y\n" + "".join(f"{i},{i}\n" for i in range(1001)))
    assert infer_schema(many, label="y").task == "regression"
    assert infer_schema(many, label="y", task="classification").classes == 1001
    few = _write(tmp_path / "f.csv", "x,y\n" + "".join(f"{i},{i % 7}\n" for i in range(1001)))
    assert infer_schema(few, label="y").classes == 7
    assert infer_schema(few, label="y", task="regression").label == Column(name="y", dtype="int")


def test_text_column_becomes_a_category(tmp_path):
    source = _write(
        tmp_path / "s.csv",
        "size,color,label\n1.5, red ,0\n2,green,1\n3,blue,0\n4,,1\n5,red,1\n",
    )
    schema = infer_schema(source)
    color = schema.features[1]
    assert color == Column(name="color", dtype="category", categories=("blue", "green", "red"))

    result = preprocess(source, str(tmp_path / "out"), schema, fractions=(1, 0, 0))
    rejected = pq.read_table(result.rejected_url).to_pylist()
    reasons = [(r["source_row"], r["reason"]) for r in rejected]
    assert reasons == [(4, "column color: value is missing")]
    features, labels = read_split(result.dataset_url, "train")
    rows = sorted(zip(features[:, 0].tolist(), features[:, 1].tolist(), strict=True))
    assert rows == [(1.5, 2.0), (2.0, 1.0), (3.0, 0.0), (5.0, 2.0)]  # codes as floats
    assert labels.dtype == np.int64


def test_text_label_is_a_classification_by_category(tmp_path):
    source = _write(tmp_path / "s.csv", "x,animal\n1,dog\n2,cat\n3,dog\n4,emu\n")
    schema = infer_schema(source, label="animal")
    assert schema.task == "classification"
    assert schema.classes == 3
    assert schema.label.categories == ("cat", "dog", "emu")
    result = preprocess(source, str(tmp_path / "out"), schema, fractions=(1, 0, 0))
    _, labels = read_split(result.dataset_url, "train")
    assert sorted(labels.tolist()) == [0, 1, 1, 2]


def test_categorical_bounds_and_bad_values_that_stay_numeric(tmp_path):
    source = _write(
        tmp_path / "s.csv", "zip,age,label\n02134,30,0\n10001,n/a,1\n02134,41,1\n94105,-2,0\n"
    )
    schema = infer_schema(source, categorical=["zip"], bounds={"age": [0, None]})
    assert schema.features == (
        Column(name="zip", dtype="category", categories=("02134", "10001", "94105")),
        Column(name="age", dtype="int", min=0),
    )
    result = preprocess(source, str(tmp_path / "out"), schema, fractions=(1, 0, 0))
    rejected = pq.read_table(result.rejected_url).to_pylist()
    assert [(r["source_row"], r["reason"]) for r in rejected] == [
        (2, "column age: 'n/a' is not a number"),
        (4, "column age: -2 is below the minimum 0"),
    ]


def test_features_subset_in_the_given_order(tmp_path):
    source = _write(tmp_path / "s.csv", "id,x1,note,x2,label\n1,2,hello,3,0\n2,3,bye,4,1\n")
    schema = infer_schema(source, features=["x2", "x1"])
    assert [c.name for c in schema.features] == ["x2", "x1"]
    result = preprocess(source, str(tmp_path / "out"), schema, fractions=(1, 0, 0))
    features, _ = read_split(result.dataset_url, "train")
    assert sorted(features.tolist()) == [[3.0, 2.0], [4.0, 3.0]]


def test_missing_label_names_it_and_lists_the_columns(tmp_path):
    source = _write(tmp_path / "s.csv", "a,b,target\n1,2,3\n")
    with pytest.raises(SchemaError) as info:
        infer_schema(source)
    message = str(info.value)
    assert "'label'" in message
    assert "columns found: ['a', 'b', 'target']" in message
    assert "Set label" in message
    assert "\n" not in message


def test_missing_feature_and_bad_arguments(tmp_path):
    source = _write(tmp_path / "s.csv", "a,b,label\n1,2,0\n")
    with pytest.raises(SchemaError, match=r"\['z'\]; columns found: \['a', 'b', 'label'\]"):
        infer_schema(source, features=["a", "z"])
    with pytest.raises(ValueError, match="features lists the label column 'label'"):
        infer_schema(source, features=["a", "label"])
    with pytest.raises(ValueError, match=r"bounds names \['c'\]"):
        infer_schema(source, bounds={"c": [0, 1]})
    with pytest.raises(ValueError, match=r"bounds\['a'\] must be \[min, max\]"):
        infer_schema(source, bounds={"a": [0]})
    with pytest.raises(ValueError, match=r"categorical names \['c'\]"):
        infer_schema(source, categorical=["c"])
    with pytest.raises(ValueError, match="task must be"):
        infer_schema(source, task="ranking")
    with pytest.raises(DataError, match="does not exist"):
        infer_schema(str(tmp_path / "nope.csv"))
    assert not list(tmp_path.glob("datasets"))  # nothing written


def test_task_that_contradicts_the_label(tmp_path):
    source = _write(tmp_path / "s.csv", "x,price,kind\n1,2.5,a\n2,3,b\n")
    with pytest.raises(ValueError, match=r"task='classification'.*2\.5.*task='regression'"):
        infer_schema(source, label="price", features=["x"], task="classification")
    with pytest.raises(ValueError, match=r"task='regression'.*kind.*task='classification'"):
        infer_schema(source, label="kind", features=["x"], task="regression")


def test_same_file_gives_the_same_schema_and_fingerprint(tmp_path):
    source = _write(tmp_path / "s.csv", "b,a,c,label\n1,x,0.5,1\n2,y,1.5,0\n3,x,2,1\n4,z,3,0\n")
    first = infer_schema(source)
    copy = _write(tmp_path / "copy.csv", (tmp_path / "s.csv").read_text())
    second = infer_schema(copy)
    assert first == second
    assert first.to_json() == second.to_json()
    one = preprocess(source, str(tmp_path / "one"), first)
    two = preprocess(copy, str(tmp_path / "two"), second)
    assert one.fingerprint == two.fingerprint


def test_regression_split_is_seeded_and_covers_every_row_once(tmp_path):
    source = _regression_csv(tmp_path / "r.csv", rows=101)
    schema = infer_schema(source, label="target")
    first = preprocess(source, str(tmp_path / "one"), schema, seed=5)
    again = preprocess(source, str(tmp_path / "two"), schema, seed=5)
    other = preprocess(source, str(tmp_path / "one"), schema, seed=6)

    assert first.rows == {"train": 81, "validation": 10, "test": 10}
    together = np.concatenate([read_split(first.dataset_url, s)[1] for s in SPLITS])
    expected = pd.read_csv(source)["target"].to_numpy(np.float32)
    np.testing.assert_array_equal(np.sort(together), np.sort(expected))
    for split in SPLITS:
        np.testing.assert_array_equal(
            read_split(first.dataset_url, split)[0], read_split(again.dataset_url, split)[0]
        )
    assert not np.array_equal(
        np.sort(read_split(first.dataset_url, "test")[1]),
        np.sort(read_split(other.dataset_url, "test")[1]),
    )


def test_parquet_with_a_string_column(tmp_path):
    frame = pd.DataFrame(
        {
            "height": [1.0, 2.5, None, 4.0, 5.5, 6.0],
            "city": ["Oslo", "Lima", "Oslo", "Pune", "Lima", "Oslo"],
            "label": [0, 1, 1, 0, 1, 0],
        },
        index=[10, 11, 12, 13, 14, 15],  # stored as __index_level_0__, not a feature
    )
    path = tmp_path / "s.parquet"
    frame.to_parquet(path)
    schema = infer_schema(str(path))
    assert schema.features == (
        Column(name="height", dtype="float"),
        Column(name="city", dtype="category", categories=("Lima", "Oslo", "Pune")),
    )
    assert schema.classes == 2

    result = preprocess(str(path), str(tmp_path / "out"), schema, fractions=(1, 0, 0))
    assert result.rejected_rows == 1  # the missing height
    features, labels = read_split(result.dataset_url, "train")
    assert sorted(zip(features[:, 1].tolist(), labels.tolist(), strict=True)) == [
        (0.0, 1),
        (0.0, 1),
        (1.0, 0),
        (1.0, 0),
        (2.0, 0),
    ]


def test_parquet_directory_and_gzipped_csv(tmp_path):
    frame = pd.DataFrame({"x": [1, 2, 3, 4], "tag": ["a", "b", "a", "c"], "y": [0.5, 1, 2, 3]})
    folder = tmp_path / "parts"
    folder.mkdir()
    frame.iloc[:2].to_parquet(folder / "part-0.parquet", index=False)
    frame.iloc[2:].to_parquet(folder / "part-1.parquet", index=False)
    gz = tmp_path / "s.csv.gz"
    gz.write_bytes(gzip.compress(frame.to_csv(index=False).encode()))

    from_parquet = infer_schema(str(folder), label="y")
    assert from_parquet == infer_schema(str(gz), label="y")
    assert from_parquet.task == "regression"
    assert from_parquet.features[1].categories == ("a", "b", "c")


def test_empty_column_and_unnamed_header_column(tmp_path):
    empty = _write(tmp_path / "e.csv", "a,b,label\n1,,0\n2, ,1\n")
    with pytest.raises(SchemaError, match="column b is empty in every row"):
        infer_schema(empty)
    assert infer_schema(empty, features=["a"]).input_dim == 1
    unnamed = _write(tmp_path / "u.csv", ",a,label\n0,1,0\n1,2,1\n")
    with pytest.raises(SchemaError, match="column 1 of the header has no name"):
        infer_schema(unnamed)
    assert infer_schema(unnamed, features=["a"]).input_dim == 1
