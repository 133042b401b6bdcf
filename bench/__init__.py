"""TorchPass benchmarks. Each benchmark is a module ``bench/<name>.py`` with a
``main(argv: list[str]) -> dict`` that measures a baseline and TorchPass in the same run and
returns ratios; run as ``python -m bench NAME [--json]``."""
