"""Serving: a model behind its batcher (``model.py``), and the registry of
every model the server serves, with its state (``registry.py``).

This is where the batcher, the runtime and the repository meet; the HTTP
layer is one of its callers, in-process Python code another.
"""

from tensorserve.serving.model import ServedModel

__all__ = ["ServedModel"]
