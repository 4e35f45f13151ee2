"""``score-pipeline``: score a table with a registered model version, resumably.

The model's production version (or a version, or a training run's model) scores every row of
a CSV or Parquet table (``input_url``, a file or a folder of shards, any fsspec URL); the
predictions go to ``{storage_url}/scores/{run key}`` as Parquet shards, committed block by
block and then as a whole (``serving.score``). A retried or restarted flow run keeps its run
key and skips the blocks committed already. Run it locally with no server:
``python -m ringflow.flows.score_pipeline --help``.

As in ``train_pipeline``, the function comes first, undecorated, with only pydantic imported,
so the command line checks its values before Prefect, Ray and torch are imported; its
``preflight`` then checks the model and the table's columns (exit 2, one line).
"""

# ruff: noqa: E402 (Prefect and the tasks are imported after the command line's checks)
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

ClassPath = Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")]
RunKey = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._=-]{0,199}$")]
DEMO_MODEL = "ringflow.models.digits:DigitsClassifier"


def score_pipeline(
    input_url: Annotated[str | None, Field(min_length=1)] = None,
    model_name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")] = "digits",
    model: ClassPath = DEMO_MODEL,
    version: Annotated[str | None, Field(pattern=r"^v\d{4,}$")] = None,
    from_run: RunKey | None = None,
    allowed_models: list[ClassPath] | None = None,
    storage_url: str = ".ringflow/storage",
    output_url: str | None = None,
    key_columns: list[str] | None = None,
    engine: Literal["auto", "local", "ray"] = "auto",
    block_rows: Annotated[int, Field(ge=1, le=100_000_000)] = 65_536,
    batch_size: Annotated[int, Field(ge=1, le=1_000_000)] = 4096,
    ray_threshold_bytes: Annotated[int, Field(ge=1)] = 1 << 30,
    concurrency: Annotated[int | None, Field(ge=1, le=4096)] = None,
    cpus_per_actor: Annotated[float, Field(gt=0, le=1024)] = 1.0,
    gpus_per_actor: Annotated[float, Field(ge=0, le=64)] = 0.0,
    run_key: RunKey | None = None,
    max_restarts: Annotated[int, Field(ge=0, le=100)] = 3,
) -> dict:
    """Score a table with a registered model; predictions as Parquet, committed block by block.

    Args:
        input_url: the table to score: a CSV or Parquet file, or a folder of Parquet files
            (any fsspec URL). It holds the model's feature columns; a label is not needed.
        model_name: the model's name in the registry under storage_url.
        model: the model class, as an import path 'package.module:ClassName': the class the
            scored version must hold (with allowed_models); any other is never imported.
        version: the registry version to score with (v0003); empty means production.
        from_run: score with the model a training run wrote (storage_url's runs/<key>/model)
            instead of a registry version.
        allowed_models: further model classes (import paths) the version may hold.
        storage_url: where the registry and the output are (any fsspec URL).
        output_url: where the predictions go; empty means storage_url's scores/<run key>.
        key_columns: input columns written with each prediction to join it back; empty
            means the row's number in the input, source_row.
        engine: local (this process), ray (Ray Data actors holding the model) or auto (Ray
            for ray_threshold_bytes of input or more, or when RAY_ADDRESS names a cluster).
        block_rows: rows per block, the unit committed on its own and skipped on a restart.
        batch_size: rows per forward pass.
        ray_threshold_bytes: engine auto: the input size from which Ray Data scores it.
        concurrency: Ray: actors holding the model; empty means as many as the cluster holds.
        cpus_per_actor: Ray: CPUs each actor reserves (fractions allowed).
        gpus_per_actor: Ray: the share of a GPU each actor reserves (0.25: four to a GPU).
        run_key: what the output is kept under; empty means this flow run's id, which stays
            the same across its retries. Give the key of a killed run to finish it.
        max_restarts: how often this flow run may start again after a failure or a crash; a
            run started more often fails at once without scoring.
    """
    refused = too_many_starts(max_restarts)
    if refused is not None:
        return refused
    parameters = {k: v for k, v in locals().items() if k != "refused"}
    parameters["run_key"] = run_key or str(flow_run.get_id() or "local")
    try:
        job = scoring_job(parameters)
        result = score(**job)
    except (ValueError, TypeError) as err:  # bad input (ScoringError...): final
        return fail_at_once(err)
    result["run_key"] = parameters["run_key"]
    publish_summary({k: v for k, v in result.items() if k != "model"})
    return result


def scoring_job(parameters: dict[str, Any]) -> dict[str, Any]:
    """The score task's arguments, typed, from the flow's parameters (``run_key`` given)."""
    from ringflow.serving.score import ModelSource, ScoringOptions
    from ringflow.storage.layout import Workspace

    if not parameters.get("input_url"):
        raise ValueError(
            "input_url is required: the table to score, a CSV or Parquet file or a folder "
            "of Parquet files"
        )
    workspace = Workspace(parameters["storage_url"])
    run_key = parameters["run_key"]
    if parameters.get("from_run"):
        if parameters.get("version"):
            raise ValueError("from_run scores a run's model, version a registry's: give one")
        source = ModelSource(
            checkpoint=workspace.run_model(parameters["from_run"]), name=parameters["model_name"]
        )
    else:
        source = ModelSource(
            registry_url=workspace.registry,
            name=parameters["model_name"],
            version=parameters.get("version"),
        )
    options = ScoringOptions(
        **{
            name: parameters[name]
            for name in (
                "engine",
                "block_rows",
                "batch_size",
                "ray_threshold_bytes",
                "concurrency",
                "cpus_per_actor",
                "gpus_per_actor",
            )
        }
    )
    return {
        "input_url": parameters["input_url"],
        "output_url": parameters.get("output_url") or workspace.scores(run_key),
        "model": source,
        "model_path": parameters["model"],
        "allowed": tuple(parameters.get("allowed_models") or ()),
        "key_columns": tuple(parameters.get("key_columns") or ()),
        "options": options,
    }


def preflight(parameters: dict) -> None:
    """The command line's second check, before Prefect or Ray starts: the model (its version
    and class) and the table's columns, as the run would check them.

    Raises:
        ValueError: naming what to fix.
    """
    from ringflow.serving.score import check

    job = scoring_job({**parameters, "run_key": parameters.get("run_key") or "preflight"})
    classes = list(dict.fromkeys([job.pop("model_path"), *job.pop("allowed")]))
    check(job.pop("input_url"), job.pop("output_url"), allowed=classes, **job)


if __name__ == "__main__":
    from ringflow.flows.cli import main

    raise SystemExit(main(score_pipeline))

from prefect import flow
from prefect.runtime import flow_run

from ringflow.flows.train_pipeline import fail_at_once, publish_summary, too_many_starts
from ringflow.tasks.score import score

score_pipeline = flow(
    name="score-pipeline",
    retries=1,
    retry_delay_seconds=10,
    persist_result=True,
    result_serializer="json",
)(score_pipeline)
