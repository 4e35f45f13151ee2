"""Score a table with a registered model: the ``score`` task over :mod:`serving.score`, with
a progress bar, a log line per block and a summary artifact."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.logging import get_run_logger
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ringflow.engine.cluster import connect
from ringflow.serving import score as scoring

__all__ = ["score"]


@task(name="score")
def score(
    input_url: str,
    output_url: str,
    *,
    model: scoring.ModelSource,
    model_path: str,
    allowed: Sequence[str] = (),
    key_columns: Sequence[str] = (),
    options: scoring.ScoringOptions,
) -> dict:
    """Score every row of ``input_url`` into ``output_url`` (:func:`serving.score.score`);
    return the counts, the throughput and the model that scored.

    The model may be of the class ``model_path`` (an import path) or one in ``allowed``; a
    version naming any other is refused unimported. On Ray (a large input, or a cluster
    named by ``RAY_ADDRESS``) this process connects first, shipping the model's code where
    the cluster lacks it. Started again into the same output, the blocks committed already
    are skipped.

    Raises:
        ScoringError: bad input (a column, a version, a model class), before any work.
    """
    classes = list(dict.fromkeys([model_path, *allowed]))
    if scoring.choose_engine(input_url, output_url, options) == "ray":
        connect(model=model_path)
    with _block_progress() as on_block:
        result = scoring.score(
            input_url,
            output_url,
            model=model,
            allowed=classes,
            key_columns=key_columns,
            options=options,
            on_block=on_block,
        )
    summary = {
        **result.as_dict(),
        "rows_per_second": _throughput(result),
        "model_name": result.model.get("name"),
        "model_version": result.model.get("version"),
    }
    get_run_logger().info(
        "scored %d rows (%d rejected) with %s %s into %s: %d of %d blocks this run, %s rows/s",
        result.rows_scored,
        result.rows_rejected,
        summary["model_name"],
        summary["model_version"] or result.model.get("uri"),
        result.output_url,
        result.blocks_scored,
        result.blocks,
        summary["rows_per_second"],
    )
    _summary_artifact(summary)
    return summary


def _throughput(result: scoring.ScoreResult) -> float | None:
    """Rows per second of the blocks this run scored (``None`` when it scored none)."""
    if not result.rows_read or result.seconds <= 0:
        return None
    return round(result.rows_read / result.seconds, 1)


@contextmanager
def _block_progress():
    """A terminal progress bar over blocks, and one log line per block for the Prefect UI."""
    logger = get_run_logger()
    with Progress(
        TextColumn("scoring"),
        BarColumn(),
        TextColumn("block {task.completed}/{task.total}"),
        TimeElapsedColumn(),
    ) as progress:
        bar = progress.add_task("score", total=None)

        def on_block(done: scoring.BlockDone) -> None:
            progress.update(bar, completed=done.done, total=done.total)
            how = "committed already, skipped" if done.skipped else "scored"
            logger.info(
                "block %d/%d %s: %d rows, %d rejected (%s)",
                done.done,
                done.total,
                done.block,
                done.rows,
                done.rejected,
                how,
            )

        yield on_block


def _summary_artifact(summary: dict) -> None:
    rows = {
        "rows scored": summary["rows_scored"],
        "rows rejected": summary["rows_rejected"],
        "rows per second": summary["rows_per_second"],
        "model": f"{summary['model_name']} {summary['model_version'] or ''}".strip(),
        "model fingerprint": summary["model"].get("fingerprint"),
        "output": summary["output_url"],
        "blocks scored / skipped": f"{summary['blocks_scored']} / {summary['blocks_skipped']}",
        "engine": summary["engine"],
        "seconds": round(summary["seconds"], 3),
    }
    create_markdown_artifact(
        key="scoring-summary",
        markdown="| | |\n|---|---|\n" + "".join(f"| {k} | `{v}` |\n" for k, v in rows.items()),
        description="What this scoring run wrote, with which model",
    )
