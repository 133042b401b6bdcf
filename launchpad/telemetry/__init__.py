"""GPU health telemetry on a node: a narrow NVML interface (backend.py) with the real pynvml
implementation and a replay fake for tests and drills, the guarded collector, the sampling loop
and the compact "only changes" encoding carried in launchpad heartbeats. It decides nothing:
torchpassd/health_policy.py does."""
