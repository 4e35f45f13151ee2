"""Storage that names code: a checkpoint whose manifest names another class, and the marks
that importing that class leaves (``tests.support.planted``)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

PLANTED = "tests.support.planted:Planted"
"""The class a tampered manifest names."""
MARKS = os.path.join(tempfile.gettempdir(), f"ringflow-planted-imports-{os.getuid()}")
"""One file per process that imported ``tests.support.planted``."""


def clear_marks() -> None:
    shutil.rmtree(MARKS, ignore_errors=True)


def marks() -> list[str]:
    """The ids of the processes that imported the planted module since :func:`clear_marks`."""
    return sorted(os.listdir(MARKS)) if os.path.isdir(MARKS) else []


def name_planted_class(checkpoint_dir: str) -> None:
    """Edit the checkpoint's manifest, as a writer of the bucket could, to name
    :data:`PLANTED`; the tensors and their checksums stay valid."""
    path = os.path.join(checkpoint_dir, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["module"] = PLANTED
    with open(path, "w") as f:
        json.dump(manifest, f)
