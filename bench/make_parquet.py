"""Write a synthetic preprocessed dataset of a given size, for the input-pipeline benchmark.

The dataset has the layout ``storage.dataset.preprocess`` writes (``{split}/part-NNNNN.parquet``
shards and ``_manifest.json`` last, with every shard's size and SHA-256), so ``DataSpec``,
``read_split`` and the streaming reader take it as they take any preprocessed dataset. Rows are
``features`` float32 columns ``f0 ..`` of standard normal values and an int64 ``label`` (the
argmax of a fixed random projection, so a model can learn it), generated one row group at a
time: the script never holds more than one row group.

    python -m bench.make_parquet /tmp/ringflow-bench --gb 4

Never commit its output.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ringflow.storage.dataset import (
    SPLITS,
    Column,
    TableSchema,
    commit_manifest,
    row_group_entries,
)
from ringflow.storage.fs import join, resolve

__all__ = ["schema", "write_dataset"]

FRACTIONS = (0.9, 0.05, 0.05)


def schema(features: int, classes: int) -> TableSchema:
    """The synthetic dataset's schema: ``f0 .. f{features-1}`` and ``label``."""
    return TableSchema(
        features=tuple(Column(name=f"f{i}", dtype="float") for i in range(features)),
        label=Column(name="label", dtype="int", min=0, max=classes - 1),
    )


def write_dataset(
    root: str,
    *,
    rows: int,
    features: int = 64,
    classes: int = 10,
    rows_per_group: int = 65_536,
    groups_per_shard: int = 8,
    seed: int = 0,
) -> str:
    """Write ``rows`` rows under ``{root}/datasets/{fingerprint}``; return the dataset URL.

    A dataset already committed there (same arguments) is returned as it is.
    """
    identity = {
        "rows": rows,
        "features": features,
        "classes": classes,
        "rows_per_group": rows_per_group,
        "groups_per_shard": groups_per_shard,
        "seed": seed,
    }
    fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    url = join(root, "datasets", fingerprint)
    fs, path = resolve(url)
    if fs.exists(join(path, "_manifest.json")):
        return url
    table_schema = schema(features, classes)
    projection = np.random.default_rng(seed).standard_normal((features, classes))
    counts = np.rint(rows * np.cumsum(FRACTIONS)).astype(int)
    bounds = dict(zip(SPLITS, zip([0, *counts[:2]], counts, strict=True), strict=True))
    files = []
    for split, (start, end) in bounds.items():
        files += _write_split(
            fs, path, split, range(start, end), table_schema, projection, identity
        )
    commit_manifest(
        url,
        schema=table_schema,
        files=files,
        fingerprint=fingerprint,
        source_url=f"synthetic:{json.dumps(identity, sort_keys=True)}",
        fractions=FRACTIONS,
        seed=seed,
    )
    return url


def _write_split(fs, path, split, rows, table_schema, projection, identity) -> list[dict]:
    group_rows = identity["rows_per_group"]
    shard_rows = group_rows * identity["groups_per_shard"]
    files = []
    for number, first in enumerate(range(rows.start, max(rows.stop, rows.start + 1), shard_rows)):
        name = f"{split}/part-{number:05d}.parquet"
        last = min(first + shard_rows, rows.stop)
        fs.makedirs(join(path, split), exist_ok=True)
        with fs.open(join(path, name), "wb") as f:
            writer = None
            for start in range(first, max(last, first + 1), group_rows):
                table = _rows(
                    start, min(start + group_rows, last), table_schema, projection, identity
                )
                writer = writer or pq.ParquetWriter(f, table.schema)
                writer.write_table(table, row_group_size=group_rows)
            writer.close()
        files.append(
            {"split": split, "path": name, "rows": last - first, **_digest(fs, path, name)}
        )
    return files


def _rows(start, end, table_schema, projection, identity) -> pa.Table:
    # Seeded by the row group's first row: the data does not depend on how it is sharded.
    rng = np.random.default_rng([identity["seed"], start])
    x = rng.standard_normal((max(end - start, 0), identity["features"]), dtype=np.float32)
    y = np.argmax(x @ projection, axis=1).astype(np.int64)
    columns = {c.name: x[:, i] for i, c in enumerate(table_schema.features)}
    return pa.table({**columns, "label": y})


def _digest(fs, path, name) -> dict:
    digest, size = hashlib.sha256(), 0
    with fs.open(join(path, name), "rb") as f:
        while chunk := f.read(2**24):
            digest.update(chunk)
            size += len(chunk)
        f.seek(0)
        metadata = pq.read_metadata(f)

        def read(offset: int, count: int) -> bytes:
            f.seek(offset)
            return f.read(count)

        groups = row_group_entries(metadata, read)
    return {"size": size, "sha256": digest.hexdigest(), "row_groups": groups}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="directory (or fsspec URL) under which datasets/ is made")
    parser.add_argument("--gb", type=float, default=4.0, help="size of the rows, in GiB")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--rows-per-group", type=int, default=65_536)
    parser.add_argument("--groups-per-shard", type=int, default=8)
    args = parser.parse_args(argv)
    rows = int(args.gb * 2**30 / (4 * args.features + 8))
    url = write_dataset(
        args.root,
        rows=rows,
        features=args.features,
        classes=args.classes,
        rows_per_group=args.rows_per_group,
        groups_per_shard=args.groups_per_shard,
    )
    print(json.dumps({"dataset_url": url, "rows": rows}), file=sys.stdout)


if __name__ == "__main__":
    main()
