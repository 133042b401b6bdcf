"""The TorchPass dev cluster: a real multi-node Slurm cluster (munge, MariaDB + slurmdbd,
slurmctld, one slurmd per network namespace) plus a private mosquitto, on one machine.
Python 3 standard library only, so it runs before the project's venv exists; the command
line is contrib/devcluster/devcluster, the pytest side is tests/support/devcluster.py."""
