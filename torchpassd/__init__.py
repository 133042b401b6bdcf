"""torchpassd: the TorchPass orchestrator (one per cluster). It owns the job registry, the
spare pool, the migration state machines and their journal; torchpassctl is its operator CLI."""
