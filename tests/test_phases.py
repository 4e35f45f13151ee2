"""Where a run's time goes outside its steps: ``RINGFLOW_PHASES`` lays the driver's and the
workers' phases on one clock; off, nothing is written."""

from __future__ import annotations

from ringflow.engine import TrainConfig, fit, phases
from ringflow.models.digits import DigitsClassifier


def test_marks_are_read_back_in_order_and_tabled(tmp_path, monkeypatch):
    path = tmp_path / "phases.jsonl"
    monkeypatch.setenv(phases.ENV, str(path))
    phases.mark("second", at=20.0)
    phases.mark("first", role="worker", at=10.0, epoch=3)
    marks = phases.read(str(path))
    assert [m["phase"] for m in marks] == ["first", "second"]
    assert marks[0]["role"] == "worker"
    assert marks[0]["epoch"] == 3
    assert phases.read(str(path), since=15.0) == marks[1:]
    lines = phases.table(marks, start=5.0)
    assert "5.000 s" in lines[0]
    assert "first {'epoch': 3}" in lines[0]
    assert "15.000 s" in lines[1]
    assert "+ 10.000" in lines[1]


def test_off_unless_asked_for(tmp_path, monkeypatch):
    monkeypatch.delenv(phases.ENV, raising=False)
    phases.mark("nothing")
    assert not list(tmp_path.iterdir())
    assert phases.read(str(tmp_path / "absent")) == []


def test_a_run_marks_its_start_steps_and_end(digits, tmp_path, monkeypatch):
    path = tmp_path / "phases.jsonl"
    monkeypatch.setenv(phases.ENV, str(path))
    fit(
        DigitsClassifier,
        hparams={"hidden": 16},
        data=digits,
        config=TrainConfig(workers=1, epochs=1, batch_size=64, seed=0),
        checkpoint_uri=str(tmp_path / "model"),
        in_process=True,
    )
    seen = [(m["role"], m["phase"]) for m in phases.read(str(path))]
    driver = [phase for role, phase in seen if role == "driver"]
    expected = ["fit called", "driver ready", "workers connected", "steps", "validated"]
    expected += ["epoch ended", "trained", "weights fetched", "workers given back", "model saved"]
    assert [p for p in dict.fromkeys(driver) if p in expected] == expected  # each first end
    assert ("worker", "device ready") in seen
    assert ("worker", "module built") in seen
