"""Prefect tasks: thin wrappers that call into ``engine`` and ``storage``.

Each takes typed specs (``ModelRef``, ``TrainConfig``, ``PipelineConfig``) and URLs, so a
flow of one's own can compose them in another order or add tasks between them.
"""

from ringflow.tasks.preprocess import example_data, preprocess
from ringflow.tasks.registry import promote, register, warm_start_checkpoint
from ringflow.tasks.resume import report_resume
from ringflow.tasks.serve import serve, serve_production
from ringflow.tasks.train import evaluate, train
from ringflow.tasks.tune import tune

__all__ = [
    "evaluate",
    "example_data",
    "preprocess",
    "promote",
    "register",
    "report_resume",
    "serve",
    "serve_production",
    "train",
    "tune",
    "warm_start_checkpoint",
]
