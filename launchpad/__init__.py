"""launchpad: the per-node agent, a drop-in for torchrun that supervises the training workers,
heartbeats to torchpassd and carries out its commands (pause, hand over, re-form, resume)."""
