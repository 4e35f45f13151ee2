"""What a preprocessed table is: its columns (:class:`Column`, :class:`TableSchema`), the
splits it is cut into, the result of preprocessing it, and the errors its data can raise;
shared by both preprocessing engines and every reader.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

SPLITS = ("train", "validation", "test")


FORMAT = "ringflow.dataset/1"


MANIFEST = "_manifest.json"


REJECTED = "rejected.parquet"


# A finite decimal or scientific number, or a spelled-out non-finite one (rejected later with
# its own reason, so "nan" is reported as "not finite" rather than "not a number").
NUMBER_PATTERN = r"^[+-]?((\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|nan|inf|infinity)$"


# Beyond these magnitudes a value would be silently changed by its storage type: float32
# overflows to inf, and int columns pass through float64, exact only up to 2**53.
LIMITS = {"float": float(np.finfo(np.float32).max), "int": 2.0**53}


ENGINES = ("auto", "local", "ray")
"""How :func:`preprocess` runs: ``"local"`` in this process, ``"ray"`` as a Ray Data job
(:mod:`ringflow.storage.ray_preprocess`), ``"auto"`` chooses (:func:`choose_engine`)."""


TASKS = ("classification", "regression")
"""What a dataset's label is: a class id to predict, or a number."""


@dataclass(frozen=True, kw_only=True)
class Column:
    """One column of a table: its name, type and the values it accepts."""

    name: str
    """Header name in the source file."""
    dtype: Literal["float", "int", "category"]
    """``"float"`` is stored as float32, ``"int"`` as int64 and accepts integral values only,
    ``"category"`` accepts one of ``categories`` and is stored as its index (int64)."""
    min: float | None = None
    """Smallest accepted value (inclusive); ``None`` for no lower bound. Numbers only."""
    max: float | None = None
    """Largest accepted value (inclusive); ``None`` for no upper bound. Numbers only."""
    categories: tuple[str, ...] | None = None
    """The values a ``"category"`` column accepts, in the order of their codes."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("Column name must be a non-empty string")
        if self.dtype not in ("float", "int", "category"):
            raise ValueError(
                f"column {self.name}: dtype must be 'float', 'int' or 'category', "
                f"got {self.dtype!r}"
            )
        # Normalised so that min=0 and min=0.0 describe (and fingerprint) the same schema.
        for bound in ("min", "max"):
            value = getattr(self, bound)
            if value is not None:
                object.__setattr__(self, bound, float(value))
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"column {self.name}: min {self.min} is greater than max {self.max}")
        if self.dtype == "category":
            if not self.categories or self.min is not None or self.max is not None:
                raise ValueError(
                    f"column {self.name}: a category column lists its categories and has no "
                    "min or max"
                )
            object.__setattr__(self, "categories", tuple(str(c) for c in self.categories))
            if len(set(self.categories)) != len(self.categories):
                raise ValueError(f"column {self.name}: categories must be unique")
        elif self.categories is not None:
            raise ValueError(f"column {self.name}: only a 'category' column has categories")


@dataclass(frozen=True, kw_only=True)
class TableSchema:
    """The columns a source must provide: model inputs and the target to predict."""

    features: tuple[Column, ...]
    """Model inputs, in the order :func:`read_split` returns them."""
    label: Column
    """The target: a class id (an ``"int"`` from 0, or a ``"category"``) for classification,
    a number for regression."""
    task: Literal["classification", "regression"] = "classification"
    """Classification (splits are stratified by class) or regression."""
    classes: int | None = None
    """Classification: the number of classes, labels ``0 .. classes - 1``; ``None`` means
    ``label.max + 1`` (or the number of categories)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", tuple(self.features))
        if not self.features:
            raise ValueError("TableSchema needs at least one feature column")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        names = [c.name for c in self.columns]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"TableSchema column names must be unique; repeated: {duplicates}")
        if self.task == "regression":
            if self.label.dtype == "category":
                raise ValueError(
                    f"label column {self.label.name} is a category: use task 'classification'"
                )
            if self.classes is not None:
                raise ValueError("classes is for classification; a regression has none")
            return
        if self.label.dtype == "float":
            raise ValueError(
                f"label column {self.label.name} has dtype 'float': a class label is an 'int' "
                "or a 'category'; use task 'regression' to predict a number"
            )
        if self.classes is None:
            object.__setattr__(self, "classes", self._classes_from_label())
        if isinstance(self.classes, bool) or not isinstance(self.classes, int) or self.classes < 1:
            raise ValueError(f"classes must be a positive integer, got {self.classes!r}")

    def _classes_from_label(self) -> int | None:
        if self.label.categories is not None:
            return len(self.label.categories)
        return None if self.label.max is None else int(self.label.max) + 1

    @property
    def columns(self) -> tuple[Column, ...]:
        """All columns, features first, then the label."""
        return (*self.features, self.label)

    @property
    def input_dim(self) -> int:
        """The number of feature columns: the width of a model's input."""
        return len(self.features)

    def to_json(self) -> dict[str, Any]:
        """A JSON object that :meth:`from_json` turns back into this schema."""
        return {
            "features": [_column_json(c) for c in self.features],
            "label": _column_json(self.label),
            "task": self.task,
            "classes": self.classes,
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> TableSchema:
        """The schema recorded by :meth:`to_json` (in a manifest or a model checkpoint)."""
        return cls(
            features=tuple(_column_from_json(c) for c in value["features"]),
            label=_column_from_json(value["label"]),
            task=value.get("task", "classification"),
            classes=value.get("classes"),
        )


def _column_json(column: Column) -> dict[str, Any]:
    value = asdict(column)
    if column.categories is None:
        del value["categories"]
    else:
        value["categories"] = list(column.categories)
    return value


def _column_from_json(value: dict[str, Any]) -> Column:
    categories = value.get("categories")
    return Column(**{**value, "categories": None if categories is None else tuple(categories)})


class DataError(ValueError):
    """A source or dataset cannot be used; the message says what to fix."""


class SchemaError(DataError):
    """The columns of a file do not match the schema."""


@dataclass(frozen=True, kw_only=True)
class PreprocessResult:
    """What :func:`preprocess` wrote (or found already written)."""

    dataset_url: str
    """URL of the committed dataset directory; pass it to :func:`read_split`."""
    fingerprint: str
    """SHA-256 hex digest of the source bytes, schema, split fractions and seed."""
    rows: dict[str, int]
    """Rows per split: ``{"train": n, "validation": n, "test": n}``."""
    source_rows: int
    """Data rows read from the source, valid and rejected."""
    rejected_rows: int
    """Rows that failed validation and were written to ``rejected_url``."""
    rejected_url: str | None
    """Parquet file of rejected rows with their reasons; ``None`` if no row was rejected."""


def check_engine(engine: Any) -> None:
    if engine not in ENGINES:
        raise ValueError(
            f"engine must be one of {', '.join(repr(e) for e in ENGINES)} (preprocess in this "
            f"process, with Ray Data, or chosen by size and RAY_ADDRESS), got {engine!r}"
        )
