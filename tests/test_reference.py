"""docs/reference.md names every knob the code has: each flow parameter, each argument of
``engine.fit``, each ``TrainConfig`` field and each ``RINGFLOW_*`` environment variable; and
docs/benchmarks.md's summary table has a row for every headline figure a benchmark prints."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import re
from pathlib import Path

from ringflow.engine import SymmConfig, TrainConfig, fit
from ringflow.engine.collective import ENVIRONMENT_KNOBS
from ringflow.flows.horovod_train import horovod_train
from ringflow.flows.score_pipeline import score_pipeline
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
        *_missing(
            "flow parameter",
            list(inspect.signature(score_pipeline.fn).parameters),
            "flows/score_pipeline.py",
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
        *inspect.signature(score_pipeline.fn).parameters,
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


# -- docs/benchmarks.md: a summary row for every headline figure a benchmark prints ----------

BENCHMARKS = ROOT / "docs" / "benchmarks.md"
# bench/*.py modules that are no benchmark of ringflow against a peer, and why.
NOT_BENCHMARKS = {
    "make_parquet": "writes the synthetic datasets the benchmarks read",
    "scaling_model": "a model fitted to the all-reduce tables, checked in docs/scaling.md",
    "ports": "a helper",
}


def _headlines() -> dict[str, tuple[str, ...]]:
    """bench module -> its ``HEADLINE`` (a module-level tuple of strings), read statically."""
    found: dict[str, tuple[str, ...]] = {}
    for path in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if (
                isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["HEADLINE"]
                and isinstance(node.value, ast.Tuple)
            ):
                found[path.stem] = tuple(ast.literal_eval(node.value))
    return found


def _benchmark_modules() -> list[str]:
    return [
        path.stem
        for path in sorted((ROOT / "bench").glob("*.py"))
        if not path.stem.startswith("_") and path.stem not in NOT_BENCHMARKS
    ]


def _summary_rows() -> list[tuple[set[str], set[str]]]:
    """(headline names, bench modules its command runs) for each row of the page's first
    table, the summary, found by its header's ``headline`` and ``command`` columns."""
    lines = BENCHMARKS.read_text().split("\n## Summary", 1)[1].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = list(itertools.takewhile(lambda line: line.startswith("|"), lines[first:]))

    def cells(line: str) -> list[str]:
        return [cell.strip() for cell in line.strip().strip("|").split("|")]

    header = cells(table[0])
    headline, command = header.index("headline"), header.index("command")
    rows = []
    for line in table[2:]:
        row = cells(line)
        assert len(row) == len(header), f"summary row with {len(row)} cells: {line}"
        rows.append(
            (
                set(re.findall(r"`([^`]+)`", row[headline])),
                set(re.findall(r"\bbench\.(\w+)", row[command])),
            )
        )
    return rows


def test_every_benchmark_names_its_headline_figures_and_prints_them():
    """Each benchmark has a ``HEADLINE`` and prints its JSON line through ``headline_json``
    with it, so the printed headline keys are exactly the tuple the summary test reads."""
    headlines = _headlines()
    lacking = [m for m in _benchmark_modules() if not headlines.get(m)]
    assert not lacking, f"bench modules without a HEADLINE tuple: {lacking}"
    unprinted = []
    for module in headlines:
        tree = ast.parse((ROOT / "bench" / f"{module}.py").read_text())
        printed = any(
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "headline_json"
            and len(node.args) == 2
            and getattr(node.args[1], "id", None) == "HEADLINE"
            for node in ast.walk(tree)
        )
        if not printed:
            unprinted.append(module)
    assert not unprinted, f"print(headline_json(summary, HEADLINE)) missing in: {unprinted}"


def test_every_headline_figure_has_a_row_in_the_benchmarks_summary():
    rows = _summary_rows()
    missing = [
        f"bench.{module}: {name}"
        for module, names in _headlines().items()
        for name in names
        if not any(name in named and module in modules for named, modules in rows)
    ]
    assert not missing, (
        "docs/benchmarks.md's summary table has no row (headline column, with the command "
        "`python -m bench.<module> ...`) for: " + "; ".join(missing)
    )


def test_the_benchmarks_summary_names_no_figure_a_benchmark_lacks():
    headlines = _headlines()
    stale = [
        f"{name} ({', '.join(sorted(modules)) or 'no bench command'})"
        for named, modules in _summary_rows()
        for name in named
        if not any(name in headlines.get(module, ()) for module in modules)
    ]
    assert not stale, f"docs/benchmarks.md's summary names figures no benchmark prints: {stale}"


def test_headline_json_puts_the_headline_first_and_marks_what_was_not_measured():
    from bench import headline_json

    line = headline_json({"rows": [1], "ratio": 1.5}, ("ratio", "absent"))
    assert list(json.loads(line).items()) == [("ratio", 1.5), ("absent", None), ("rows", [1])]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_links_into_the_benchmarks_page_point_at_its_headings():
    anchors = {
        _anchor(line.lstrip("#"))
        for line in BENCHMARKS.read_text().splitlines()
        if line.startswith("#")
    }
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [
        f"{page.relative_to(ROOT)}: #{anchor}"
        for page in pages
        for anchor in re.findall(r"benchmarks\.md#([\w\-]+)", page.read_text())
        if anchor not in anchors
    ]
    assert not broken, f"links to headings docs/benchmarks.md lacks: {broken}"
