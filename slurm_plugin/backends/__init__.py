"""The SlurmClient backends: ``commands`` (Slurm's CLI tools, works on every release),
``rest`` (slurmrestd with JWT or a local socket) and ``pyslurm`` (when it matches the release)."""
