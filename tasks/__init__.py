"""Prefect tasks: thin wrappers that call into ``engine`` and ``storage``."""

from ringflow.tasks.preprocess import demo_data, preprocess
from ringflow.tasks.registry import promote, register, warm_start_checkpoint
from ringflow.tasks.resume import report_resume
from ringflow.tasks.serve import serve, serve_production
from ringflow.tasks.train import evaluate, train
from ringflow.tasks.tune import tune

__all__ = [
    "demo_data",
    "evaluate",
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
