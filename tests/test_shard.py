"""Sharded data parallel, ZeRO-1 (``TrainConfig.shard="optimizer"``): each worker keeps the
optimizer state of its shard of the parameters, and training ends where ``shard="none"``
ends."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ringflow.engine import TrainConfig, fit
from ringflow.models.digits import DigitsClassifier
from tests.support.fitting import relative_difference

HPARAMS = {"hidden": 32, "lr": 0.01}


class _Measured(DigitsClassifier):
    """Writes the bytes of its optimizer's state tensors, per rank, where training ends."""

    def __init__(self, record: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.record = record

    def on_train_end(self) -> None:
        optimizer = self.optimizers()
        optimizer = getattr(optimizer, "optimizer", optimizer)
        size = sum(
            value.numel() * value.element_size()
            for entry in optimizer.state.values()
            for value in entry.values()
            if isinstance(value, torch.Tensor)
        )
        Path(self.record, str(self.trainer.global_rank)).write_text(str(size))


def _fit(digits, tmp_path, name: str, *, store_url=None, run_key=None, **config):
    record = tmp_path / f"bytes-{run_key or name}"  # a resumed run's hparams are the same
    record.mkdir(exist_ok=True)
    settings = {"workers": 2, "epochs": 3, "batch_size": 64, "seed": 3, **config}
    result = fit(
        _Measured,
        hparams={**HPARAMS, "record": str(record)},
        data=digits,
        config=TrainConfig(**settings),
        checkpoint_uri=str(tmp_path / name),
        store_url=store_url,
        run_key=run_key,
    )
    state_bytes = [int((record / str(r)).read_text()) for r in range(settings["workers"])]
    return result, state_bytes


@pytest.mark.ray
def test_sharded_adam_on_two_workers_ends_where_unsharded_ends_with_half_the_state(
    ray_session, digits, tmp_path
):
    """69 steps of Adam: the weights within 1e-6 of ``shard="none"``'s, and each worker
    holds about half of the optimizer state (several buckets: a parameter cut by a shard's
    edge is stepped in two pieces, one on each worker)."""
    none, whole = _fit(digits, tmp_path, "none", bucket_mb=0.004)
    sharded, parts = _fit(digits, tmp_path, "sharded", bucket_mb=0.004, shard="optimizer")
    assert relative_difference(sharded.state_dict, none.state_dict) < 1e-6
    initial = DigitsClassifier(hidden=32).state_dict()
    assert relative_difference(none.state_dict, initial) > 1e-2  # training moved the weights
    assert whole[0] == whole[1] > 0
    assert all(part <= 0.55 * whole[0] for part in parts), (parts, whole)


@pytest.mark.ray
def test_sharded_with_accumulation_and_clipping_on_four_workers_ends_where_unsharded_ends(
    ray_session, digits, tmp_path
):
    """Accumulation over 2 batches and clipping by the global norm (small enough to clip
    every step: each worker's shard alone has a smaller norm) on 4 workers, each holding
    about a quarter of the state."""
    config = {
        "workers": 4,
        "epochs": 4,  # 12 optimizer steps an epoch
        "accumulate_grad_batches": 2,
        "gradient_clip_val": 0.05,
        "commit_every": 4,
        "cpus_per_worker": 0.5,
    }
    none, whole = _fit(digits, tmp_path, "none4", **config)
    sharded, parts = _fit(digits, tmp_path, "sharded4", shard="optimizer", **config)
    assert relative_difference(sharded.state_dict, none.state_dict) < 1e-6
    assert all(part <= 0.3 * whole[0] for part in parts), (parts, whole)
    # The clipping acted (so a norm of one shard's gradients alone would have shown):
    unclipped = {**config, "gradient_clip_val": None, "workers": 2}
    assert (
        relative_difference(
            _fit(digits, tmp_path, "unclipped", **unclipped)[0].state_dict, none.state_dict
        )
        > 1e-3
    )


@pytest.mark.ray
def test_a_sharded_run_resumes_bitwise_and_its_checkpoint_loads_unsharded(
    ray_session, digits, tmp_path
):
    """The checkpoint holds the whole optimizer state, in the format of ``shard="none"``:
    a sharded run resumed ends bit for bit as the uninterrupted one, and the same
    checkpoint resumes unsharded to where an unsharded run ends (same math, another
    summation order)."""
    store = str(tmp_path / "store")
    every = {"shard": "optimizer", "checkpoint_every": 10, "epochs": 3}
    reference = _fit(digits, tmp_path, "reference", **every)[0]
    _fit(digits, tmp_path, "first", store_url=store, run_key="r", **{**every, "epochs": 2})
    resumed = _fit(digits, tmp_path, "resumed", store_url=store, run_key="r", **every)[0]
    assert resumed.resumed_from == 46
    assert resumed.state_dict.keys() == reference.state_dict.keys()
    for name, tensor in reference.state_dict.items():
        assert torch.equal(resumed.state_dict[name], tensor), name
    unsharded = _fit(digits, tmp_path, "unsharded", store_url=store, run_key="r", epochs=4)[0]
    assert unsharded.resumed_from == 69
    plain = _fit(digits, tmp_path, "plain", epochs=4)[0]
    assert relative_difference(unsharded.state_dict, plain.state_dict) < 1e-5


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"shard": "zero"}, "shard must be one of"),
        ({"shard": "gradients"}, "not yet built"),
        ({"shard": "parameters"}, "not yet built"),
        ({"shard": "optimizer", "compression": "powersgd"}, "does not compose with compression"),
        ({"shard": "optimizer", "precision": "16-mixed"}, "does not compose with precision"),
        ({"shard": "optimizer", "workers": 3, "min_workers": 2}, "min_workers below workers"),
    ],
)
def test_shard_modes_not_built_or_not_composing_are_refused_in_one_line(config, message):
    with pytest.raises(ValueError, match=message) as raised:
        TrainConfig(**config)
    assert "\n" not in str(raised.value)


def test_an_optimizer_that_is_not_elementwise_is_refused_in_one_line():
    from ringflow.engine.errors import ModelError
    from ringflow.engine.sharding import check_elementwise

    check_elementwise(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]))
    with pytest.raises(ModelError, match="LBFGS may not update element by element"):
        check_elementwise(torch.optim.LBFGS([torch.zeros(1, requires_grad=True)]))


@pytest.mark.ray
def test_manual_optimisation_under_shard_is_refused_before_any_worker_starts(tmp_path, ray_session):
    from ringflow.engine import ModelError
    from tests.test_manual_optimisation import NoiseFromData, images, under_ringflow

    with pytest.raises(ModelError, match="does not compose with manual optimisation") as raised:
        under_ringflow(NoiseFromData, {}, images(), tmp_path, workers=2, shard="optimizer")
    assert "\n" not in str(raised.value)
