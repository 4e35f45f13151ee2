"""What a flow run produced, in a few lines for a person.

``python -m ringflow.flows.result [FLOW_RUN_ID]`` prints a finished run's result, or why it
failed; without an id, the newest run of ``train-pipeline``. For ``train-pipeline``: its test
metrics, the gate's decision and why, the endpoint and where its artifacts are
(``deployments/demo.sh`` ends with it, and the command line and the flow's log give the same
lines); for ``score-pipeline``: the rows scored and rejected, the model and the output; for
any other flow, its result's fields. ``--json`` prints the result as one JSON line instead,
for a script.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

__all__ = ["describe", "describe_scoring", "main"]


def describe(result: dict[str, Any]) -> list[str]:
    """The lines that say what a completed run produced, from the flow's result."""
    metrics = ", ".join(
        f"{name.removeprefix('test_')} {_number(value)}"
        for name, value in result.items()
        if name.startswith("test_")
    )
    decision = "promoted to production" if result.get("promoted") else "not promoted"
    lines = [
        f"test        {metrics or 'no test metrics'}",
        f"gate        {result.get('model_name')} {result.get('model_version')} {decision}: "
        f"{result.get('gate_reason')}",
        f"endpoint    {result['endpoint']} (answering with {result.get('served_version')})"
        if result.get("endpoint")
        else "endpoint    none (serve was off)",
        f"model       {result.get('model_uri')}",
        f"checkpoint  {result.get('checkpoint')}",
        f"dataset     {result.get('dataset_url')} ({result.get('rejected_rows', 0)} rows rejected)",
    ]
    if result.get("dashboard"):
        lines.append(f"dashboard   {result['dashboard']}")
    folders = sorted({os.path.dirname(w["stdout"]) for w in result.get("worker_logs") or []})
    if folders:
        count = len(result["worker_logs"])
        lines.append(f"worker logs {', '.join(folders)} ({count} workers' worker-*.out and .err)")
    return lines


def describe_scoring(result: dict[str, Any]) -> list[str]:
    """The lines that say what a completed ``score-pipeline`` run wrote."""
    model = result.get("model") or {}
    before = result.get("blocks_skipped", 0)
    return [
        f"scored      {result.get('rows_scored', 0):,} rows, {result.get('rows_rejected', 0):,} "
        f"rejected, in {result.get('blocks')} blocks ({before} committed before this run; "
        f"engine {result.get('engine')})",
        f"model       {model.get('name')} {model.get('version')} ({model.get('uri')})",
        f"output      {result.get('output_url')} (complete: its _manifest.json lists the files)",
    ]


def _fields(result: Any) -> list[str]:
    if not isinstance(result, dict):
        return [f"result      {result!r}"]
    return [f"{name:<11} {value}" for name, value in result.items()]


_DESCRIBED = {"train-pipeline": describe, "score-pipeline": describe_scoring}


def _number(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    """Print a run's result; exit status 0 for a completed run, 1 otherwise."""
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterStartTime,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    args = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    with get_client(sync_client=True) as client:
        if args:
            run = client.read_flow_run(UUID(args[0]))
        else:
            runs = client.read_flow_runs(  # the newest started: not tomorrow's scheduled one
                flow_filter=FlowFilter(name=FlowFilterName(any_=["train-pipeline"])),
                flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(is_null_=False)),
                sort=FlowRunSort.START_TIME_DESC,
                limit=1,
            )
            if not runs:
                print("no train-pipeline run yet", file=sys.stderr)
                return 1
            run = runs[0]
        flow = client.read_flow(run.flow_id).name
    state = run.state
    if as_json:
        if state is None or not state.is_completed():
            print(f"{flow} run {run.id} is {state.name if state else 'unknown'}", file=sys.stderr)
            return 1
        print(json.dumps(state.result(), default=str))
        return 0
    print(f"{flow} run {run.name} ({run.id}): {state.name if state else 'unknown'}")
    if state is None or not state.is_completed():
        why = " ".join(str((state.message if state else "") or "").split()) or "no message"
        print(f"  why         {why}")
        return 1
    for line in _DESCRIBED.get(flow, _fields)(state.result()):
        print("  " + line)
    print(f"  again       python -m ringflow.flows.result {run.id}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
