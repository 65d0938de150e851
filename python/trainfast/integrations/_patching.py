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


def _reloaded(current: Any, original: Any, ours: Any) -> bool:
    """Whether ``current`` is a new copy of ``original`` (``importlib.reload`` ran the module again):
    a different function with the same module and qualified name that is not ours and does not wrap
    ours (ours, and ``functools.wraps`` wrappers of it, carry upstream's names too)."""
    seen, unwrapped = 0, current
    while unwrapped is not None and seen < 100:
        if unwrapped is ours:
            return False
        unwrapped = getattr(unwrapped, "__func__", None) or getattr(unwrapped, "__wrapped__", None)
        seen += 1
    current, original = getattr(current, "__func__", current), getattr(original, "__func__", original)
    return current is not original and callable(current) and \
        (getattr(current, "__module__", None), getattr(current, "__qualname__", None)) == \
        (getattr(original, "__module__", 0), getattr(original, "__qualname__", 0))


@dataclass
class Patcher:
    """Replaces module attributes and restores them; idempotent in both directions, thread-safe.

    After ``importlib.reload`` put a new copy of upstream's function in the module, ``patch()``
    patches that copy and ``unpatch()`` leaves it in place; otherwise ``unpatch()`` puts back the
    original recorded, whatever wraps ours by then.
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
            if key not in self._patched or _reloaded(self._current(key), *self._patched[key]):
                owner, name = _resolve_owner(module, target.attribute)
                original = _raw_attribute(owner, name)
                wrapper = type(original) if isinstance(original, (classmethod, staticmethod)) else None
                function = original.__func__ if wrapper is not None else original
                replacement = target.make_replacement(function)
                if replacement is None:
                    # a form of upstream's function (another release) whose semantics trainfast does not reproduce
                    logger.info("keeping upstream's %s.%s: trainfast has no drop-in for this form of it",
                                target.module, target.attribute)
                    continue
                functools.update_wrapper(replacement, function)
                replacement.__trainfast_original__ = function  # type: ignore[attr-defined]
                installed = wrapper(replacement) if wrapper is not None else replacement
                self._patched[key] = (original, installed)
                setattr(owner, name, installed)
            patched.append(f"{target.module}.{target.attribute}")
        logger.info("patched %s", ", ".join(patched))
        return patched

    def unpatch(self) -> None:
        with self._lock:
            for key, (original, ours) in self._patched.items():
                if not _reloaded(self._current(key), original, ours):
                    owner, name = _resolve_owner(importlib.import_module(key[0]), key[1])
                    setattr(owner, name, original)
            self._patched.clear()

    def is_patched(self) -> bool:
        with self._lock:
            return any(not _reloaded(self._current(key), *recorded) for key, recorded in self._patched.items())

    def _current(self, key: tuple[str, str]) -> Any:
        module = sys.modules.get(key[0])
        if module is None:
            return _MISSING
        try:
            owner, name = _resolve_owner(module, key[1])
            return _raw_attribute(owner, name)
        except AttributeError:
            return _MISSING


def split_by_size_and_type_with(sizing: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The replacement factory for an upstream ``_split_by_size_and_type(bins, items)``: trainfast's
    binning with ``sizing`` ("chunk" for Megatron, "global" for torch DCP)."""

    def make_replacement(original: Callable[..., Any]) -> Callable[..., Any]:
        from trainfast.checkpoint import split_by_size_and_type

        def replacement(bins, items):
            return split_by_size_and_type(bins, items, sizing=sizing)

        return replacement

    return make_replacement
