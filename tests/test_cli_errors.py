"""The command line refuses bad input in one line on stderr, naming the parameter or the file,
with no traceback; what it can check before Prefect, Ray and torch are imported it answers
without importing them (which is what keeps it within a second or two)."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import tempfile
import typing

import pytest

from ringflow.engine.config import TrainConfig
from ringflow.flows.preflight import parameter_model
from ringflow.flows.train_pipeline import train_pipeline

HEAVY = ("torch", "ray", "prefect", "lightning")
# The command run as ``python -m`` runs it, telling on exit which of HEAVY it had imported.
_PROBE = f"""
import atexit, os, runpy, sys
def _tell():
    with open(os.environ["RINGFLOW_TEST_IMPORTED"], "w") as out:
        out.write(" ".join(name for name in {HEAVY!r} if name in sys.modules))
atexit.register(_tell)
runpy.run_module("ringflow.flows.train_pipeline", run_name="__main__", alter_sys=True)
"""


def _cli(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, set[str]]:
    """The command's result, and which of HEAVY it imported before it ended."""
    with tempfile.TemporaryDirectory() as scratch:
        told = os.path.join(scratch, "imported")
        result = subprocess.run(
            [sys.executable, "-c", _PROBE, *args],
            capture_output=True,
            text=True,
            timeout=300,
            env={
                **os.environ,
                "RINGFLOW_DEBUG": "0",
                "RINGFLOW_TEST_IMPORTED": told,
                **(env or {}),
            },
        )
        with open(told) as imported:
            return result, set(imported.read().split())


def _assert_one_line_error(result: subprocess.CompletedProcess, *named: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in result.stderr
    assert "Starting temporary server" not in result.stdout + result.stderr
    for text in named:
        assert text in lines[0], lines[0]


def _options() -> dict[str, dict]:
    """Each command-line option's schema by name: the flow's parameters, and the fields of
    ``training`` (a TrainConfig), which are options of their own."""
    schema = parameter_model(train_pipeline.fn).model_json_schema()
    options = {k: v for k, v in schema["properties"].items() if k != "training"}
    return {**options, **schema["$defs"]["TrainConfig"]["properties"]}


def _out_of_bounds() -> list[tuple[str, str]]:
    """For every parameter with a bound, a value just past it: read from the flow's
    signature, so a parameter added later is covered too."""
    cases = []
    for name, prop in _options().items():
        options = [prop, *prop.get("anyOf", [])]
        for option in [*options, *(o["items"] for o in options if "items" in o)]:
            if "minimum" in option:
                cases.append((name, str(option["minimum"] - 1)))
            if "exclusiveMinimum" in option:
                cases.append((name, str(option["exclusiveMinimum"])))
            if "maximum" in option:
                cases.append((name, str(option["maximum"] + 1)))
            if "pattern" in option:
                cases.append((name, "not a valid value!"))
    return cases


BOUNDS = _out_of_bounds()


def test_every_parameter_with_a_bound_in_the_signature_has_a_value_past_it():
    """Read from the annotations, not the JSON schema the cases come from: a bound the schema
    scan misses (inside a list, say) would go untested."""
    bounded = set()
    hints = {
        **typing.get_type_hints(train_pipeline.fn, include_extras=True),
        **typing.get_type_hints(TrainConfig, include_extras=True),
    }
    for name, hint in hints.items():
        if any(
            getattr(m, attr, None) is not None
            for m in _field_metadata(hint)
            for attr in ("ge", "gt", "le", "lt", "pattern")
        ):
            bounded.add(name)
    assert bounded - {name for name, _ in BOUNDS} == set()
    assert {"workers", "model", "allowed_models"} <= bounded  # the scan itself found some


def _field_metadata(hint) -> list:
    """Every constraint object annotated anywhere inside ``hint`` (``list[Annotated[...]]``,
    ``Annotated[int | None, ...]``)."""
    found = list(getattr(hint, "__metadata__", ()))
    for arg in typing.get_args(hint):
        found += _field_metadata(arg)
    for item in list(found):
        found += list(getattr(item, "metadata", ()))  # pydantic FieldInfo's constraints
    return found


@pytest.mark.parametrize(("name", "value"), BOUNDS, ids=[f"{n}={v}" for n, v in BOUNDS])
def test_a_value_past_its_bound_is_refused_in_one_line_at_once(name, value):
    result, imported = _cli("--" + name.replace("_", "-"), value)
    _assert_one_line_error(result, f"{name} = ")
    assert imported == set()  # answered before any of them was imported


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--placement", "everywhere"], "--placement: invalid choice: 'everywhere'"),
        (["--workers", "two"], "--workers: invalid int value: 'two'"),
        (["--tune-space", "[1, 2]"], "must be a JSON object"),
        (["--hparams", "{not json"], "--hparams: not valid JSON"),
        (["--bogus", "1"], "unrecognized arguments: --bogus"),
        (["--keep-serving", "--no-serve"], "--keep-serving"),
        (
            ["--shard", "parameters", "--compression", "powersgd"],
            "shard='parameters' does not compose with compression='powersgd'",
        ),
        (
            ["--shard", "optimizer", "--compression", "powersgd"],
            "shard='optimizer' does not compose with compression='powersgd'",
        ),
    ],
)
def test_a_bad_option_or_combination_is_refused_in_one_line_at_once(args, named):
    result, imported = _cli(*args)
    _assert_one_line_error(result, named)
    assert imported == set()  # answered before any of them was imported


def _write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(
    ("make", "args", "named"),
    [
        (lambda d: str(d / "missing.csv"), [], "does not exist"),
        (lambda d: _write(d / "empty.csv", b""), [], "is empty; it needs a header row"),
        (lambda d: _write(d / "x.csv", b"a,b\n1,2\n"), ["--label", "y"], "no column 'y'"),
        (
            lambda d: _write(d / "x.csv", b"a,y\n1,2\n"),
            ["--label", "y", "--features", "a,c"],
            "no column 'c' (named by features)",
        ),
        (lambda d: _write(d / "x.parquet", b"not parquet at all"), [], "not a readable Parquet"),
        (lambda d: _write(d / "x.csv.gz", b"not gzip"), [], "not a readable CSV file"),
        (lambda d: _write(d / "x.csv.gz", gzip.compress(b"\xff\xfe\x00\n")), [], "not a UTF-8"),
        (lambda d: _write(d / "x.json", b"{}"), [], "unsupported format"),
        (lambda d: str(d), [], "no .parquet files"),
    ],
    ids=[
        "missing",
        "empty",
        "no-label",
        "no-feature",
        "bad-parquet",
        "bad-gzip",
        "not-utf8",
        "format",
        "empty-dir",
    ],
)
def test_a_missing_or_malformed_data_file_is_refused_in_one_line_at_once(
    make, args, named, tmp_path
):
    url = make(tmp_path)
    result, imported = _cli("--data-url", url, *args)
    _assert_one_line_error(result, f"data_url {url}", named)
    assert imported == set()  # answered before any of them was imported


def test_fields_that_contradict_each_other_are_one_line_before_anything_heavy():
    result, imported = _cli("--workers", "2", "--min-workers", "3", "--tune-trials", "0")
    _assert_one_line_error(result, "training: min_workers (3) must not exceed workers (2)")
    assert imported == set()  # TrainConfig's own check needs no torch


def test_a_combination_the_engine_refuses_is_one_line_before_prefect_or_ray_start():
    result, imported = _cli("--pipeline-stages", "2", "--timeline", "--tune-trials", "0")
    _assert_one_line_error(result, "with 2 pipeline stages", "timeline=True")
    assert "torch" in imported  # the engine's own check ran
    assert not {"prefect", "ray"} & imported


def test_a_run_key_that_could_be_a_tuning_trials_is_refused():
    result, _ = _cli("--run-key", "nightly-trial-00001", "--tune-trials", "0")
    _assert_one_line_error(result, "run_key 'nightly-trial-00001' contains '-trial-'")


def test_debug_shows_the_traceback():
    result, _ = _cli("--workers", "0", "--debug")
    assert result.returncode != 0
    assert "Traceback" in result.stderr
    assert "PreflightError: training.workers = 0" in result.stderr
    result, _ = _cli("--workers", "0", env={"RINGFLOW_DEBUG": "1"})
    assert "Traceback" in result.stderr


def test_help_lists_the_choices_of_every_option_that_has_them():
    result, imported = _cli("--help")
    assert result.returncode == 0
    assert imported == set()  # answered before any of them was imported
    help_text = " ".join(result.stdout.split())
    choices = {name: prop["enum"] for name, prop in _options().items() if "enum" in prop}
    assert {"placement", "precision", "task", "tune_algorithm"} <= set(choices)
    for name, values in choices.items():
        assert f"--{name.replace('_', '-')} {{{','.join(values)}}}" in help_text, name


def test_what_a_model_that_makes_its_own_data_cannot_use_is_one_line_before_prefect_or_ray():
    result, imported = _cli("--model", "tests.test_own_data:DQN", "--pipeline-stages", "2")
    _assert_one_line_error(
        result,
        "tests.test_own_data:DQN makes its own data (its train_dataloader())",
        "tune_trials=8 (the search trains its trials on a data file: set it to 0)",
        "pipeline_stages=2",
        "serve=True (a served model reads requests by a data file's columns: pass --no-serve)",
    )
    assert "prefect" not in imported
