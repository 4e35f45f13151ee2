"""``ray start`` for one more Ray node on this machine, kept on loopback.

``env.sh`` keeps Ray on 127.0.0.1 with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, under which
``ray start --address`` refuses to add a node; with ``=1`` it would rewrite ``127.0.0.1`` in
``--address`` and ``--node-ip-address`` to the machine's outside address. This runs ``ray start``
allowing the join while leaving loopback addresses as given. The node's processes keep the
environment, so they resolve their own addresses to loopback too. Used by ``ray-cluster.sh``.
"""

import sys

from ray._private import ray_constants, services
from ray.scripts.scripts import main

ray_constants.ENABLE_RAY_CLUSTER = True
services.resolve_ip_for_localhost = lambda host: host

if __name__ == "__main__":
    sys.exit(main())
