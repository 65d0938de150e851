"""trainfast: native drop-in replacements for the planning code of large-model training stacks.

Each domain lives in its own module (``trainfast.checkpoint``, ...); they are imported lazily so that
``import trainfast`` stays cheap and does not import torch.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__"]

logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name == f"{__name__}.{name}":
            raise AttributeError(f"module 'trainfast' has no attribute {name!r}") from None
        raise
