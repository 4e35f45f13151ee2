"""The character-level LM demo: standard-library text through the dataset layout, trained as
a pipeline, committed as a model the existing evaluate step loads."""

from __future__ import annotations

import math

import pytest

from ringflow.engine import DataSpec, TrainConfig, evaluate, fit
from ringflow.engine.pipeline import PipelineConfig, model_layers
from ringflow.models.charlm import CharLM, charlm_schema, stdlib_text, write_charlm_parquet
from ringflow.storage.dataset import preprocess, read_split

CONTEXT = 16


@pytest.fixture(scope="module")
def charlm_data(tmp_path_factory) -> DataSpec:
    root = str(tmp_path_factory.mktemp("charlm"))
    write_charlm_parquet(f"{root}/raw/stdlib.parquet", context=CONTEXT, max_chars=40_000)
    schema = charlm_schema(CONTEXT)
    result = preprocess(f"{root}/raw/stdlib.parquet", root, schema, seed=0)
    return DataSpec(dataset_url=result.dataset_url, schema=schema)


def test_the_text_is_the_same_on_every_call():
    assert stdlib_text(max_chars=5_000) == stdlib_text(max_chars=5_000)
    assert len(stdlib_text(max_chars=5_000)) == 5_000


def test_windows_hold_ids_and_next_character_targets(charlm_data):
    x, y = read_split(charlm_data.dataset_url, "train", charlm_data.schema)
    ids, targets = CharLM.pipeline_batch(*_tensors(x[:4], y[:4]))
    assert ids.shape == targets.shape == (4, CONTEXT)
    assert (ids[:, 1:] == targets[:, :-1]).all()


def test_layers_are_embedding_blocks_then_head():
    names = [name for name, _ in model_layers(CharLM(depth=3))]
    assert names == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]


def test_two_stage_charlm_learns_and_evaluates_like_the_whole_model(charlm_data, tmp_path):
    hparams = {"context": CONTEXT, "width": 32, "depth": 2, "heads": 2, "lr": 3e-3}
    result = fit(
        CharLM,
        hparams=hparams,
        data=charlm_data,
        config=TrainConfig(workers=1, epochs=2, batch_size=64, seed=0),
        pipeline=PipelineConfig(stages=2, micro_batches=4, balance="params"),
        checkpoint_uri=str(tmp_path / "charlm"),
        in_process=True,
    )
    val = [h.metrics["val_loss"] for h in result.history]
    assert val[-1] < val[0] < math.log(128)  # below a uniform guess, and still improving
    whole = evaluate(result.checkpoint, charlm_data, model=CharLM, split="validation")
    assert whole["val_loss"] == pytest.approx(val[-1], rel=1e-4)


def _tensors(x, y):
    import torch

    return torch.from_numpy(x), torch.from_numpy(y)
