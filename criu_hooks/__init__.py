"""criu_hooks: model-transparent capture and restore of worker processes with CRIU (and the
CUDA checkpoint driver API on GPUs)."""
