"""Code shared by torchpassd, launchpad and the worker library: errors, logging, config,
timeouts and (in protocol.py) the control-plane message schemas. Nothing here imports torch."""
