"""torchpass: the worker-side library, the only TorchPass code imported into training scripts.
``torchpass.register(save=..., load=...)`` is the model-aware hook."""
