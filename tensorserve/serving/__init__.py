"""Serving: a model behind its batcher (``model.py``), and the registry of
every model the server serves, with its state (``registry.py``); the rules
of looking a model up in it (``entries.py``), which a front-end process
shares.

This is where the batcher, the runtime and the repository meet; the HTTP
layer is one of its callers, in-process Python code another. ``ServedModel``
(which needs torch) is imported when first asked for: a front-end process
(``--frontends N``) imports this package and runs no model.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorserve.serving.model import ServedModel

__all__ = ["ServedModel"]


def __getattr__(name: str) -> Any:
    if name == "ServedModel":
        from tensorserve.serving.model import ServedModel

        return ServedModel
    raise AttributeError(f"module 'tensorserve.serving' has no attribute {name!r}")
