"""Data-parallel training: the averaging is proven against one worker, not assumed."""

from __future__ import annotations

import pytest
import torch

from ringflow.engine import EngineError, TrainConfig, evaluate, fit
from ringflow.engine.collective import available_collectives, create_collective
from ringflow.engine.worker import split_global_batch
from ringflow.models.digits import DigitsClassifier
from tests.support.fitting import relative_difference


@pytest.mark.parametrize(("size", "world"), [(64, 1), (64, 2), (29, 2), (7, 3), (2, 5)])
def test_global_batch_parts_cover_it_once(size, world):
    batch = torch.randperm(1000)[:size]
    parts = [split_global_batch(batch, rank=r, world_size=world) for r in range(world)]
    assert torch.equal(torch.cat(parts), batch)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.ray
def test_two_workers_end_an_epoch_with_the_weights_of_one(ray_session, digits, tmp_path):
    # 1,438 training rows in batches of 64: the last batch (30 rows) is split unevenly too.
    states = {}
    for workers in (1, 2):
        result = fit(
            DigitsClassifier,
            hparams={"hidden": 32, "lr": 0.01},
            data=digits,
            config=TrainConfig(workers=workers, epochs=1, batch_size=64, seed=3),
            checkpoint_uri=str(tmp_path / f"w{workers}"),
        )
        states[workers] = result.state_dict
    initial = DigitsClassifier(hidden=32).state_dict()
    assert relative_difference(states[2], states[1]) < 1e-5
    # ...and training really moved the weights, so the comparison above means something.
    assert relative_difference(states[1], initial) > 1e-2


@pytest.mark.ray
def test_checkpoint_holds_the_trained_weights(ray_session, digits, tmp_path):
    result = fit(
        DigitsClassifier,
        hparams={"hidden": 32, "lr": 0.01},
        data=digits,
        config=TrainConfig(workers=2, epochs=3, batch_size=64),
        checkpoint_uri=str(tmp_path / "model"),
    )
    assert [m.epoch for m in result.history] == [0, 1, 2]
    assert result.history[-1].metrics["train_loss"] < result.history[0].metrics["train_loss"]
    test = evaluate(result.checkpoint, digits, model=DigitsClassifier)
    assert test["test_accuracy"] > 0.85


def test_in_process_single_worker_matches_its_own_rerun(digits, tmp_path):
    runs = [
        fit(
            DigitsClassifier,
            hparams={"hidden": 16, "lr": 0.01},
            data=digits,
            config=TrainConfig(workers=1, epochs=2, batch_size=32, seed=7),
            checkpoint_uri=str(tmp_path / f"run{i}"),
            in_process=True,
        )
        for i in range(2)
    ]
    first, second = (run.state_dict for run in runs)
    assert all(torch.equal(first[k], second[k]) for k in first)


class _FailsInItsSecondStep(DigitsClassifier):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise ValueError("the second batch is wrong")
        return super().training_step(batch, batch_idx)


def test_an_in_process_fit_gives_the_caller_its_threads_and_generator_back(digits, tmp_path):
    """The worker trains on cpus_per_worker threads and reseeds torch's generator at every
    step; what the caller runs afterwards runs on as many threads as before (and so rounds as
    before) and draws the numbers it would have drawn, whether fit ends or fails."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    torch.manual_seed(123)
    generator = torch.random.get_rng_state()
    config = TrainConfig(workers=1, epochs=1, batch_size=64, seed=0, cpus_per_worker=1)
    try:
        fit(
            DigitsClassifier,
            hparams={},
            data=digits,
            config=config,
            checkpoint_uri=str(tmp_path / "a"),
            in_process=True,
        )
        assert torch.get_num_threads() == 3
        assert torch.equal(torch.random.get_rng_state(), generator)
        with pytest.raises(ValueError, match="the second batch is wrong"):
            fit(
                _FailsInItsSecondStep,
                hparams={},
                data=digits,
                config=config,
                checkpoint_uri=str(tmp_path / "b"),
                in_process=True,
            )
        assert torch.get_num_threads() == 3
        assert torch.equal(torch.random.get_rng_state(), generator)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("workers", {"workers": 0}),
        ("epochs", {"epochs": -1}),
        ("batch_size", {"batch_size": 0}),
        ("batch_size", {"workers": 4, "batch_size": 2}),
        ("collective", {"collective": "carrier-pigeon"}),
        ("cpus_per_worker", {"cpus_per_worker": 0}),
    ],
)
def test_bad_config_names_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**kwargs)


def test_unknown_collective_lists_the_known_ones():
    assert "native" in available_collectives()
    with pytest.raises(ValueError, match="native"):
        create_collective("nope", rank=0, world_size=1)


def test_bad_hparams_fail_before_any_worker_starts(digits, tmp_path):
    with pytest.raises(ValueError, match="width"):
        fit(
            DigitsClassifier,
            hparams={"width": 3},
            data=digits,
            config=TrainConfig(workers=1, epochs=1),
            checkpoint_uri=str(tmp_path / "never"),
        )
    assert not (tmp_path / "never").exists()


@pytest.mark.ray
def test_more_workers_than_cpus_is_refused_up_front(ray_session, digits, tmp_path):
    with pytest.raises(EngineError, match="lower workers"):
        fit(
            DigitsClassifier,
            hparams={},
            data=digits,
            config=TrainConfig(workers=64, epochs=1, batch_size=64),
            checkpoint_uri=str(tmp_path / "never"),
        )


def test_warm_start_begins_from_the_given_model(digits, tmp_path):
    def run(name, **kwargs):
        return fit(
            DigitsClassifier,
            hparams={"hidden": 32, "lr": 0.01},
            data=digits,
            config=TrainConfig(workers=1, epochs=2, batch_size=64, seed=1),
            checkpoint_uri=str(tmp_path / name),
            in_process=True,
            **kwargs,
        )

    first = run("first")
    cold = run("cold")
    warm = run("warm", init_from=first.checkpoint)
    assert warm.history[0].metrics["train_loss"] < 0.8 * cold.history[0].metrics["train_loss"]
    with pytest.raises(ValueError, match="cannot warm-start"):
        fit(
            DigitsClassifier,
            hparams={"hidden": 64, "lr": 0.01},
            data=digits,
            config=TrainConfig(workers=1, epochs=1, batch_size=64),
            checkpoint_uri=str(tmp_path / "wide"),
            in_process=True,
            init_from=first.checkpoint,
        )


def test_a_runs_record_names_the_environment_overrides_its_workers_had(
    digits, tmp_path, monkeypatch
):
    """The GPU ring's settings (``TrainConfig.symm``) and the environment variables that
    override them are in the committed model's record: a run is reproducible from what it
    records."""
    from ringflow.storage.checkpoint import read_checkpoint

    config = TrainConfig(workers=1, epochs=1, batch_size=256, seed=0, symm={"depth": 4})

    def recorded(name: str) -> tuple[dict, dict]:
        result = fit(
            DigitsClassifier,
            hparams={},
            data=digits,
            config=config,
            checkpoint_uri=str(tmp_path / name),
            in_process=True,
        )
        meta = read_checkpoint(result.checkpoint).meta
        return meta["train_config"]["symm"], meta["environment"]

    settings, overrides = recorded("plain")
    assert (settings["depth"], settings["graphs"], overrides) == (4, True, {})
    monkeypatch.setenv("RINGFLOW_SYMM_DEPTH", "3")
    monkeypatch.setenv("RINGFLOW_UNRELATED", "1")
    assert recorded("overridden") == (settings, {"RINGFLOW_SYMM_DEPTH": "3"})
