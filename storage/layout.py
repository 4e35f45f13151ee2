"""Where everything a pipeline keeps lives under its ``storage_url``, decided in this one place.

::

    {storage_url}/raw/                      example data dropped for a model without data_url
    {storage_url}/datasets/{fingerprint}/   validated, split Parquet shards (storage.dataset)
    {storage_url}/checkpoints/{run key}/    training state, resumable (storage.store)
    {storage_url}/checkpoints/{run key}-trial-{trial}/   a search trial's (trial_run_key)
    {storage_url}/runs/{run key}/model      the model a run trained
    {storage_url}/runs/{run key}/logs/      what its loggers wrote (csv/, tensorboard/)
    {storage_url}/runs/{run key}/timeline/  its Chrome trace, with TrainConfig.timeline
    {storage_url}/tune/{run key}/           a search's records (ringflow.tuning)
    {storage_url}/registry/{model name}/    versions and the production pointer (storage.registry)
    {storage_url}/scores/{run key}/         a scoring run's predictions (serving.score)
"""

from __future__ import annotations

from dataclasses import dataclass

from ringflow.storage.fs import absolute, join

__all__ = ["TRIAL_MARK", "Workspace", "trial_run_key"]

TRIAL_MARK = "-trial-"
"""What a search trial's run key holds between the search's run key and the trial's number;
a run key of one's own may not hold it."""


def trial_run_key(run_key: str, trial_id: str) -> str:
    """The run key a search's trial keeps its checkpoints under: ``nightly-trial-00003``."""
    return f"{run_key}{TRIAL_MARK}{trial_id}"


@dataclass(frozen=True)
class Workspace:
    """The folders of one ``storage_url`` (any fsspec URL; a local path is made absolute)."""

    url: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", absolute(self.url))

    @property
    def raw(self) -> str:
        return join(self.url, "raw")

    @property
    def datasets(self) -> str:
        """What ``storage.dataset.preprocess`` takes as its ``output_url``."""
        return self.url

    @property
    def checkpoints(self) -> str:
        return join(self.url, "checkpoints")

    def run_model(self, run_key: str) -> str:
        return join(self.url, "runs", run_key, "model")

    def logs(self, run_key: str) -> str:
        """Where a run's Lightning loggers write (one folder each)."""
        return join(self.url, "runs", run_key, "logs")

    def timeline(self, run_key: str) -> str:
        """Where a run's timeline is written (``engine.timeline``): a Chrome trace."""
        return join(self.url, "runs", run_key, "timeline", "trace.json")

    def trial_model(self, run_key: str, trial_id: str) -> str:
        return join(self.url, "runs", run_key, "trials", trial_id, "model")

    def tune(self, run_key: str) -> str:
        return join(self.url, "tune", run_key)

    def scores(self, run_key: str) -> str:
        """Where a scoring run writes its predictions, block by block (``serving.score``)."""
        return join(self.url, "scores", run_key)

    @property
    def registry(self) -> str:
        return join(self.url, "registry")
