"""One mechanism for every integration: a list of (module, attribute, replacement) targets."""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


def _resolve_owner(module: Any, attribute: str) -> tuple[Any, str]:
    """The object holding ``attribute`` ("Class.method" reaches into a class) and the final name."""
    *path, name = attribute.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _raw_attribute(owner: Any, name: str) -> Any:
    # Classes keep classmethod/staticmethod descriptors in __dict__; getattr would bind them.
    if isinstance(owner, type) and name in owner.__dict__:
        return owner.__dict__[name]
    return getattr(owner, name)


@dataclass
class Target:
    module: str
    attribute: str  # a module attribute, or "Class.attribute" for a class member
    # Called with the upstream function; returns the drop-in that replaces it.
    make_replacement: Callable[[Callable[..., Any]], Callable[..., Any]]
    required: bool = True


_MISSING = object()


@dataclass
class Patcher:
    """Replaces module attributes and restores them; idempotent in both directions, thread-safe.

    A target counts as patched only while our replacement is what the module holds: after
    ``importlib.reload`` (or another library's reassignment) ``patch()`` patches it again.
    ``unpatch()`` puts back the last original recorded, whatever wraps ours by then.
    """

    package: str
    targets: list[Target] = field(default_factory=list)
    # (module, attribute) -> (the original, the object we installed in its place)
    _patched: dict[tuple[str, str], tuple[Any, Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, module: str, attribute: str, make_replacement: Callable, *, required: bool = True) -> None:
        self.targets.append(Target(module, attribute, make_replacement, required))

    def patch(self) -> list[str]:
        """Patches every importable target; returns the ``module.attribute`` names replaced.

        Raises ImportError when a required module cannot be imported (nothing is patched then).
        """
        with self._lock:
            return self._patch_locked()

    def _patch_locked(self) -> list[str]:
        resolved = []
        for target in self.targets:
            try:
                module = importlib.import_module(target.module)
            except Exception as error:  # optional modules can fail in other ways too (warnings as errors)
                if target.required:
                    raise ImportError(
                        f"trainfast cannot patch {self.package}: {target.module} is not importable ({error})"
                    ) from error
                logger.info("skipping %s.%s: %s", target.module, target.attribute, error)
                continue
            try:
                owner, name = _resolve_owner(module, target.attribute)
                present = hasattr(owner, name)
            except AttributeError:
                present = False
            if not present:
                if target.required:
                    raise ImportError(f"{target.module} has no {target.attribute}; unsupported {self.package} version")
                continue
            resolved.append((target, module))
        patched = []
        for target, module in resolved:
            key = (target.module, target.attribute)
            if not self._is_ours(key):
                owner, name = _resolve_owner(module, target.attribute)
                original = _raw_attribute(owner, name)
                wrapper = type(original) if isinstance(original, (classmethod, staticmethod)) else None
                function = original.__func__ if wrapper is not None else original
                replacement = target.make_replacement(function)
                functools.update_wrapper(replacement, function)
                replacement.__trainfast_original__ = function
                installed = wrapper(replacement) if wrapper is not None else replacement
                self._patched[key] = (original, installed)
                setattr(owner, name, installed)
            patched.append(f"{target.module}.{target.attribute}")
        logger.info("patched %s", ", ".join(patched))
        return patched

    def unpatch(self) -> None:
        with self._lock:
            for (module_name, attribute), (original, _) in self._patched.items():
                owner, name = _resolve_owner(importlib.import_module(module_name), attribute)
                setattr(owner, name, original)
            self._patched.clear()

    def is_patched(self) -> bool:
        with self._lock:
            return any(self._is_ours(key) for key in self._patched)

    def _current(self, key: tuple[str, str]) -> Any:
        module = sys.modules.get(key[0])
        if module is None:
            return _MISSING
        try:
            owner, name = _resolve_owner(module, key[1])
            return _raw_attribute(owner, name)
        except AttributeError:
            return _MISSING

    def _is_ours(self, key: tuple[str, str]) -> bool:
        return key in self._patched and self._current(key) is self._patched[key][1]
