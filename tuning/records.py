"""A search's records under ``{storage_url}/tune/{run_key}/``: JSON only, each written whole, read
back into the search's history (every trial's parameters, epochs, rungs and end), with
every storage call retried under the search's policy.
"""

from __future__ import annotations

import json
import logging
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ringflow.storage.fs import atomic_write, join, read_bytes, resolve
from ringflow.storage.layout import Workspace, trial_run_key
from ringflow.storage.retry import RetryPolicy, call_with_retries

EPOCH = "epoch"
"""Reported with every result (1-based); the scheduler's clock, so a resumed trial that
skips the epochs restored from its checkpoint still reports consistent times."""


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    return is_number(value) and math.isfinite(value)


log = logging.getLogger("ringflow.engine")

_RECORD = re.compile(
    r"^trials/(?P<trial>\d{5})/(?:starts/[0-9a-f]{32}|epochs/\d{6}|rungs/\d{6}|done|stopped)\.json$"
)
"""Every file ringflow writes under a search's directory; anything else there is foreign."""


@dataclass(frozen=True)
class RecordStorage:
    """Small JSON reads and writes on any fsspec URL, each retried under ``policy``."""

    policy: RetryPolicy

    def write(self, url: str, value: Any) -> None:
        data = json.dumps(value, sort_keys=True).encode()
        call_with_retries(self.policy, f"writing {url}", lambda: atomic_write(url, data))

    def read(self, url: str) -> Any:
        """The JSON at ``url``, or ``None`` (with a warning) if it is not JSON."""
        data = call_with_retries(self.policy, f"reading {url}", lambda: read_bytes(url))
        try:
            return json.loads(data)
        except ValueError:  # undecodable text included
            log.warning("%s is not JSON; it is ignored (ringflow never unpickles it)", url)
            return None

    def find(self, url: str) -> list[str]:
        """Every file under ``url``, relative to it, as the storage lists it now."""
        fs, root = resolve(url)

        def listing() -> list[str]:
            fs.invalidate_cache()  # other processes write here: never trust a cached listing
            try:
                found = fs.find(root)
            except FileNotFoundError:
                return []
            return [p[len(root.rstrip("/")) + 1 :] for p in found]

        return call_with_retries(self.policy, f"listing {url}", listing)


@dataclass(frozen=True, kw_only=True)
class _TrialRecords:
    """What one trial wrote under ``{tune dir}/trials/{trial}``: JSON only, ours."""

    url: str
    storage: RecordStorage

    def started(self, **info: Any) -> None:
        self.storage.write(join(self.url, "starts", f"{uuid.uuid4().hex}.json"), info)

    def epoch(self, metrics: dict[str, float]) -> None:
        self.storage.write(join(self.url, "epochs", f"{int(metrics[EPOCH]):06d}.json"), metrics)

    def decided(self, decision: dict[str, Any]) -> None:
        """An early-stopping decision: ``{"epoch", "value", "decision"}``."""
        self.storage.write(join(self.url, "rungs", f"{int(decision[EPOCH]):06d}.json"), decision)

    def finish(self, **info: Any) -> None:
        self.storage.write(join(self.url, "done.json"), info)

    def stopped(self, **info: Any) -> None:
        self.storage.write(join(self.url, "stopped.json"), info)

    def done(self) -> dict[str, Any] | None:
        if "done.json" not in self.storage.find(self.url):
            return None
        done = self.storage.read(join(self.url, "done.json"))
        return done if _is_done(done) else None


@dataclass(frozen=True, kw_only=True)
class RecordedTrial:
    """One trial as its records describe it."""

    trial_id: str
    params: dict[str, Any] | None = None
    executions: int = 0
    epochs: list[dict[str, Any]] = field(default_factory=list)
    done: dict[str, Any] | None = None
    stopped_at: int | None = None
    """The epoch after which the scheduler stopped it."""
    decisions: dict[int, dict[str, Any]] = field(default_factory=dict)
    """The scheduler's decisions on it, by epoch: ``{"value", "decision"}``."""

    @property
    def finished(self) -> bool:
        return self.done is not None or self.stopped_at is not None

    def curve(self) -> list[dict[str, Any]]:
        """Its epochs, up to the one it was stopped after."""
        last = self.stopped_at or math.inf
        return [m for m in self.epochs if m.get(EPOCH, 0) <= last]


@dataclass(frozen=True, kw_only=True)
class History:
    """Every trial of a search, read from its records, and what else lies in its directory."""

    trials: dict[str, RecordedTrial]
    foreign: list[str]
    """Files under the search's directory that ringflow did not write (or not as JSON)."""

    @property
    def resumed(self) -> bool:
        return bool(self.trials)


@dataclass(frozen=True, kw_only=True)
class SearchLayout:
    storage_url: str
    run_key: str
    storage: RecordStorage

    @property
    def tune_dir(self) -> str:
        return Workspace(self.storage_url).tune(self.run_key)

    @property
    def checkpoints(self) -> str:
        return Workspace(self.storage_url).checkpoints

    def trial(self, trial_id: str) -> _TrialRecords:
        return _TrialRecords(url=join(self.tune_dir, "trials", trial_id), storage=self.storage)

    def trial_run_key(self, trial_id: str) -> str:
        return trial_run_key(self.run_key, trial_id)

    def model(self, trial_id: str) -> str:
        return Workspace(self.storage_url).trial_model(self.run_key, trial_id)

    def history(self) -> History:
        """Read every record: one listing, then the JSON files. Nothing else is opened."""
        files: dict[str, dict[str, Any]] = {}
        foreign = []
        for rel in sorted(self.storage.find(self.tune_dir)):
            match = _RECORD.match(rel)
            value = self.storage.read(join(self.tune_dir, rel)) if match else None
            if not isinstance(value, dict):
                foreign.append(rel)
                continue
            files.setdefault(match["trial"], {})[rel.split("/", 2)[2]] = value
        return History(
            trials={t: _recorded(t, records) for t, records in sorted(files.items())},
            foreign=foreign,
        )


def _recorded(trial_id: str, records: dict[str, dict[str, Any]]) -> RecordedTrial:
    starts = [v for k, v in records.items() if k.startswith("starts/")]
    epochs = sorted(
        (v for k, v in records.items() if k.startswith("epochs/") and EPOCH in v),
        key=lambda m: m[EPOCH],
    )
    params = next((s["params"] for s in starts if isinstance(s.get("params"), dict)), None)
    done = records.get("done.json")
    decisions = {
        int(v[EPOCH]): {"value": float(v["value"]), "decision": v["decision"]}
        for k, v in records.items()
        if k.startswith("rungs/")
        and is_number(v.get(EPOCH))
        and is_number(v.get("value"))
        and v.get("decision") in ("continue", "stop")
    }
    stopped = records.get("stopped.json", {}).get(EPOCH)
    if not is_number(stopped):  # stopped before its stop was recorded as stopped.json
        stopped = min((e for e, d in decisions.items() if d["decision"] == "stop"), default=None)
    return RecordedTrial(
        trial_id=trial_id,
        params=params,
        executions=len(starts),
        epochs=epochs,
        done=done if _is_done(done) else None,
        stopped_at=None if stopped is None else int(stopped),
        decisions=decisions,
    )


def _is_done(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("checkpoint"), str)
        and isinstance(value.get("last"), dict)
    )


def trial_id_of(index: int) -> str:
    return f"{index:05d}"
