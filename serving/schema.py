"""What a served model takes and answers: the request's features (named, by the data schema a
checkpoint records, or the module's ``input_schema``) and the answer's form (its
``predict_step``'s output, a class with probabilities, or a value). Every bad request is a
:class:`BadRequest` naming what is wrong.
"""

# No ``from __future__ import annotations`` here: Serve pickles ModelServer by value, and
# FastAPI must then resolve its routes' annotations (``request: Request``) as objects, since
# the pickled methods' globals no longer hold every name a string annotation could refer to.

import inspect
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from ringflow.storage.checkpoint import ModelCheckpoint
from ringflow.storage.dataset import TableSchema

_MAX_INSTANCES = 1024


_INSTANCES = "instances"


class ServingError(RuntimeError):
    """The model cannot be deployed or does not answer once deployed."""


class BadRequest(Exception):
    """A request the server refuses; becomes ``{"error": message}`` with ``status``."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _finite(value: Any, where: str) -> float:
    """``value`` as a finite float, or a 400 naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{where} must be a number, found {json_type(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf if value > 0 else -math.inf
    if not math.isfinite(number):
        raise BadRequest(f"{where} must be a finite number, found {value!r}")
    return number


def _check_range(number: float, value: Any, low: float | None, high: float | None, where: str):
    if (low is not None and number < low) or (high is not None and number > high):
        raise BadRequest(f"{where} = {value!r} is outside [{low}, {high}]")


def _listing(names: Any, most: int = 20) -> str:
    """``names`` as a list for a message, cut after ``most``."""
    names = list(names)
    if len(names) <= most:
        return repr(names)
    return repr(names[:most])[:-1] + f", ...] ({len(names)} in all)"


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """A tensor input declared by the module's ``input_schema``: one named array of numbers.

    One input is ``{name: [...]}``, several are ``{"instances": [[...], ...]}``.
    """

    name: str
    shape: tuple[int, ...]
    low: float | None
    high: float | None
    declared: dict[str, Any]
    """The ``input_schema`` as the module declares it, for ``GET /model``."""

    @classmethod
    def of(cls, schema: Any, where: str) -> "InputSpec":
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
            raise ServingError(
                f"{where}.input_schema must be a dict with a 'name' and a 'shape', got {schema!r}"
            )
        shape = schema.get("shape")
        if not isinstance(shape, list | tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape
        ):
            raise ServingError(f"{where}.input_schema shape must be positive ints: {shape!r}")
        low, high = schema.get("min"), schema.get("max")
        return cls(
            name=schema["name"],
            shape=tuple(shape),
            low=None if low is None else float(low),
            high=None if high is None else float(high),
            declared=dict(schema),
        )

    @property
    def signature(self) -> tuple:
        """What clients send; a swap must keep it."""
        return ("tensor", self.name, self.shape)

    def summary(self) -> str:
        return f"{self.name!r} of shape {list(self.shape)}"

    def describe(self) -> dict[str, Any]:
        return {**self.declared, "kind": "tensor"}

    def parse(self, payload: dict[str, Any]) -> tuple[list[list[float]], bool]:
        """The rows of a request body, and whether it was one input (not ``instances``)."""
        has_single, has_batch = self.name in payload, _INSTANCES in payload
        if has_single == has_batch:
            raise BadRequest(
                f"request body must have exactly one of the keys {self.name!r} (one "
                f"input) or {_INSTANCES!r} (a list of inputs); found keys {sorted(payload)}"
            )
        if has_single:
            return [self.row(payload[self.name], self.name)], True
        return _instances(self, payload[_INSTANCES]), False

    def row(self, value: Any, where: str) -> list[float]:
        """Check one input against the shape and range; return its numbers flattened."""
        out: list[float] = []
        self._collect(value, self.shape, where, out)
        return out

    def probe_row(self) -> list[float]:
        value = self.low if self.low is not None else min(0.0, self.high or 0.0)
        return [value] * math.prod(self.shape)

    def tensor(self, rows: list[list[float]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), *self.shape)

    def _collect(self, value: Any, shape: tuple[int, ...], where: str, out: list[float]) -> None:
        if not shape:
            number = _finite(value, where)
            _check_range(number, value, self.low, self.high, where)
            out.append(number)
            return
        if not isinstance(value, list):
            raise BadRequest(
                f"{where} must be an array of {shape[0]} {_element(shape[1:])}, "
                f"found {json_type(value)}"
            )
        if len(value) != shape[0]:
            raise BadRequest(
                f"{where} has the wrong length: expected {shape[0]} {_element(shape[1:])}, "
                f"found {len(value)}"
            )
        for i, item in enumerate(value):
            self._collect(item, shape[1:], f"{where}[{i}]", out)


def _element(shape: tuple[int, ...]) -> str:
    return "numbers" if not shape else f"arrays of shape {list(shape)}"


# Beyond these magnitudes the float32 model input would change the value: float32
# overflows to inf; integers are exact in the dataset only up to 2**53.
_FEATURE_LIMITS = {"float": float(torch.finfo(torch.float32).max), "int": 2.0**53}


@dataclass(frozen=True, kw_only=True)
class _Feature:
    """One feature column of the recorded data schema, as a request must give it."""

    name: str
    dtype: str
    low: float | None
    high: float | None
    categories: tuple[str, ...] | None

    def value(self, value: Any, where: str) -> float:
        """The model's number for one request value: the number itself or the category code."""
        if self.categories is not None:
            return self._code(value, where)
        number = _finite(value, where)
        if self.dtype == "int" and not number.is_integer():
            raise BadRequest(
                f"{where} must be an integer (column {self.name} is 'int'), found {value!r}"
            )
        if abs(number) > _FEATURE_LIMITS[self.dtype]:
            raise BadRequest(f"{where} = {value!r} is too large for an {self.dtype!r} column")
        _check_range(number, value, self.low, self.high, where)
        return number

    def _code(self, value: Any, where: str) -> float:
        assert self.categories is not None
        allowed = _listing(self.categories)
        if not isinstance(value, str):
            raise BadRequest(
                f"{where} must be one of the categories of column {self.name} (a string), "
                f"found {json_type(value)}; allowed: {allowed}"
            )
        try:
            return float(self.categories.index(value))
        except ValueError:
            raise BadRequest(
                f"{where}: unknown category {value!r} for column {self.name}; allowed: {allowed}"
            ) from None

    def example(self) -> Any:
        """A valid value, for the self-check and ``GET /model``."""
        if self.categories is not None:
            return self.categories[0]
        if self.dtype == "int":
            if self.low is not None:
                return math.ceil(self.low)
            return 0 if self.high is None else math.floor(min(0.0, self.high))
        return self.low if self.low is not None else min(0.0, self.high or 0.0)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "type": self.dtype}
        if self.categories is not None:
            out["categories"] = list(self.categories)
        else:
            out |= {"min": self.low, "max": self.high}
        return out


@dataclass(frozen=True, kw_only=True)
class TableInput:
    """Named features from the data schema recorded at training (``meta["data_schema"]``).

    One input is an object of features (``{"x1": 0.3, "color": "red"}``); several are
    ``{"instances": [...]}``, each an object of features or an array in schema order. A
    category feature is sent as its category string and fed to the model as its code.
    """

    features: tuple[_Feature, ...]

    @classmethod
    def of(cls, schema: TableSchema) -> "TableInput":
        return cls(
            features=tuple(
                _Feature(name=c.name, dtype=c.dtype, low=c.min, high=c.max, categories=c.categories)
                for c in schema.features
            )
        )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)

    @property
    def signature(self) -> tuple:
        """What clients send, and what the model makes of a category: a swap must keep it."""
        return ("table", tuple((f.name, f.dtype, f.categories) for f in self.features))

    def summary(self) -> str:
        return "features " + _listing(
            f"{f.name} ({f.dtype}{'' if f.categories is None else ': ' + '|'.join(f.categories)})"
            for f in self.features
        )

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "table",
            "features": [f.describe() for f in self.features],
            "example": {f.name: f.example() for f in self.features},
        }

    def parse(self, payload: dict[str, Any]) -> tuple[list[list[float]], bool]:
        """The rows of a request body, and whether it was one input (not ``instances``)."""
        # A feature may itself be named "instances": its value is never an array.
        batch = _INSTANCES in payload and (
            _INSTANCES not in self.names or isinstance(payload[_INSTANCES], list)
        )
        if not batch:
            return [self._named(payload, "request body", "")], True
        extra = sorted(set(payload) - {_INSTANCES})
        if extra:
            raise BadRequest(
                f"request body must have either the key {_INSTANCES!r} (a list of inputs) or "
                f"the features of one input, not both; found also {_listing(extra)}"
            )
        return _instances(self, payload[_INSTANCES]), False

    def row(self, value: Any, where: str) -> list[float]:
        """One input of ``instances``: an object of features or an array in schema order."""
        if isinstance(value, dict):
            return self._named(value, where, f"{where}.")
        if not isinstance(value, list):
            raise BadRequest(
                f"{where} must be an object of features or an array of {len(self.features)} "
                f"values in the order {_listing(self.names)}, found {json_type(value)}"
            )
        if len(value) != len(self.features):
            raise BadRequest(
                f"{where} has the wrong length: expected {len(self.features)} values in the "
                f"order {_listing(self.names)}, found {len(value)}"
            )
        return [
            f.value(v, f"{where}[{i}] ({f.name})")
            for i, (f, v) in enumerate(zip(self.features, value, strict=True))
        ]

    def probe_row(self) -> list[float]:
        return self._named({f.name: f.example() for f in self.features}, "probe", "")

    def tensor(self, rows: list[list[float]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), len(self.features))

    def _named(self, value: dict[str, Any], where: str, prefix: str) -> list[float]:
        missing = [n for n in self.names if n not in value]
        unknown = sorted(set(value) - set(self.names))
        problems = []
        if missing:
            problems.append(
                f"{where} is missing the feature(s) {_listing(missing)}; every feature is "
                f"required: {_listing(self.names)}"
            )
        if unknown:
            problems.append(
                f"{where} has unknown feature(s) {_listing(unknown)}; the features are "
                f"{_listing(self.names)}"
            )
        if problems:
            raise BadRequest("; ".join(problems))
        return [f.value(value[f.name], f"{prefix}{f.name}") for f in self.features]


def json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a finite number and is not allowed")


def parse_json(body: bytes) -> Any:
    if not body.strip():
        raise BadRequest("request body is empty: send a JSON object")
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:
        raise BadRequest(f"request body is not valid JSON: {err}") from err


def finite_json(value: Any) -> Any:
    """``value`` with non-finite floats as ``None``, which strict JSON can carry."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value


# Keys of an answer besides the label: ``output_name`` may not take one of them.
_RESERVED_OUTPUT_NAMES = ("probabilities", "model", _INSTANCES, "predictions")


def _custom_predict_step(module: torch.nn.Module) -> bool:
    """Whether the module defines its own ``predict_step`` (not Lightning's default one)."""
    for cls in type(module).__mro__:
        if "predict_step" in vars(cls):
            return not cls.__module__.startswith(("lightning.", "pytorch_lightning."))
    return False


def _call_predict_step(module: torch.nn.Module, x: torch.Tensor) -> Any:
    """``module.predict_step(x, 0)``, or ``(x)`` for a step that takes no batch index."""
    step = module.predict_step
    try:
        inspect.signature(step).bind(x, 0)
    except (TypeError, ValueError):
        return step(x)
    return step(x, 0)


def _per_row(out: Any, n: int) -> list[Any]:
    """A tensor, or a dict of them, with a first dimension of ``n`` as ``n`` JSON values."""
    if isinstance(out, torch.Tensor):
        if out.ndim == 0 or out.shape[0] != n:
            raise ValueError(
                f"predict_step gave a tensor of shape {list(out.shape)} for {n} input(s); "
                f"it must have one row per input, a first dimension of {n}"
            )
        return out.detach().cpu().tolist()
    if isinstance(out, dict) and out and all(isinstance(k, str) for k in out):
        columns = {k: _per_row(v, n) for k, v in out.items()}
        return [{k: column[i] for k, column in columns.items()} for i in range(n)]
    raise ValueError(
        "predict_step must return a tensor or a dict of tensors (string keys), one row per "
        f"input; it returned {type(out).__name__}"
    )


@dataclass(frozen=True, kw_only=True)
class OutputSpec:
    """What an answer holds, from the module and the recorded data schema.

    ``prediction``: the module's own ``predict_step`` output for the row. ``classification``:
    ``{key: class id or category string, "probabilities": softmax}``, where ``key`` is the
    module's ``output_name`` or ``"label"``. ``regression``: ``{"value": float}``.
    """

    kind: str
    key: str
    """The answer's main key: the label's name, ``"value"`` or ``"prediction"``."""
    classes: int | None = None
    categories: tuple[str, ...] | None = None
    """The label's categories, answered instead of their codes."""
    label_column: str | None = None

    @property
    def signature(self) -> tuple:
        """What clients read; a swap must keep it."""
        return (self.kind, self.key)

    def summary(self) -> str:
        return f"with {self.key!r} ({self.kind})"

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"task": self.kind, "keys": [self.key]}
        if self.kind == "classification":
            out["keys"].append("probabilities")
            out |= {"classes": self.classes, "label_column": self.label_column}
            if self.categories is not None:
                out["categories"] = list(self.categories)
        elif self.kind == "regression":
            out["label_column"] = self.label_column
        return out

    def raw(self, module: torch.nn.Module, x: torch.Tensor) -> Any:
        with torch.inference_mode():
            if self.kind == "prediction":
                return _call_predict_step(module, x)
            return module(x)

    def check(self, out: Any, n: int) -> None:
        """Raise ValueError unless ``out`` is what this answer needs for ``n`` inputs."""
        if self.kind == "prediction":
            _per_row(out, n)
            return
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"forward returned {type(out).__name__}, not a tensor")
        if self.kind == "regression":
            fits, expected = tuple(out.shape) in ((n,), (n, 1)), f"[{n}] or [{n}, 1]"
        else:
            fits = out.ndim == 2 and out.shape[0] == n
            fits = fits and self.classes in (None, out.shape[1])
            expected = f"[{n}, {self.classes or 'classes'}]"
        if not fits:
            raise ValueError(
                f"a valid input gave scores of shape {list(out.shape)}, expected {expected}"
                + ("" if self.classes is None else f" ({self.classes} classes in the data)")
            )
        if not bool(torch.isfinite(out).all()):
            raise ValueError(f"a valid input gave non-finite scores of shape {list(out.shape)}")

    def answers(self, module: torch.nn.Module, x: torch.Tensor) -> list[dict[str, Any]]:
        columns = self.columns(module, x)
        rows = zip(*(_as_list(v) for v in columns.values()), strict=True)
        return [dict(zip(columns, row, strict=True)) for row in rows]

    def columns(self, module: torch.nn.Module, x: torch.Tensor) -> dict[str, Any]:
        """The answers to the ``n`` inputs of ``x`` as columns, by answer key: a tensor on the
        CPU (a class id, a value, ``n`` rows of probabilities), or a list (category strings,
        ``predict_step`` rows). :meth:`answers` is these, row by row."""
        out, n = self.raw(module, x), x.shape[0]
        if self.kind == "prediction":
            return {self.key: _per_row(out, n)}
        if self.kind == "regression":
            return {self.key: out.float().reshape(n).cpu()}
        probabilities = torch.softmax(out.float(), dim=-1).cpu()
        labels: Any = probabilities.argmax(dim=-1)
        if self.categories is not None:
            labels = [self.categories[i] for i in labels.tolist()]
        return {self.key: labels, "probabilities": probabilities}


def _as_list(column: Any) -> list[Any]:
    return column.tolist() if isinstance(column, torch.Tensor) else list(column)


def _data_schema(ckpt: ModelCheckpoint) -> TableSchema | None:
    """The data schema recorded at training, ``None`` for a checkpoint without one."""
    raw = ckpt.meta.get("data_schema") if isinstance(ckpt.meta, dict) else None
    if raw is None:
        return None
    try:
        return TableSchema.from_json(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ServingError(
            f"{ckpt.uri}: meta['data_schema'] is not a data schema "
            f"(TableSchema.to_json()): {type(err).__name__}: {err}"
        ) from err


def _output_spec(module: torch.nn.Module, schema: TableSchema | None, where: str) -> OutputSpec:
    name = getattr(module, "output_name", None)
    if name is not None and (
        not isinstance(name, str) or not name or name in _RESERVED_OUTPUT_NAMES
    ):
        raise ServingError(
            f"{where}.output_name must be a plain name, not one of "
            f"{list(_RESERVED_OUTPUT_NAMES)}, got {name!r}"
        )
    if _custom_predict_step(module):
        return OutputSpec(kind="prediction", key="prediction")
    if schema is not None and schema.task == "regression":
        return OutputSpec(kind="regression", key="value", label_column=schema.label.name)
    if schema is None:
        return OutputSpec(kind="classification", key=name or "label")
    categories = schema.label.categories
    return OutputSpec(
        kind="classification",
        key=name or "label",
        classes=schema.classes if categories is None else len(categories),
        categories=categories,
        label_column=schema.label.name,
    )


def request_specs(
    module: torch.nn.Module, ckpt: ModelCheckpoint
) -> tuple[InputSpec | TableInput, OutputSpec]:
    """The request and the answer: the module's ``input_schema`` when it declares one (the
    digits demo), else the data schema recorded at training (``meta["data_schema"]``)."""
    where = f"{ckpt.uri}: {type(module).__qualname__}"
    schema = _data_schema(ckpt)
    declared = getattr(module, "input_schema", None)
    if declared is not None:
        spec: InputSpec | TableInput = InputSpec.of(declared, where)
    elif schema is not None:
        spec = TableInput.of(schema)
    else:
        raise ServingError(
            f"{ckpt.uri}: cannot tell what {ckpt.module} takes as input: the checkpoint "
            "records no data schema (meta['data_schema']) and the module declares no "
            "input_schema; train it through ringflow, which records the data schema, or "
            "declare input_schema on the module class"
        )
    return spec, _output_spec(module, schema, where)


def _instances(spec: InputSpec | TableInput, value: Any) -> list[list[float]]:
    if not isinstance(value, list):
        raise BadRequest(f"{_INSTANCES} must be an array of inputs, found {json_type(value)}")
    if not value:
        raise BadRequest(f"{_INSTANCES} is empty: send at least one input")
    if len(value) > _MAX_INSTANCES:
        raise BadRequest(
            f"{_INSTANCES} has {len(value)} inputs, over the limit of {_MAX_INSTANCES} per request"
        )
    return [spec.row(row, f"{_INSTANCES}[{i}]") for i, row in enumerate(value)]
