"""Swap trainfast's EPLB into any module with DeepSeek's API (a copied ``eplb.py``, SGLang's
``deepseek`` algorithm module, ...).

>>> import my_copy_of_eplb  # doctest: +SKIP
>>> from trainfast.integrations import eplb
>>> eplb.patch(my_copy_of_eplb)  # doctest: +SKIP
['my_copy_of_eplb.balanced_packing', ...]

Outputs are unchanged (bit-identical on the same torch); SGLang's extra ``enable_hierarchical``
argument is accepted, and a copy that sizes ``log2phy`` to num_replicas - num_logical + 1 instead
of the largest replica count (DeepSeek's) gets that width. ``patch`` first asks each of the
module's functions probe questions (the README example and tied loads) and leaves the whole module
alone, with a warning, unless every answer equals trainfast's (up to that width): vLLM's copy, for
one, orders tied loads another way. Where upstream computes in the weight's own dtype and trainfast
does not reproduce it (float16/bfloat16/bool helper weights, a non-float32 weight given to
``rebalance_experts_hierarchical`` directly, narrow integer pack sums that would wrap around), the
module's own function runs (upstream's speed).
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from trainfast.integrations._patching import _reloaded

__all__ = ["patch", "unpatch", "is_patched", "FUNCTIONS", "KNOWN_MODULES"]

logger = logging.getLogger(__name__)

FUNCTIONS = ("balanced_packing", "replicate_experts", "rebalance_experts_hierarchical", "rebalance_experts")
# Tried in order when patch() is called without a module.
KNOWN_MODULES = (
    "sglang.srt.eplb.eplb_algorithms.deepseek",
    "sglang.srt.managers.eplb_algorithms.deepseek",
    "eplb",
)

# module -> {function name: (the original, our replacement)}; keyed by the module object, as two
# modules can share a name. A function counts as patched while the module still holds ours.
_patched: dict[ModuleType, dict[str, tuple[Any, Any]]] = {}
_lock = threading.Lock()


def _resolve(module: ModuleType | str | None) -> ModuleType:
    if isinstance(module, ModuleType):
        return module
    if isinstance(module, str):
        return importlib.import_module(module)
    if module is not None:
        raise TypeError(f"module must be a module, a module name or None (got {type(module).__name__})")
    errors = []
    for name in KNOWN_MODULES:
        try:
            candidate = importlib.import_module(name)
        except ImportError as error:
            errors.append(f"{name}: {error}")
            continue
        if hasattr(candidate, "rebalance_experts"):
            return candidate
    raise ImportError("no module with DeepSeek's EPLB API found; pass one to patch() (" + "; ".join(errors) + ")")


def _computes_in_own_dtype(name: str, weight: Any) -> bool:
    """Whether upstream's ``name`` computes in ``weight``'s dtype in a way trainfast's does not
    reproduce (trainfast's refuses such weights): then the module's own function answers.

    The hierarchical policy computes in any dtype but float32 (what ``rebalance_experts`` passes);
    the helpers in float16, bfloat16 and bool, and ``balanced_packing`` sums a narrow integer dtype
    in that dtype, wrapping around where trainfast's int64 sums would not.
    """
    import torch

    from trainfast import eplb

    dtype = weight.dtype
    if dtype.is_complex or weight.device.type == "meta":
        return False  # no meaningful loads: trainfast's names the problem
    if name == "rebalance_experts_hierarchical":
        return dtype != torch.float32
    if name not in ("balanced_packing", "replicate_experts"):
        return False
    if dtype not in eplb.HELPER_DTYPES:
        return True
    if name == "balanced_packing" and dtype in eplb.NARROW_INT_DTYPES and weight.numel():
        return int(weight.detach().to(torch.int64).abs().sum(-1).max()) > torch.iinfo(dtype).max
    return False


# Probe inputs: the README example and small tied integer loads, on which a copy that orders ties
# another way (vLLM's sorts with NumPy) answers differently.
_README_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                  [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
_TIED_WEIGHT = [[0, 3, 1, 1, 2, 0, 3, 3, 1, 2, 2, 0, 1, 3, 0, 2],
                [1, 1, 0, 2, 3, 3, 0, 1, 2, 2, 1, 0, 3, 0, 2, 1]]
# name -> [(weight, other positional arguments, enable_hierarchical or None)]
_PROBES: dict[str, list[tuple[list[list[int]], tuple[int, ...], bool | None]]] = {
    "balanced_packing": [(_README_WEIGHT, (4,), None), (_TIED_WEIGHT, (4,), None)],
    "replicate_experts": [(_README_WEIGHT, (16,), None), (_TIED_WEIGHT, (24,), None)],
    "rebalance_experts_hierarchical": [(_README_WEIGHT, (16, 4, 2, 8), None), (_TIED_WEIGHT, (24, 4, 2, 8), None)],
    "rebalance_experts": [(_README_WEIGHT, (16, 4, 2, 8), True), (_README_WEIGHT, (16, 5, 2, 8), False),
                          (_TIED_WEIGHT, (24, 4, 2, 8), True), (_TIED_WEIGHT, (24, 3, 2, 4), False)],
}


def _padded_to_num_redundant(log2phy: Any, ours: Any, num_replicas: int) -> bool:
    """Whether ``log2phy`` is ``ours`` widened with -1 to num_replicas - num_logical + 1 columns."""
    import torch

    width = num_replicas - ours.shape[1] + 1
    return (isinstance(log2phy, torch.Tensor) and log2phy.dim() == 3 and log2phy.shape[2] == width > ours.shape[2]
            and bool((log2phy[..., ours.shape[2]:] == -1).all()))


def _probe(name: str, original: Any) -> tuple[str | None, str]:
    """Asks the module's own ``name`` the probe questions and compares with trainfast's answers:
    ``(how, "")`` where they agree, ``how`` being ``"max_count"`` for all but a ``rebalance_experts``
    that sizes ``log2phy`` as vLLM's copy does, num_replicas - num_logical + 1 instead of the
    largest replica count (``"num_redundant"``); ``(None, why)`` where they differ."""
    import inspect

    import torch

    from trainfast import eplb

    parameters: Mapping[str, inspect.Parameter]
    try:
        parameters = inspect.signature(original).parameters
    except (TypeError, ValueError):
        parameters = {}
    how = "max_count"
    for weight, rest, hierarchical in _PROBES[name]:
        args = (torch.tensor(weight, dtype=torch.float32), *rest)
        kwargs = {"enable_hierarchical": hierarchical} if hierarchical is not None and "enable_hierarchical" in \
            parameters else {}
        try:
            answer = tuple(original(*args, **kwargs))
        except Exception as error:  # not callable as DeepSeek's: leave it alone
            return None, f"{name} cannot be called as DeepSeek's ({type(error).__name__}: {error})"
        expected = getattr(eplb, name)(*args, **kwargs)
        if name == "rebalance_experts" and len(answer) == 3 and _padded_to_num_redundant(answer[1], expected[1], rest[0]):
            how = "num_redundant"
            answer = (answer[0], answer[1][..., :expected[1].shape[2]], answer[2])
        same = len(answer) == len(expected) and all(
            isinstance(a, torch.Tensor) and a.shape == e.shape and torch.equal(a, e) for a, e in zip(answer, expected))
        if not same:
            return None, f"{name}'s answer to a probe differs from DeepSeek's"
    return how, ""


def _replacement(name: str, original: Any, log2phy_width: str = "max_count") -> Any:
    import torch

    from trainfast import eplb

    ours = getattr(eplb, name)

    @functools.wraps(original)
    def replacement(*args: Any, **kwargs: Any) -> Any:
        weight = args[0] if args else kwargs.get("weight")
        if isinstance(weight, torch.Tensor) and _computes_in_own_dtype(name, weight):
            return original(*args, **kwargs)
        result = ours(*args, **kwargs)
        if log2phy_width == "num_redundant":  # padded to the module's fixed width
            phy2log, log2phy, logcnt = result
            width = phy2log.shape[1] - logcnt.shape[1] + 1
            result = (phy2log, torch.nn.functional.pad(log2phy, (0, width - log2phy.shape[2]), value=-1), logcnt)
        return result

    replacement.__trainfast_original__ = original  # type: ignore[attr-defined]
    return replacement


def patch(module: ModuleType | str | None = None) -> list[str]:
    """Replaces DeepSeek's EPLB functions found in ``module``; returns the ``module.name`` replaced,
    ``[]`` (with a warning logged) when a function's answer to a probe differs from trainfast's.

    Raises ValueError when ``module`` has no ``rebalance_experts``, ImportError when ``module`` is
    None and no known module with it imports. Idempotent; after
    ``importlib.reload(module)`` it patches the reloaded functions.
    """
    target = _resolve(module)
    if not hasattr(target, "rebalance_experts"):
        raise ValueError(f"module {target.__name__!r} has no rebalance_experts (not DeepSeek's EPLB API)")
    with _lock:
        saved = _patched.setdefault(target, {})
        present = [name for name in FUNCTIONS if hasattr(target, name)]
        fresh = [name for name in present if name not in saved or _reloaded(getattr(target, name), *saved[name])]
        # Every function asked on the untouched module first (rebalance_experts calls the helpers);
        # one that answers otherwise leaves the whole module as it is.
        verdicts = {name: _probe(name, getattr(target, name)) for name in fresh}
        refused = [why for how, why in verdicts.values() if how is None]
        widths = {name: how for name, (how, _) in verdicts.items() if how is not None}
        if refused:
            logger.warning("%s left as it is: %s", target.__name__, "; ".join(refused))
            if not saved:
                del _patched[target]
            return []
        for name in fresh:
            original = getattr(target, name)
            saved[name] = (original, _replacement(name, original, log2phy_width=widths[name]))
            setattr(target, name, saved[name][1])
        patched = [f"{target.__name__}.{name}" for name in present]
    logger.info("patched %s", ", ".join(patched))
    return patched


def unpatch(module: ModuleType | str | None = None) -> None:
    """Restores the functions ``patch`` replaced (all patched modules when ``module`` is None)."""
    with _lock:
        targets = [_resolve(module)] if module is not None else list(_patched)
        for target in targets:
            for name, (original, ours) in _patched.pop(target, {}).items():
                if not _reloaded(getattr(target, name, None), original, ours):
                    setattr(target, name, original)


def is_patched(module: ModuleType | str | None = None) -> bool:
    with _lock:
        targets = list(_patched) if module is None else [_resolve(module)]
        return any(not _reloaded(getattr(target, name, None), *recorded)
                   for target in targets for name, recorded in _patched.get(target, {}).items())
