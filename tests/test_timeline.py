"""The timeline: each worker's spans as a Chrome trace, and the overlap summary read from it."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ringflow.engine import TrainConfig, fit
from ringflow.engine.collective.base import CompletedWork
from ringflow.engine.pipeline import PipelineConfig
from ringflow.engine.timeline import (
    SPAN_KINDS,
    UNTIMED,
    WorkerTimeline,
    chrome_trace,
    summarize,
)
from ringflow.engine.trainer import check_layout
from ringflow.models.digits import DigitsClassifier
from tests.support.fitting import relative_difference

US = 1000  # nanoseconds


def _span(kind: str, pid: int, begun_us: float, ended_us: float, step: int = 0) -> dict:
    tid = {"allreduce": 1, "optimizer": 2, "data": 3}.get(kind, 0)
    return {
        "name": kind,
        "cat": kind,
        "pid": pid,
        "tid": tid,
        "ts_ns": int(begun_us * US),
        "dur_ns": int((ended_us - begun_us) * US),
        "args": {"step": step},
    }


def test_summary_of_a_hand_built_trace():
    # Worker 0: backward 100-300 us; buckets 150-250 (inside) and 250-350 (half inside).
    # Worker 1: backward 1000-1200 us; one bucket 1200-1300, after backward (all exposed).
    worker0 = [
        _span("step", 0, 0, 400),
        _span("data", 0, 0, 10),
        _span("forward", 0, 10, 100),
        _span("backward", 0, 100, 300),
        _span("allreduce", 0, 150, 250),
        _span("allreduce", 0, 250, 350),
        _span("gradient_wait", 0, 300, 350),
        _span("optimizer", 0, 350, 400),
    ]
    worker1 = [
        _span("step", 1, 900, 1400),
        _span("backward", 1, 1000, 1200),
        _span("allreduce", 1, 1200, 1300),
        _span("gradient_wait", 1, 1200, 1300),
    ]
    trace = chrome_trace([worker0, worker1], clock="wall clock")
    summary = summarize(trace, trace_url="memory://t/trace.json")
    assert summary.workers == 2
    assert summary.steps == 2
    # Hidden: 100 + 50 of worker 0's 200 us, none of worker 1's 100 us.
    assert summary.overlap == pytest.approx(150 / 300)
    assert summary.communication_ms == pytest.approx(300 / 2 / 1000)
    assert summary.exposed_communication_ms == pytest.approx(150 / 2 / 1000)
    assert summary.step_ms["step"] == pytest.approx((400 + 500) / 2 / 1000)
    assert summary.step_ms["backward"] == pytest.approx(400 / 2 / 1000)
    assert summary.step_ms["gradient_wait"] == pytest.approx(150 / 2 / 1000)
    assert summary.step_ms["optimizer"] == pytest.approx(50 / 2 / 1000)
    assert summary.trace_url == "memory://t/trace.json"
    # The trace starts at 0 and is in microseconds.
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in spans) == 0
    assert {e["dur"] for e in spans if e["cat"] == "step"} == {400.0, 500.0}


def test_summary_without_communication_and_of_a_bad_trace():
    summary = summarize(chrome_trace([[_span("step", 0, 0, 10), _span("forward", 0, 0, 5)]]))
    assert summary.overlap is None
    assert summary.exposed_communication_ms == 0
    with pytest.raises(ValueError, match="traceEvents"):
        summarize({"events": []})


def test_a_worker_timeline_records_only_its_window():
    timeline = WorkerTimeline(device=torch.device("cpu"), warmup=2, steps=3, steps_per_epoch=4)
    recorded = []
    for batch in range(8):
        epoch, step = divmod(batch, 4)
        marks = timeline.begin(epoch, step)
        if marks is not UNTIMED:
            recorded.append(batch)
        marks.start("forward")
        marks.stop("forward")
        if marks is timeline:
            mark = timeline.mark()
            timeline.launched(0, 8, mark, CompletedWork(torch.zeros(2)))
        marks.end()
    assert recorded == [2, 3, 4]
    spans = timeline.spans(rank=1)
    timeline.close()
    assert {s["args"]["step"] for s in spans} == {2, 3, 4}
    assert {s["cat"] for s in spans} == {"step", "forward", "allreduce"}
    assert {s["pid"] for s in spans} == {1}
    assert timeline.spans(rank=1) == []  # each span is returned once


def test_timeline_options_are_checked():
    with pytest.raises(ValueError, match="timeline_steps"):
        TrainConfig(timeline=True, timeline_steps=0)
    with pytest.raises(ValueError, match="timeline_warmup"):
        TrainConfig(timeline_warmup=-1)
    with pytest.raises(ValueError, match="timeline must be"):
        TrainConfig(timeline="yes")
    with pytest.raises(ValueError, match="timeline"):
        check_layout(TrainConfig(timeline=True), PipelineConfig(stages=2))


def _fit(digits, tmp_path, *, in_process: bool = False, **config):
    return fit(
        DigitsClassifier,
        hparams={"hidden": 32, "lr": 0.01},
        data=digits,
        config=TrainConfig(epochs=1, batch_size=64, seed=3, **config),
        checkpoint_uri=str(tmp_path / "model"),
        in_process=in_process,
    )


def test_off_by_default_writes_nothing(digits, tmp_path):
    result = _fit(digits, tmp_path, workers=1, in_process=True)
    assert result.timeline is None
    assert sorted(os.listdir(tmp_path)) == ["model"]


@pytest.mark.ray
def test_two_workers_write_a_chrome_trace_of_their_steps(ray_session, digits, tmp_path):
    result = _fit(digits, tmp_path, workers=2, **TIMED)
    trace = _check_trace(result, tmp_path, clock="wall clock")
    assert trace["otherData"]["clock"] == "wall clock"


TIMED = {"bucket_mb": 0.001, "timeline": True, "timeline_warmup": 2, "timeline_steps": 4}
"""Small buckets (two all-reduces a step, launched from inside backward); batches 2-5."""


def _check_trace(result, tmp_path, *, clock: str) -> dict:
    """The trace of a :data:`TIMED` run of 2 workers: where it should be, valid, complete,
    its spans nested as the step runs them, and summarised as ``result`` says."""
    url = str(tmp_path / "timeline" / "trace.json")
    assert result.timeline is not None
    assert result.timeline.trace_url == url
    assert os.listdir(tmp_path / "timeline") == ["trace.json"]  # no temporary left
    with open(url) as f:
        trace = json.load(f)
    assert trace["otherData"]["clock"] == clock

    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for event in spans:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= event.keys()
        assert event["dur"] >= 0
    lanes = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["name"] == "thread_name"
    }
    assert lanes[(0, 0)] == "compute"
    assert lanes[(1, 1)] == "communication"

    by_step: dict[tuple[int, int], dict[str, list[dict]]] = {}
    for event in spans:
        kinds = by_step.setdefault((event["pid"], event["args"]["step"]), {})
        kinds.setdefault(event["cat"], []).append(event)
    assert sorted(by_step) == [(pid, step) for pid in (0, 1) for step in (2, 3, 4, 5)]
    assert {len(kinds["allreduce"]) for kinds in by_step.values()} == {2}
    for kinds in by_step.values():
        assert set(kinds) == set(SPAN_KINDS)
        _check_nesting(kinds, host_data=clock == "wall clock")

    summary = summarize(trace, trace_url=url)
    assert summary == result.timeline
    assert summary.workers == 2
    assert summary.steps == 8
    assert 0.0 <= summary.overlap <= 1.0
    assert summary.communication_ms > 0
    return trace


def _check_nesting(kinds: dict[str, list[dict]], *, host_data: bool) -> None:
    """One worker's spans of one step: each phase inside the step, in order; the buckets one
    at a time, after backward started and before the gradient wait ended. On CUDA the data
    span is on the host's clock, which runs ahead of the GPU's: it is not compared."""
    eps = 1e-3  # microseconds, for the float conversion
    (step,) = kinds["step"]
    phases = ["forward", "backward", "gradient_wait", "optimizer"]
    if host_data:
        phases.insert(0, "data")
    for before, after in zip(phases, phases[1:], strict=False):
        assert _end(kinds[before][0]) <= kinds[after][0]["ts"] + eps
    for kind in phases:
        (span,) = kinds[kind]
        assert step["ts"] - eps <= span["ts"] <= _end(span) <= _end(step) + eps
    backward, wait = kinds["backward"][0], kinds["gradient_wait"][0]
    allreduces = sorted(kinds["allreduce"], key=lambda e: e["args"]["bucket"])
    assert [e["args"]["bucket"] for e in allreduces] == list(range(len(allreduces)))
    for first, second in zip(allreduces, allreduces[1:], strict=False):
        assert _end(first) <= second["ts"] + eps  # one at a time, in order
    for span in allreduces:
        assert backward["ts"] - eps <= span["ts"]  # launched from inside backward
        assert _end(span) <= _end(wait) + eps  # the wait is over once all are done


def _end(event: dict) -> float:
    return event["ts"] + event["dur"]


# ---------------------------------------------------------------------------- GPUs


@pytest.fixture(scope="module")
def gpu_ray():
    """Ray with 2 GPUs of its own (GPU runs select only the ``gpu`` tests)."""
    import ray

    if ray.is_initialized():
        pytest.skip("a Ray instance without GPUs is running")
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpu_workers_time_their_steps_with_cuda_events(gpu_ray, digits, tmp_path):
    timed = _fit(digits, tmp_path, workers=2, gpus_per_worker=1, **TIMED)
    _check_trace(timed, tmp_path, clock="cuda events")
    plain = _fit(digits, tmp_path / "off", workers=2, gpus_per_worker=1, bucket_mb=0.001)
    # The sums the probe stream waited for reach .grad as they do without the timeline.
    timed_state = {k: v.cpu() for k, v in timed.state_dict.items()}
    plain_state = {k: v.cpu() for k, v in plain.state_dict.items()}
    assert relative_difference(timed_state, plain_state) < 1e-6


# ---------------------------------------------------------------------------- the flow


@pytest.mark.ray
@pytest.mark.e2e
def test_a_flow_run_with_timeline_writes_the_trace_and_its_artifact(
    ray_session, prefect_server, tmp_path
):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from ringflow.flows.train_pipeline import train_pipeline
    from ringflow.storage.layout import Workspace

    state = train_pipeline(
        storage_url=str(tmp_path),
        training={"epochs": 1, "timeline": True},
        tune_trials=0,
        serve=False,
        run_key="timed",
        return_state=True,
    )
    assert state.is_completed(), state.message
    run = ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=run))
    (artifact,) = [a for a in artifacts if a.key == "training-timeline"]
    trace_url = Workspace(str(tmp_path)).timeline("timed")
    assert os.path.exists(trace_url)
    assert "Communication hidden behind backward" in artifact.data
    assert f"`{trace_url}`" in artifact.data
    for kind in ("forward", "backward", "gradient wait", "optimizer"):
        assert f"| {kind} |" in artifact.data
