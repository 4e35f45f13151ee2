"""What a flow's command line checks before anything heavy is imported.

Every check here needs only pydantic, fsspec and pyarrow, never Prefect, Ray or torch, so a
bad value or a missing data file is answered in well under a second, in one line that names
the parameter or the file and what to change. A flow's function is the one description of
its parameters: :func:`parameter_model` reads their types, bounds and defaults from its
signature, :func:`parameter_docs` their meaning from its docstring.
"""

from __future__ import annotations

import ast
import csv
import dataclasses
import inspect
import re
import textwrap
import typing
from collections.abc import Callable, Sequence
from typing import Any

import pydantic

__all__ = [
    "PreflightError",
    "check_data_file",
    "check_parameters",
    "field_docs",
    "nested_parameters",
    "parameter_docs",
    "parameter_model",
]

_ACCEPTED = ".csv, .csv.gz, .parquet or a directory of .parquet files"
_HEADER_BYTES = 1 << 20
"""The most of a CSV file read to find its header row."""


class PreflightError(ValueError):
    """A parameter or the data file is unusable; the message says which and what to do."""


def parameter_model(fn: Callable[..., Any]) -> type[pydantic.BaseModel]:
    """A pydantic model with one field per parameter of ``fn``, as its signature types it."""
    hints = typing.get_type_hints(fn, include_extras=True)
    fields = {
        name: (hints.get(name, Any), param.default)
        for name, param in inspect.signature(fn).parameters.items()
    }
    return pydantic.create_model(
        fn.__name__, __config__=pydantic.ConfigDict(extra="forbid"), **fields
    )


def nested_parameters(fn: Callable[..., Any]) -> dict[str, type]:
    """The parameters of ``fn`` that are configuration dataclasses (``training``): their
    fields are options of their own on the command line."""
    hints = typing.get_type_hints(fn)
    return {
        name: hint
        for name in inspect.signature(fn).parameters
        if dataclasses.is_dataclass(hint := hints.get(name))
    }


def field_docs(cls: type) -> dict[str, str]:
    """Each field's description: the docstring under it in the class body."""
    docs: dict[str, str] = {}
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    for field, after in zip(body, body[1:], strict=False):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[field.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def parameter_docs(fn: Callable[..., Any]) -> dict[str, str]:
    """Each parameter's description from the ``Args:`` section of ``fn``'s docstring."""
    docs: dict[str, str] = {}
    name = None
    lines = inspect.cleandoc(fn.__doc__ or "").splitlines()
    start = lines.index("Args:") + 1 if "Args:" in lines else len(lines)
    for line in lines[start:]:
        if line and not line.startswith(" "):
            break  # the next section
        entry = re.match(r"^ {4}(\w+): (.*)$", line)
        if entry:
            name, docs[entry[1]] = entry[1], entry[2]
        elif name and line.strip():
            docs[name] += " " + line.strip()
    return docs


def check_parameters(fn: Callable[..., Any], values: dict[str, Any]) -> dict[str, Any]:
    """``values`` checked against the types and bounds of ``fn``'s signature.

    Raises:
        PreflightError: naming the first parameter refused, its value and the rule it broke.
    """
    try:
        checked = parameter_model(fn).model_validate(values)
    except pydantic.ValidationError as err:
        raise PreflightError(_first_error(err, parameter_docs(fn))) from None
    return {name: getattr(checked, name) for name in type(checked).model_fields}


def _first_error(err: pydantic.ValidationError, docs: dict[str, str]) -> str:
    """The first refusal as ``name = value: the rule``; a pattern's rule is its meaning."""
    errors = err.errors(include_url=False)
    first = errors[0]
    # ``training.workers``, but ``allowed_models`` rather than its item's index.
    name = ".".join(part for part in first["loc"] if isinstance(part, str)) or "parameters"
    rule = first["msg"]
    if first["type"] == "string_pattern_mismatch" and name in docs:
        rule = f"expected {docs[name]}"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    if first["type"] == "value_error":  # a configuration's own check: it names the field
        return f"{name}: {rule.removeprefix('Value error, ')}{more}"
    return f"{name} = {first['input']!r}: {rule}{more}"


def check_data_file(
    url: str, *, label: str | None = None, features: Sequence[str] | None = None
) -> list[str]:
    """Check that ``url`` is a data file ringflow reads, and return its column names.

    Only what is cheap is read: whether the file is there, its format, and its header row
    (a Parquet file's schema). Each value is validated later, when the rows are read.

    Raises:
        PreflightError: the file is missing, unreadable, of another format, or its header
            lacks ``label`` or one of ``features``.
    """
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as err:
        raise PreflightError(
            f"data_url {url}: cannot open it ({err}); install the fsspec package for its "
            "protocol (s3fs for s3://, gcsfs for gs://) or give a local path"
        ) from None
    try:
        if not fs.exists(path):
            raise PreflightError(f"data_url {url} does not exist; give a {_ACCEPTED}")
        columns = _columns(url, fs, path)
    except OSError as err:  # no permission, a store that does not answer...
        raise PreflightError(f"data_url {url} is not readable: {err}") from None
    wanted = [*([label] if label else []), *(features or [])]
    missing = [name for name in wanted if name not in columns]
    if missing:
        which = "label" if missing[0] == label else "features"
        raise PreflightError(
            f"data_url {url} has no column {missing[0]!r} (named by {which}); "
            f"its columns are {columns}. Fix {which} or the file's header"
        )
    return columns


def _columns(url: str, fs: Any, path: str) -> list[str]:
    if fs.isdir(path):
        return _parquet_directory_columns(url, fs, path)
    name = path.lower()
    if name.endswith((".csv", ".csv.gz")):
        return _csv_columns(url, fs, path)
    if name.endswith(".parquet"):
        return _parquet_columns(url, fs, path)
    raise PreflightError(f"data_url {url} has an unsupported format; give a {_ACCEPTED}")


def _csv_columns(url: str, fs: Any, path: str) -> list[str]:
    compression = "gzip" if path.lower().endswith(".gz") else None
    try:
        with fs.open(path, "rb", compression=compression) as file:
            head = file.read(_HEADER_BYTES)
    except (OSError, EOFError) as err:
        raise PreflightError(f"data_url {url} is not a readable CSV file: {err}") from None
    first = head.lstrip(b"\r\n").split(b"\n", 1)[0].rstrip(b"\r")
    if not first.strip():
        raise PreflightError(f"data_url {url} is empty; it needs a header row naming the columns")
    try:
        text = first.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise PreflightError(
            f"data_url {url} is not a UTF-8 CSV file: its first line is not text"
        ) from None
    return next(csv.reader([text]))


def _parquet_columns(url: str, fs: Any, path: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with fs.open(path, "rb") as file:
            return list(pq.read_schema(file).names)
    except (pa.ArrowException, OSError) as err:
        raise PreflightError(f"data_url {url} is not a readable Parquet file: {err}") from None


def _parquet_directory_columns(url: str, fs: Any, path: str) -> list[str]:
    prefix = path.rstrip("/") + "/"
    names = sorted(p[len(prefix) :] for p in fs.find(path) if p.endswith(".parquet"))
    # Names starting with _ or . are metadata or in-progress files of other writers.
    names = [n for n in names if not any(part[:1] in "_." for part in n.split("/"))]
    if not names:
        raise PreflightError(
            f"data_url {url} is a directory with no .parquet files; give a {_ACCEPTED}"
        )
    return _parquet_columns(f"{url.rstrip('/')}/{names[0]}", fs, prefix + names[0])
