"""slurm_plugin: the only code that knows Slurm. Turns slurmctld state into typed events and
carries out the orchestrator's decisions (take a spare, grow or shrink a job, start a step)."""
