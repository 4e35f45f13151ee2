"""A replacement worker killed at each point of its join: the run goes on or fails as the
failure policy says, never with a Ray exception."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from ringflow.engine import TrainConfig, fit
from ringflow.models.digits import DigitsClassifier
from tests.support.fitting import KILLED_PEER_DEADLINE_S, relative_difference, short_handed

HPARAMS = {"hidden": 32, "lr": 0.05}


def _die(delay_s: float = 0.0) -> None:
    """SIGKILL this process, at once or from a thread ``delay_s`` later."""
    if not delay_s:
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGKILL)).start()


class DiesWhileJoining(DigitsClassifier):
    """Rank 1 kills itself at its third step; the first replacement built after that kills
    itself at ``point`` of its join: while it builds its module (``build``), while it takes
    the survivors' commit (``adopt``: its first ``state_dict`` call), or just after, while
    the ring is rebuilt with it (``connect``). Each kill happens once (a marker file)."""

    def __init__(self, *, point: str, markers: str, **hparams) -> None:
        super().__init__(**hparams)
        self.point, self.markers = point, markers
        self.replacement = self._built_after_the_loss()
        if self.replacement and point == "build":
            self._once(point)

    def _mark(self, name: str) -> bool:
        """Leave marker ``name``; whether it was new."""
        try:
            with open(os.path.join(self.markers, name), "x") as mark:
                mark.write(str(os.getpid()))
        except FileExistsError:
            return False
        return True

    def _built_after_the_loss(self) -> bool:
        """Whether this is a Ray worker's module built after rank 1 was killed."""
        import ray

        in_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
        return in_actor and os.path.exists(os.path.join(self.markers, "rank1"))

    def _once(self, point: str, delay_s: float = 0.0) -> None:
        if self._mark(point):
            _die(delay_s)

    def training_step(self, batch, batch_idx):
        # As if on an accelerator: the replacement starts while rank 1 waits; and while one
        # worker trains alone, slow enough for a later replacement to start and join before
        # the run ends, however busy the machine (up to two minutes).
        time.sleep(0.2 if short_handed(self, batch_idx, 2) else 0.01)
        if self.global_rank == 1 and self.global_step == 3 and self._mark("rank1"):
            _die()
        return super().training_step(batch, batch_idx)

    def state_dict(self, *args, **kwargs):
        if self.point in ("adopt", "connect") and self.replacement:
            self._once(self.point, delay_s=0.0 if self.point == "adopt" else 0.3)
        return super().state_dict(*args, **kwargs)


def _fit(tmp_path, digits, name: str, **hparams):
    module = DiesWhileJoining if hparams else DigitsClassifier
    return fit(
        module,
        hparams={**HPARAMS, **hparams},
        data=digits,
        config=TrainConfig(
            workers=2,
            min_workers=1,
            epochs=30,  # long enough for replacements to start on two busy cores
            batch_size=64,
            seed=3,
            cpus_per_worker=0.5,
            collective_timeout_s=KILLED_PEER_DEADLINE_S,
        ),
        checkpoint_uri=str(tmp_path / name),
    )


@pytest.fixture(scope="module")
def reference(ray_session, digits, tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("reference"), digits, "reference")


@pytest.mark.ray
@pytest.mark.parametrize("point", ["build", "adopt", "connect"])
def test_a_replacement_killed_while_it_joins_leaves_the_run_to_the_policy(
    ray_session, digits, tmp_path, point, reference
):
    markers = tmp_path / "markers"
    markers.mkdir()
    # Killed while the ring is rebuilt with it, the replacement leaves the survivor waiting
    # at the rendezvous for at most ``rejoin_timeout_s``: the rebuild then fails there, the
    # replacement is lost and the survivor goes on.
    result = _fit(tmp_path, digits, point, point=point, markers=str(markers))
    assert (markers / "rank1").exists()
    assert (markers / point).exists(), f"no replacement was killed at {point}"
    kinds = [e.kind for e in result.events]
    assert kinds[0] == "lost", result.events
    assert "joined" in kinds, result.events
    assert result.events[-1].workers == 2  # a later replacement joined
    assert relative_difference(result.state_dict, reference.state_dict) < 1e-5


class DiesAtFitStart(DigitsClassifier):
    """Rank 1's first worker kills itself in its ``on_fit_start`` hook: the group is up and
    connected and its first commit made, nothing trained. Once (a marker file)."""

    def __init__(self, *, markers: str, **hparams) -> None:
        super().__init__(**hparams)
        self.markers = markers

    def on_fit_start(self) -> None:
        if self.global_rank != 1:
            return
        try:
            with open(os.path.join(self.markers, "fit_start"), "x") as mark:
                mark.write(str(os.getpid()))
        except FileExistsError:
            return
        _die()


@pytest.mark.ray
def test_a_worker_killed_before_anything_is_trained_starts_the_group_again(
    ray_session, digits, tmp_path, reference
):
    markers = tmp_path / "markers"
    markers.mkdir()
    result = fit(
        DiesAtFitStart,
        hparams={**HPARAMS, "markers": str(markers)},
        data=digits,
        config=TrainConfig(
            workers=2,
            min_workers=1,
            epochs=30,
            batch_size=64,
            seed=3,
            cpus_per_worker=0.5,
            collective_timeout_s=KILLED_PEER_DEADLINE_S,
        ),
        checkpoint_uri=str(tmp_path / "model"),
    )
    assert (markers / "fit_start").exists(), "no worker was killed"
    assert result.events == [], result.events  # a new start, not a recovery: nothing lost
    for name, tensor in reference.state_dict.items():
        assert torch.equal(result.state_dict[name], tensor), name
