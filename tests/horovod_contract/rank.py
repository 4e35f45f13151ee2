"""One rank of Horovod's own tests (``parallel/test_torch.py``): ``ringflow-run -np 2 python
tests/horovod_contract/rank.py OUT [PYTEST ARGS]`` runs them on each rank, with
``horovod.torch`` resolving to ``ringflow.horovod`` (``shim/``), and writes the rank's
outcomes to ``OUT/rank<R>.xml`` (JUnit XML). The exit status is pytest's."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "shim"))  # before any folder holding another horovod

import pytest  # noqa: E402 - after the shim's folder is first on the path

if __name__ == "__main__":
    out, *more = sys.argv[1:]
    rank = os.environ["HOROVOD_RANK"]
    sys.exit(
        pytest.main(
            [
                "-c",
                os.path.join(HERE, "pytest.ini"),
                "--rootdir",
                HERE,
                "--noconftest",
                "-q",
                f"--junitxml={os.path.join(out, f'rank{rank}.xml')}",
                os.path.join(HERE, "parallel", "test_torch.py"),
                *more,
            ]
        )
    )
