"""Prefect artifacts a person reads after a run: metric tables and a loss curve."""

from __future__ import annotations

import base64
import io

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from ringflow.engine import EpochMetrics
from ringflow.tuning import SearchResult, TrialSummary


def epoch_table(history: list[EpochMetrics], *, key: str) -> None:
    rows = [
        {
            "epoch": m.epoch + 1,
            **{k: round(v, 5) for k, v in m.metrics.items()},
            "seconds": round(m.seconds, 3),
        }
        for m in history
    ]
    create_table_artifact(key=key, table=rows, description="Metrics after every epoch")


def loss_curve(history: list[EpochMetrics], *, key: str) -> None:
    """A PNG plot of every loss metric over epochs, embedded in a markdown artifact."""
    fig, ax = _figure()
    epochs = [m.epoch + 1 for m in history]
    for name in sorted(history[0].metrics):
        if name.endswith("loss"):
            ax.plot(epochs, [m.metrics[name] for m in history], marker="o", label=name)
    _publish_plot(fig, ax, ylabel="loss", key=key, description="Loss curve")


def trial_table(trials: list[TrialSummary], *, metric: str, key: str) -> None:
    """One row per trial: its parameters, metric, epochs run, how it ended, executions."""
    rows = [
        {
            "trial": t.trial_id + (" (base)" if t.is_base else ""),
            **t.params,
            metric: None if t.metric is None else round(t.metric, 5),
            "epochs": t.epochs,
            "state": t.state,
            "executions": t.executions,
        }
        for t in trials
    ]
    stopped = sum(t.state == "stopped early" for t in trials)
    create_table_artifact(
        key=key,
        table=rows,
        description=f"Tuning trials and how each ended ({stopped} of {len(trials)} stopped early)",
    )


def trial_curves(trials: list[TrialSummary], *, metric: str, key: str) -> None:
    """The metric over epochs of every trial; trials stopped early are dashed."""
    fig, ax = _figure()
    for t in trials:
        style = "--" if t.state == "stopped early" else "-"
        label = f"{t.trial_id}{' base' if t.is_base else ''} ({t.state})"
        ax.plot(range(1, len(t.curve) + 1), t.curve, style, marker="o", label=label)
    _publish_plot(fig, ax, ylabel=metric, key=key, description=f"{metric} per epoch of each trial")


def best_configuration(result: SearchResult, *, metric: str, key: str) -> None:
    """The configuration the search chose, against the base configuration."""
    base = "n/a" if result.base_metric is None else f"{result.base_metric:.4f}"
    create_markdown_artifact(
        key=key,
        markdown="| hyperparameter | value |\n|---|---|\n"
        + "".join(f"| {k} | {v} |\n" for k, v in result.best_params.items())
        + f"| {metric} | {result.best_metric:.4f} (base configuration: {base}) |\n"
        + f"| trial | {result.best_trial} |\n| checkpoint | `{result.best_checkpoint}` |\n",
        description="The configuration the search chose",
    )


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    return plt.subplots(figsize=(6, 3.5))


def _publish_plot(fig, ax, *, ylabel: str, key: str, description: str) -> None:
    """Embed the figure as a PNG in a markdown artifact, which the Prefect UI renders."""
    from matplotlib import pyplot as plt

    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    png = base64.b64encode(buf.getvalue()).decode()
    create_markdown_artifact(
        key=key, markdown=f"![{description}](data:image/png;base64,{png})", description=description
    )
