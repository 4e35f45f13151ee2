"""A model registry on any fsspec URL: numbered versions and a production pointer that
concurrent writers move by compare-and-swap.

Layout under ``{url}/{model}/``::

    versions/v0001/claim.json                who took the number (written first, exclusively)
    versions/v0001/model/model.safetensors   the weights (a copy of the trained checkpoint)
    versions/v0001/model/manifest.json       the checkpoint's manifest (storage.checkpoint)
    versions/v0001/version.json              the commit: metrics, hparams, data fingerprint
    versions/v0001/decision.json             the promotion gate's last verdict, if any
    moves/00000001.json                      one immutable file per pointer move
    production.json                          the latest move, for cheap reads

A version exists once its ``version.json`` is written, after the checkpoint it describes,
and never changes afterwards. Its number is claimed first with an exclusive create, so two
registrations at once never share a directory.

The production pointer is the sequence of moves. Move ``N + 1`` is created only if no file
of that name exists, in one step that the store makes atomic: ``os.link`` of a complete
temporary file on a local disk, a PUT with ``If-None-Match: *`` on S3, a process-wide lock
for ``memory://`` (which lives in one process). Of two writers that read move ``N``, exactly
one creates ``N + 1``; the other gets :class:`PointerMovedError` naming the winner, and
:func:`promote_if_better` judges its candidate again against it. Moves are never rewritten,
so the history keeps every entry. ``production.json`` is rewritten after each move (a
rename, a single PUT) and may lag behind; readers go on from it through any later moves.
Every file carries a SHA-256 of itself, so damaged or hand-edited ones are refused. Nothing
is pickled; everything is JSON or safetensors.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from numbers import Real
from typing import Any, Literal

import fsspec

from ringflow.storage.checkpoint import ModelClassRefused, read_checkpoint
from ringflow.storage.commit import SealBroken, seal, unseal
from ringflow.storage.fs import create_once, join, publish, read_bytes, sha256

__all__ = [
    "GateDecision",
    "ModelRegistry",
    "ModelVersion",
    "PointerMovedError",
    "Production",
    "RegistryError",
    "dataset_fingerprint",
    "production_checkpoint",
    "promote_if_better",
]

_log = logging.getLogger(__name__)

_VERSION_FORMAT = "ringflow.registry.version/1"
_POINTER_FORMAT = "ringflow.registry.production/1"
_POINTER = "production.json"
_RECORD = "version.json"
_DECISION = "decision.json"
_CLAIM = "claim.json"
_MOVES = "moves"
_CHECKPOINT_FILES = ("model.safetensors", "manifest.json")  # manifest last: it commits
_DATASET_MANIFEST = "_manifest.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_VERSION = re.compile(r"^v(\d{4,})$")
_HISTORY_KEPT = 100
_RACES_KEPT = 64  # a gate losing more races than this gives up (each loss is another's move)

EvaluateFn = Callable[[str], Mapping[str, float]]
"""Evaluates the checkpoint at a URI on held-out data; returns metrics by name."""


class RegistryError(RuntimeError):
    """The registry cannot do what was asked: an unknown version, a damaged record, or a
    promotion the gate cannot decide."""


class PointerMovedError(RegistryError):
    """The production pointer moved between reading it and writing the next move.

    ``winner`` is the move that took the place the writer wanted (a :class:`Production`);
    production may have moved further since. Judge again against where it stands now, or
    run the command again.
    """

    winner: Production | None = None


@dataclass(frozen=True, kw_only=True)
class ModelVersion:
    """A committed, immutable model version."""

    model: str
    """Registered model name, such as ``"digits"``."""
    version: str
    """``v0001``, ``v0002``, ...: numbered in registration order."""
    uri: str
    """URL of the version's checkpoint; :func:`storage.checkpoint.load_model` accepts it."""
    metrics: dict[str, float]
    """Held-out metrics measured when it was registered (``test_accuracy``, ...)."""
    hparams: dict[str, Any]
    """Keyword arguments that rebuild the module."""
    data_fingerprint: str | None
    """SHA-256 of the dataset manifest it was trained and evaluated on."""
    dataset_url: str | None
    """The dataset it was trained and evaluated on."""
    trained_at: str
    """UTC time training finished, ISO 8601."""
    registered_at: str
    """UTC time of registration, ISO 8601."""
    run_key: str | None = None
    """The training run that produced it; registering the same run again is a no-op."""
    checkpoint_sha256: str = ""
    """SHA-256 of the weights file, as its checkpoint manifest records it."""
    source: str = ""
    """Where the checkpoint was copied from."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON metadata."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class Production:
    """What the production pointer says."""

    model: str
    version: str
    """The version being served."""
    sequence: int
    """Counts pointer moves; a reader that sees a higher number sees a newer pointer."""
    updated_at: str
    """UTC time of the last move, ISO 8601."""
    reason: str
    """Why the pointer last moved."""
    previous: tuple[str, ...] = ()
    """Earlier production versions, oldest first; rollback returns to the last one."""
    history: tuple[dict[str, Any], ...] = ()
    """The last moves, oldest first: ``{sequence, action, version, at, reason}``."""


@dataclass(frozen=True, kw_only=True)
class GateDecision:
    """The promotion gate's verdict, with the numbers it compared."""

    promoted: bool
    candidate: str
    production: str | None
    """The production version the candidate was compared with (``None``: there was none)."""
    metric: str
    mode: str
    tolerance: float
    candidate_value: float | None
    production_value: float | None
    basis: str
    """How the numbers were obtained: ``"first"``, ``"stored"`` or ``"re-evaluated"``;
    ``"refused"`` when a checkpoint named a model class the evaluator does not allow."""
    reason: str
    """One sentence a person reads: why the candidate was or was not promoted."""
    decided_at: str = ""
    lost_to: tuple[str, ...] = ()
    """Versions that reached production first while this candidate was being judged, in
    order; the candidate was judged again against each."""
    sequence: int | None = None
    """The pointer move that put the candidate in production, if it was promoted."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------- registry


class ModelRegistry:
    """Versions and the production pointer of one model under one fsspec URL.

    Args:
        url: root URL or local path (``file://``, a plain path, ``memory://``, ``s3://``...).
        model: the model's name: letters, digits and ``._-``.
        storage_options: keyword arguments for the fsspec filesystem (endpoint, profile).
            Checkpoint *sources* passed to :meth:`register` are read with fsspec's defaults.
    """

    def __init__(
        self, url: str, model: str, *, storage_options: Mapping[str, Any] | None = None
    ) -> None:
        if not isinstance(model, str) or not _NAME.match(model):
            raise ValueError(
                f"model must be 1-100 letters, digits or '._-' starting with a letter or digit, "
                f"got {model!r}"
            )
        url = url if "://" in url else os.path.abspath(os.path.expanduser(url))
        try:
            fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        except (ImportError, ValueError) as err:
            raise ValueError(
                f"cannot open {url!r}: {err}. Install the fsspec package for its protocol "
                "(s3fs for s3://, gcsfs for gs://) or use a local path."
            ) from err
        self.url = join(url, model)
        self.model = model
        self._fs = fs
        self._root = join(root.rstrip("/") or root, model)
        self._records: dict[str, ModelVersion] = {}  # committed versions never change

    def __repr__(self) -> str:
        return f"ModelRegistry({self.url!r})"

    # ------------------------------------------------------------------------ versions

    def register(
        self,
        checkpoint_uri: str,
        *,
        metrics: Mapping[str, float],
        data_fingerprint: str | None,
        dataset_url: str | None = None,
        trained_at: str | None = None,
        run_key: str | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> ModelVersion:
        """Copy a verified checkpoint in as the next version and commit its record.

        Registering the same checkpoint of the same ``run_key`` again returns the version
        registered the first time, so a retried task does not add a version.

        Args:
            checkpoint_uri: a checkpoint written by :func:`storage.checkpoint.save_model`.
            metrics: its held-out metrics; non-finite values (a diverged loss) are dropped.
            data_fingerprint: :func:`dataset_fingerprint` of the data it was trained on.
            dataset_url: that dataset, so the gate can re-evaluate on its test split.
            trained_at: when training finished (ISO 8601); defaults to now.
            run_key: the training run, for idempotent retries.
            meta: extra JSON metadata.

        Raises:
            CheckpointError: the checkpoint is missing or does not verify.
            ValueError: metrics or meta that JSON cannot hold.
        """
        ckpt = read_checkpoint(checkpoint_uri)  # verifies sizes and checksums before copying
        blobs = {name: read_bytes(join(checkpoint_uri, name)) for name in _CHECKPOINT_FILES}
        weights_sha = sha256(blobs["model.safetensors"])
        for existing in self.versions():
            if run_key is not None and (existing.run_key, existing.checkpoint_sha256) == (
                run_key,
                weights_sha,
            ):
                return existing
        version = self._claim_number(run_key)
        directory = self._path("versions", version)
        for name in _CHECKPOINT_FILES:
            self._publish(join(directory, "model", name), blobs[name])
        now = _now()
        record = ModelVersion(
            model=self.model,
            version=version,
            uri=join(self.url, "versions", version, "model"),
            metrics=_finite_metrics(metrics),
            hparams=dict(ckpt.hparams),
            data_fingerprint=data_fingerprint,
            dataset_url=dataset_url,
            trained_at=trained_at or now,
            registered_at=now,
            run_key=run_key,
            checkpoint_sha256=weights_sha,
            source=checkpoint_uri,
            meta=_json_copy(meta or {}, "meta"),
        )
        body = {"format": _VERSION_FORMAT, **record.as_dict()}
        self._publish(join(directory, _RECORD), _sealed(body))
        _log.info("registered %s %s from %s", self.model, version, checkpoint_uri)
        return record

    def versions(self) -> list[ModelVersion]:
        """Every committed version, oldest first; uncommitted leftovers are skipped."""
        found = []
        for number in self._numbers():
            record = self._read_record(f"v{number:04d}")
            if record is not None:
                found.append(record)
        return found

    def get(self, version: str) -> ModelVersion:
        """The committed version named ``version``.

        Raises:
            RegistryError: no such committed version, or its record is damaged.
        """
        if not isinstance(version, str) or not _VERSION.match(version):
            raise RegistryError(f"{self.url}: versions are named v0001, v0002...; got {version!r}")
        record = self._read_record(version)
        if record is None:
            known = ", ".join(v.version for v in self.versions()) or "none"
            raise RegistryError(f"{self.url} has no version {version} (committed: {known})")
        return record

    # ------------------------------------------------------------------------ production

    def production(self) -> Production | None:
        """The production pointer, or ``None`` before the first promotion.

        Raises:
            RegistryError: the pointer exists but is damaged or was edited by hand.
        """
        current = self._read_pointer(self._path(_POINTER))
        while True:  # production.json may lag behind the last move
            following = self._read_move(1 if current is None else current.sequence + 1)
            if following is None:
                return current
            current = following

    def history(self) -> list[dict[str, Any]]:
        """Every move of the production pointer, oldest first:
        ``{sequence, action, version, at, reason}``.

        The last 100 come with the pointer; older ones are read from their move files.
        Moves made before the pointer kept one file per move survive only among the last 100.
        """
        current = self.production()
        if current is None:
            return []
        moves = {int(entry["sequence"]): dict(entry) for entry in current.history}
        oldest = min(moves, default=current.sequence + 1)
        for sequence in (n for n in self._move_numbers() if n < oldest):
            pointer = self._read_move(sequence)
            if pointer is not None and pointer.history:
                moves[sequence] = dict(pointer.history[-1])
        return [moves[k] for k in sorted(moves)]

    def production_version(self) -> ModelVersion | None:
        """The version the production pointer names, or ``None`` before the first promotion."""
        pointer = self.production()
        return None if pointer is None else self.get(pointer.version)

    def promote(
        self, version: str, *, reason: str = "promoted", expected: int | None = None
    ) -> Production:
        """Point production at ``version`` (which must be committed); the old one is kept
        on the rollback stack. Promoting the current production version changes nothing.

        Args:
            version: a committed version.
            reason: recorded in the move.
            expected: the pointer's ``sequence`` the caller decided on (0: nothing was in
                production). The move happens only if the pointer is still there. ``None``
                moves it from wherever it stands, trying again if another writer moves first.

        Raises:
            PointerMovedError: ``expected`` was given and the pointer is elsewhere.
        """
        self.get(version)
        for _ in range(_RACES_KEPT):
            current = self.production()
            if expected is not None and _sequence(current) != expected:
                raise self._moved(expected + 1, f"while promoting {version}")
            if current is not None and current.version == version:
                return current
            previous = () if current is None else (*current.previous, current.version)
            try:
                return self._move(current, version, previous, action="promote", reason=reason)
            except PointerMovedError:
                if expected is not None:
                    raise
        raise RegistryError(f"{self.url}: production kept moving; promote {version} again")

    def rollback(self, *, reason: str = "rollback", expected: int | None = None) -> Production:
        """Point production back at the version that was production before the current one.

        Args:
            reason: recorded in the move.
            expected: the pointer's ``sequence`` the caller looked at; defaults to the one
                read here. Either way the move happens only if the pointer is still there.

        Raises:
            RegistryError: nothing is in production, or it has no earlier version.
            PointerMovedError: another writer moved production first; nothing was rolled
                back (look at the new production version and run the rollback again).
        """
        current = self.production()
        if expected is not None and _sequence(current) != expected:
            raise self._moved(expected + 1, "before the rollback")
        if current is None:
            raise RegistryError(f"{self.url}: nothing is in production, so nothing to roll back")
        if not current.previous:
            raise RegistryError(
                f"{self.url}: {current.version} is the first production version; there is no "
                "earlier one to roll back to (promote a version by name instead)"
            )
        target = current.previous[-1]
        self.get(target)  # still committed: never point production at a missing version
        return self._move(current, target, current.previous[:-1], action="rollback", reason=reason)

    def record_decision(self, decision: GateDecision) -> None:
        """Keep the gate's verdict next to the candidate, for whoever asks why later."""
        path = self._path("versions", decision.candidate, _DECISION)
        self._publish(path, json.dumps(decision.as_dict(), indent=1, sort_keys=True).encode())

    def decision(self, version: str) -> dict[str, Any] | None:
        """The gate's last recorded verdict on ``version``, or ``None``."""
        try:
            return json.loads(self._fs.cat_file(self._path("versions", version, _DECISION)))
        except FileNotFoundError:
            return None

    # ------------------------------------------------------------------------ internals

    def _move(
        self,
        current: Production | None,
        version: str,
        previous: tuple[str, ...],
        *,
        action: str,
        reason: str,
    ) -> Production:
        """Create the move after ``current``; :class:`PointerMovedError` if another did."""
        sequence = _sequence(current) + 1
        now = _now()
        event = {"sequence": sequence, "action": action, "version": version, "at": now}
        history = (*(() if current is None else current.history), {**event, "reason": reason})
        pointer = Production(
            model=self.model,
            version=version,
            sequence=sequence,
            updated_at=now,
            reason=reason,
            previous=previous,
            history=history[-_HISTORY_KEPT:],
        )
        body = {"format": _POINTER_FORMAT, "move": uuid.uuid4().hex, **asdict(pointer)}
        body["previous"], body["history"] = list(pointer.previous), list(pointer.history)
        data = _sealed(body)
        if not create_once(self._fs, self._move_path(sequence), data):
            raise self._moved(sequence, f"while moving it to {version}")
        if self._read_move(sequence + 1) is None:  # a newer move makes this head stale
            self._publish(self._path(_POINTER), data)
        _log.info("%s production -> %s (%s #%d: %s)", self.model, version, action, sequence, reason)
        return pointer

    def _moved(self, sequence: int, when: str) -> PointerMovedError:
        """The error for a writer that wanted move ``sequence`` and found it taken; it
        names the version that took it."""
        taken = self._read_move(sequence) if sequence > 0 else None
        taken = taken or self.production()  # a pointer from before one file per move
        where = "nothing" if taken is None else f"{taken.version} (move {taken.sequence})"
        err = PointerMovedError(f"{self.url}: production moved to {where} {when}")
        err.winner = taken
        return err

    def _read_pointer(self, path: str) -> Production | None:
        try:
            self._fs.invalidate_cache(path)
            data = self._fs.cat_file(path)
        except FileNotFoundError:
            return None
        url = join(self.url, path[len(self._root) :])
        body = _unseal(data, url)
        if body.get("format") != _POINTER_FORMAT or body.get("model") != self.model:
            raise RegistryError(f"{url} is not a production pointer")
        try:
            return Production(
                model=body["model"],
                version=body["version"],
                sequence=int(body["sequence"]),
                updated_at=str(body["updated_at"]),
                reason=str(body["reason"]),
                previous=tuple(body["previous"]),
                history=tuple(body["history"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise RegistryError(f"{url} is malformed: {err}") from err

    def _read_move(self, sequence: int) -> Production | None:
        pointer = self._read_pointer(self._move_path(sequence))
        if pointer is not None and pointer.sequence != sequence:
            raise RegistryError(f"{self._move_path(sequence)} records move {pointer.sequence}")
        return pointer

    def _move_path(self, sequence: int) -> str:
        return self._path(_MOVES, f"{sequence:08d}.json")

    def _move_numbers(self) -> list[int]:
        path = self._path(_MOVES)
        try:
            self._fs.invalidate_cache(path)
            entries = self._fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        names = (e.rstrip("/").rsplit("/", 1)[-1] for e in entries)
        return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())

    def _claim_number(self, run_key: str | None) -> str:
        """Take the next free version number with an exclusive create: two registrations
        at once get two numbers, never one directory."""
        claim = json.dumps({"run_key": run_key, "claim": uuid.uuid4().hex, "at": _now()})
        for _ in range(_RACES_KEPT):
            version = f"v{self._next_number():04d}"
            if create_once(self._fs, self._path("versions", version, _CLAIM), claim.encode()):
                return version
        raise RegistryError(f"{self.url}: could not claim a version number; register again")

    def _read_record(self, version: str) -> ModelVersion | None:
        if version in self._records:
            return self._records[version]
        path = self._path("versions", version, _RECORD)
        try:
            self._fs.invalidate_cache(path)
            data = self._fs.cat_file(path)
        except FileNotFoundError:
            return None
        body = _unseal(data, join(self.url, "versions", version, _RECORD))
        if body.pop("format", None) != _VERSION_FORMAT or body.get("version") != version:
            raise RegistryError(f"{join(self.url, 'versions', version)} has a foreign record")
        try:
            record = ModelVersion(**body)
        except TypeError as err:
            raise RegistryError(f"{join(self.url, 'versions', version)}: {err}") from err
        self._records[version] = record
        return record

    def _numbers(self) -> list[int]:
        """Numbers of every version directory, committed or not."""
        path = self._path("versions")
        try:
            self._fs.invalidate_cache(path)
            entries = self._fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        matches = (_VERSION.match(e.rstrip("/").rsplit("/", 1)[-1]) for e in entries)
        return sorted({int(m.group(1)) for m in matches if m})

    def _next_number(self) -> int:
        # Above every directory, committed or not: a leftover is never reused, so a number
        # once seen by anyone always names the same weights.
        numbers = self._numbers()
        return (numbers[-1] if numbers else 0) + 1

    def _publish(self, path: str, data: bytes) -> None:
        publish(self._fs, path, data)

    def _path(self, *parts: str) -> str:
        return join(self._root, *parts)


# ---------------------------------------------------------------------------- gate


def promote_if_better(
    registry: ModelRegistry,
    candidate_version: str,
    *,
    evaluate_fn: EvaluateFn | None = None,
    metric: str = "test_accuracy",
    mode: Literal["min", "max"] = "max",
    tolerance: float = 0.0,
) -> GateDecision:
    """Promote ``candidate_version`` only if it is at least as good as production.

    Both versions are judged on the same held-out data. When they were trained on the same
    dataset (equal data fingerprints) their stored metrics are compared; otherwise, or when
    a stored metric is missing, ``evaluate_fn`` re-evaluates *both* checkpoints on the
    candidate's held-out data. The first version is always promoted. The verdict is
    recorded next to the candidate (``decision.json``) and returned.

    The promotion is a compare-and-swap on the pointer the verdict was reached against. If
    another promotion (or a rollback) moved production in the meantime, this one has lost:
    the candidate is judged again against the new production version, and the decision
    names every version it lost to (``lost_to``) and says so in its ``reason``.

    Args:
        registry: the model's registry.
        candidate_version: a committed version, e.g. from :meth:`ModelRegistry.register`.
        evaluate_fn: ``checkpoint URI -> metrics`` on the candidate's held-out test split.
        metric: the metric compared.
        mode: ``"max"`` when larger is better (accuracy), ``"min"`` for a loss.
        tolerance: how much worse than production the candidate may be and still be
            promoted (absolute, in the metric's units); 0 means "at least as good".

    Raises:
        RegistryError: the data fingerprints differ (or a metric is missing) and no
            ``evaluate_fn`` was given, so the two cannot be compared fairly; or production
            kept moving through 64 attempts.
        ValueError: a bad ``mode`` or ``tolerance``.
    """
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    if not (isinstance(tolerance, int | float) and math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    candidate = registry.get(candidate_version)
    judge = _Judge(metric=metric, mode=mode, tolerance=float(tolerance))
    lost_to: list[str] = []
    for _ in range(_RACES_KEPT):
        pointer = registry.production()
        decision = _judge_against(judge, registry, candidate, pointer, evaluate_fn)
        if lost_to:
            raced = ", then ".join(lost_to)
            decision = replace(
                decision,
                lost_to=tuple(lost_to),
                reason=f"lost to {raced}, promoted while it was judged; judged again: "
                + decision.reason,
            )
        if decision.promoted and decision.production != candidate.version:
            previous = () if pointer is None else (*pointer.previous, pointer.version)
            try:  # from the very pointer the verdict was reached against
                moved = registry._move(
                    pointer, candidate.version, previous, action="promote", reason=decision.reason
                )
            except PointerMovedError as err:
                lost_to.append("nothing" if err.winner is None else err.winner.version)
                _log.info("gate on %s %s: %s", registry.model, candidate.version, err)
                continue
            decision = replace(decision, sequence=moved.sequence)
        registry.record_decision(decision)
        _log.info("gate on %s %s: %s", registry.model, candidate.version, decision.reason)
        return decision
    raise RegistryError(
        f"{registry.url}: {candidate.version} lost {len(lost_to)} races for the production "
        "pointer; run the promotion again"
    )


def _judge_against(
    judge: _Judge,
    registry: ModelRegistry,
    candidate: ModelVersion,
    pointer: Production | None,
    evaluate_fn: EvaluateFn | None,
) -> GateDecision:
    """The gate's verdict on ``candidate`` against the version ``pointer`` names."""
    if pointer is None:
        return judge.first(candidate)
    if pointer.version == candidate.version:
        return judge.already(candidate)
    production = registry.get(pointer.version)
    try:
        values, basis = _compare_values(
            candidate, production, metric=judge.metric, evaluate_fn=evaluate_fn
        )
    except ModelClassRefused as err:  # storage named a class this process does not trust
        return judge.refused(candidate, production, err)
    return judge.compare(candidate, production, *values, basis=basis)


def _compare_values(
    candidate: ModelVersion,
    production: ModelVersion,
    *,
    metric: str,
    evaluate_fn: EvaluateFn | None,
) -> tuple[tuple[float | None, float | None], str]:
    same_data = (
        candidate.data_fingerprint is not None
        and candidate.data_fingerprint == production.data_fingerprint
    )
    stored = (candidate.metrics.get(metric), production.metrics.get(metric))
    if same_data and None not in stored:
        return stored, "stored"
    if evaluate_fn is None:
        why = "they were trained on different data" if not same_data else f"{metric} is missing"
        raise RegistryError(
            f"cannot compare {candidate.version} with production {production.version} on "
            f"{metric}: {why}. Pass evaluate_fn to re-evaluate both on the candidate's "
            "held-out test split."
        )
    values = tuple(_metric_of(evaluate_fn(v.uri), metric, v) for v in (candidate, production))
    return values, "re-evaluated"


def _metric_of(metrics: Mapping[str, float], metric: str, version: ModelVersion) -> float | None:
    if metric not in metrics:
        raise RegistryError(
            f"evaluate_fn returned no {metric!r} for {version.version} (got {sorted(metrics)}); "
            "pick a metric it reports"
        )
    value = metrics[metric]
    return float(value) if _finite(value) else None


@dataclass(frozen=True, kw_only=True)
class _Judge:
    metric: str
    mode: str
    tolerance: float

    def first(self, candidate: ModelVersion) -> GateDecision:
        return self._decide(
            candidate,
            None,
            promoted=True,
            values=(candidate.metrics.get(self.metric), None),
            basis="first",
            reason=f"{candidate.version} is the first version: promoted without comparison",
        )

    def already(self, candidate: ModelVersion) -> GateDecision:
        return self._decide(
            candidate,
            candidate.version,
            promoted=True,
            values=(candidate.metrics.get(self.metric),) * 2,
            basis="stored",
            reason=f"{candidate.version} is already in production",
        )

    def refused(
        self, candidate: ModelVersion, production: ModelVersion, err: ModelClassRefused
    ) -> GateDecision:
        """Not promoted: a checkpoint to re-evaluate names a class the evaluator refuses, so
        the two cannot be compared; production stays where it is."""
        return self._decide(
            candidate,
            production.version,
            promoted=False,
            values=(None, None),
            basis="refused",
            reason=f"kept {production.version}: {candidate.version} was not compared with it: "
            f"{err} (allow that class to compare them, or move the pointer by hand)",
        )

    def compare(
        self,
        candidate: ModelVersion,
        production: ModelVersion,
        new: float | None,
        old: float | None,
        *,
        basis: str,
    ) -> GateDecision:
        name, c, p = self.metric, candidate.version, production.version
        on = "on the same data" if basis == "stored" else "both re-evaluated on the same split"
        if new is None:
            promoted, reason = False, f"kept {p}: {c} has no finite {name} ({on})"
        elif old is None:
            promoted, reason = True, f"promoted {c}: {name}={new:.4f}, {p} has none ({on})"
        else:
            sign = 1.0 if self.mode == "max" else -1.0
            promoted = sign * (new - old) >= -self.tolerance
            verdict = f"promoted {c}" if promoted else f"kept {p}"
            better = "higher" if self.mode == "max" else "lower"
            reason = (
                f"{verdict}: {name} {new:.4f} vs {old:.4f} for {p} ({better} is better, "
                f"tolerance {self.tolerance:g}, {on})"
            )
        return self._decide(
            candidate, p, promoted=promoted, values=(new, old), basis=basis, reason=reason
        )

    def _decide(
        self,
        candidate: ModelVersion,
        production: str | None,
        *,
        promoted: bool,
        values: tuple[float | None, float | None],
        basis: str,
        reason: str,
    ) -> GateDecision:
        return GateDecision(
            promoted=promoted,
            candidate=candidate.version,
            production=production,
            metric=self.metric,
            mode=self.mode,
            tolerance=self.tolerance,
            candidate_value=values[0],
            production_value=values[1],
            basis=basis,
            reason=reason,
            decided_at=_now(),
        )


# ---------------------------------------------------------------------------- helpers


def dataset_fingerprint(dataset_url: str) -> str:
    """SHA-256 of a committed dataset's manifest: equal fingerprints mean the same splits,
    row for row (the manifest lists every shard's checksum)."""
    return sha256(read_bytes(join(dataset_url, _DATASET_MANIFEST)))


def production_checkpoint(
    url: str, model: str, *, storage_options: Mapping[str, Any] | None = None
) -> str | None:
    """The checkpoint URI of ``model``'s production version, or ``None`` if there is none
    (for warm-starting a retrain from what is served)."""
    version = ModelRegistry(url, model, storage_options=storage_options).production_version()
    return None if version is None else version.uri


def _sequence(pointer: Production | None) -> int:
    return 0 if pointer is None else pointer.sequence


def _sealed(body: dict[str, Any]) -> bytes:
    """A registry record: ``body`` sealed (``storage.commit.seal``), numbers finite."""
    return seal(body, indent=1, allow_nan=False)


def _unseal(data: bytes, url: str) -> dict[str, Any]:
    try:
        return unseal(data)
    except SealBroken as err:
        if err.damaged:
            raise RegistryError(f"{url} fails its checksum (damaged or edited by hand)") from err
        raise RegistryError(f"{url} is not a registry record: {err}") from err


def _finite_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    wrong = {k: v for k, v in metrics.items() if isinstance(v, bool) or not isinstance(v, Real)}
    if wrong:
        raise ValueError(f"metrics must map names to numbers, got {wrong!r}")
    return {str(k): float(v) for k, v in metrics.items() if math.isfinite(float(v))}


def _json_copy(value: Mapping[str, Any], what: str) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(dict(value), allow_nan=False))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what} must be JSON-serialisable: {err}") from err


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
