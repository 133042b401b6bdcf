"""criu_hooks: model-transparent capture and restore of worker processes with CRIU (and the CUDA
checkpoint driver API on GPUs). One move, in order: cuda.check (refuse early) -> workers park and drop
their communicator -> [cuda lock+checkpoint] -> runner.dump (left stopped; pages to a PageServer on
the target) -> ship the rest -> runner.restore there -> [cuda restore+unlock] -> discard_original, or
resume_original on any failure -> re-form. locate picks the criu; spawn starts movable workers."""
