"""The TorchPass dev cluster: a real multi-node Slurm cluster (munge, MariaDB + slurmdbd,
slurmctld, one slurmd per network namespace) plus a private mosquitto, on one machine.
Python 3 standard library only, so it runs before the project's venv exists; the command
line is contrib/devcluster/devcluster, the pytest side is tests/support/devcluster.py."""

import sys
from pathlib import Path

# The repository's standard-library-only modules (torchpassd.broker_files, broker_tls,
# torchpass_common.config) write the broker's files and the site config as an install would.
_REPO = str(Path(__file__).resolve().parents[3])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
