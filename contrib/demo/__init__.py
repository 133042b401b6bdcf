"""The `make demo` demonstration (run as `python -m contrib.demo`). At this stage it brings the
dev cluster up and runs a 3-node job that prints each node's hostname; later it becomes a live
migration of a training job off a drained node."""
