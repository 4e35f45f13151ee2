"""docs/reference.md names every knob the code has: each flow parameter, each argument of
``engine.fit``, each ``TrainConfig`` field and each ``RINGFLOW_*`` environment variable."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

from ringflow.engine import SymmConfig, TrainConfig, fit
from ringflow.engine.collective import ENVIRONMENT_KNOBS
from ringflow.flows.horovod_train import horovod_train
from ringflow.flows.train_pipeline import train_pipeline

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference.md"
# Where the code users run lives; tests/ is left out (its variables are its own).
CODE = [
    "engine",
    "storage",
    "tasks",
    "flows",
    "models",
    "serving",
    "tuning",
    "horovod",
    "deployments",
    "bench",
    "examples",
]
SUFFIXES = {".py", ".sh", ".yaml", ".yml", ".toml"}
NOT_KNOBS = {
    # bench/serve.py points its server's token_env at a variable nobody sets: no token.
    "RINGFLOW_BENCH_TOKEN_NEVER_SET",
}


def _documented() -> set[str]:
    """Every name written as code (`name`) in the first column of a table row."""
    return set(re.findall(r"^\| `([^`]+)` \|", REFERENCE.read_text(), re.M))


def _environment_variables() -> dict[str, str]:
    """``RINGFLOW_*`` variable (and Horovod's own, quoted, that ``ringflow.horovod`` reads)
    -> the first file that reads or sets it."""
    found: dict[str, str] = {}
    for folder in CODE:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in SUFFIXES and ".venv" not in path.parts:
                text = path.read_text()
                names = re.findall(r"\bRINGFLOW_[A-Z0-9_]*[A-Z0-9]\b", text)
                names += re.findall(r"[\"'](HOROVOD_[A-Z0-9_]*[A-Z0-9])[\"']", text)
                for name in names:
                    found.setdefault(name, str(path.relative_to(ROOT)))
    # SymmConfig's overrides are named from its fields (engine/config.py), not spelled out.
    found.update({name: "engine/config.py" for name in ENVIRONMENT_KNOBS if name not in found})
    return {name: path for name, path in found.items() if name not in NOT_KNOBS}


def _symm_fields() -> list[str]:
    return [f"symm.{f.name}" for f in dataclasses.fields(SymmConfig)]


def _missing(kind: str, names: dict[str, str] | list[str], where: str) -> list[str]:
    documented = _documented()
    return [
        f"{kind} {name} ({names[name] if isinstance(names, dict) else where})"
        for name in names
        if name not in documented
    ]


def test_the_reference_names_every_knob_of_the_code():
    missing = [
        *_missing(
            "flow parameter",
            list(inspect.signature(train_pipeline.fn).parameters),
            "flows/train_pipeline.py",
        ),
        *_missing(
            "flow parameter",
            list(inspect.signature(horovod_train.fn).parameters),
            "flows/horovod_train.py",
        ),
        *_missing("fit argument", list(inspect.signature(fit).parameters), "engine/trainer.py"),
        *_missing(
            "TrainConfig field",
            [f.name for f in dataclasses.fields(TrainConfig)],
            "engine/config.py",
        ),
        *_missing("SymmConfig field", _symm_fields(), "engine/config.py"),
        *_missing("environment variable", _environment_variables(), ""),
    ]
    assert not missing, (
        "docs/reference.md lacks a table row (| `name` | default | ... |) for: "
        + "; ".join(missing)
    )


def test_every_train_config_field_is_a_flow_parameter():
    """``training`` is the engine's TrainConfig itself: each of its fields is in the schema a
    deployment enforces (bounds and choices included), none copied or left out."""
    from prefect.utilities.callables import parameter_schema

    schema = parameter_schema(train_pipeline)
    (definition,) = [d for name, d in schema.definitions.items() if name == "TrainConfig"]
    assert list(definition["properties"]) == [f.name for f in dataclasses.fields(TrainConfig)]
    assert definition["additionalProperties"] is False
    assert definition["properties"]["workers"]["minimum"] == 1
    assert "bf16-mixed" in definition["properties"]["precision"]["enum"]


def test_the_scan_finds_the_variables_the_code_reads():
    found = _environment_variables()
    assert {"RINGFLOW_STATE", "RINGFLOW_SERVE_TOKEN", "RINGFLOW_SYMM_GRAPHS"} <= set(found)
    assert "RINGFLOW_TEST_SERVING_TOKEN" not in found  # tests/ is not scanned


def test_the_reference_names_nothing_the_code_lacks():
    known = {
        *inspect.signature(train_pipeline.fn).parameters,
        *inspect.signature(horovod_train.fn).parameters,
        *inspect.signature(fit).parameters,
        *(f.name for f in dataclasses.fields(TrainConfig)),
        *_symm_fields(),
        *_environment_variables(),
    }
    serving = {"POST /predict", "GET /healthz", "GET /model"}
    stale = sorted(
        name
        for name in _documented()
        if name not in known and not name.startswith("POST /predict") and name not in serving
    )
    assert not stale, f"docs/reference.md documents what the code no longer has: {stale}"


def test_what_pipeline_stages_refuse_is_listed_with_why():
    """Every TrainConfig option the pipeline layout refuses has its row in the reference's
    list of what pipeline stages refuse, with the reason."""
    from ringflow.engine.layout import Pipeline

    text = REFERENCE.read_text()
    section = text.split("### What pipeline stages refuse", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| (.+?) \| (.+?) \|$", section, re.M)[1:]  # past the header
    listed = {name for first, _ in rows for name in re.findall(r"`([^`]+)`", first)}
    refused = {*Pipeline._UNSUPPORTED, "compression", "per_worker_batch_size"}
    refused |= {"min_workers", "commit_every"}  # on GPUs
    assert refused <= listed, sorted(refused - listed)
    assert all(why.strip() for _, why in rows)
