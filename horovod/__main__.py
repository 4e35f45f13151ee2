"""``python -m ringflow.horovod -np N COMMAND``: ``ringflow-run``."""

import sys

from ringflow.horovod.runner import main

sys.exit(main())
