"""Swap trainfast's EPLB into any module with DeepSeek's API (a copied ``eplb.py``, SGLang's
``deepseek`` algorithm module, ...).

>>> import my_copy_of_eplb  # doctest: +SKIP
>>> from trainfast.integrations import eplb
>>> eplb.patch(my_copy_of_eplb)  # doctest: +SKIP
['my_copy_of_eplb.balanced_packing', ...]

Outputs are unchanged (bit-identical on the same torch); SGLang's extra ``enable_hierarchical``
argument is accepted, and copies that size ``log2phy`` to num_replicas - num_logical + 1 (vLLM's)
instead of the largest replica count (DeepSeek's) get that width. ``patch`` first asks the module's
``rebalance_experts`` two probe questions and leaves it alone (with a warning) unless the answers
equal trainfast's up to that width. Where upstream computes in the weight's own dtype and trainfast does not
reproduce it (float16/bfloat16/bool helper weights, a non-float32 weight given to
``rebalance_experts_hierarchical`` directly, narrow integer pack sums that would wrap around), the
module's own function runs (upstream's speed).
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
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


# The README example: (num_replicas, num_groups, num_nodes, num_gpus) once with the hierarchical
# policy and once with the global one (5 groups on 2 nodes).
_PROBE_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                 [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
_PROBES = (((16, 4, 2, 8), True), ((16, 5, 2, 8), False))


def _log2phy_width(original: Any) -> tuple[str | None, str]:
    """How the module's ``rebalance_experts`` sizes ``log2phy``: ``"max_count"`` (DeepSeek: the
    largest replica count) or ``"num_redundant"`` (vLLM's copy: num_replicas - num_logical + 1),
    read off its answers to two probes, which must otherwise equal trainfast's. ``(None, why)`` for
    a module that answers differently or cannot be called like DeepSeek's."""
    import inspect

    import torch

    from trainfast import eplb

    try:
        parameters = inspect.signature(original).parameters
    except (TypeError, ValueError):
        parameters = {}
    width = None
    for (num_replicas, num_groups, num_nodes, num_gpus), hierarchical in _PROBES:
        args = (torch.tensor(_PROBE_WEIGHT, dtype=torch.float32), num_replicas, num_groups, num_nodes, num_gpus)
        kwargs = {"enable_hierarchical": hierarchical} if "enable_hierarchical" in parameters else {}
        try:
            phy2log, log2phy, logcnt = original(*args, **kwargs)
        except Exception as error:  # not callable as DeepSeek's: leave it alone
            return None, f"it cannot be called as DeepSeek's ({type(error).__name__}: {error})"
        expected = eplb.rebalance_experts(*args, **kwargs)
        max_count = int(expected[2].max())
        widths = {max_count: "max_count", num_replicas - len(_PROBE_WEIGHT[0]) + 1: "num_redundant"}
        found = widths.get(log2phy.shape[-1]) if isinstance(log2phy, torch.Tensor) and log2phy.dim() == 3 else None
        if found is None or not (torch.equal(phy2log, expected[0]) and torch.equal(logcnt, expected[2])
                                 and torch.equal(log2phy[..., :max_count], expected[1])
                                 and bool((log2phy[..., max_count:] == -1).all())):
            return None, "its answer to a probe differs from DeepSeek's"
        width = found
    return width, ""


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

    replacement.__trainfast_original__ = original
    return replacement


def patch(module: ModuleType | str | None = None) -> list[str]:
    """Replaces DeepSeek's EPLB functions found in ``module``; returns the ``module.name`` replaced.

    Raises ValueError when ``module`` has no ``rebalance_experts``, ImportError when ``module`` is
    None and no known module with it imports. Idempotent; after
    ``importlib.reload(module)`` it patches the reloaded functions.
    """
    target = _resolve(module)
    if not hasattr(target, "rebalance_experts"):
        raise ValueError(f"module {target.__name__!r} has no rebalance_experts (not DeepSeek's EPLB API)")
    with _lock:
        saved = _patched.setdefault(target, {})
        patched = []
        for name in FUNCTIONS:
            if not hasattr(target, name):
                continue
            if name not in saved or _reloaded(getattr(target, name), *saved[name]):
                original = getattr(target, name)
                options = {}
                if name == "rebalance_experts":
                    width, why = _log2phy_width(original)
                    if width is None:
                        logger.warning("%s.rebalance_experts left as it is: %s", target.__name__, why)
                        continue
                    options["log2phy_width"] = width
                saved[name] = (original, _replacement(name, original, **options))
                setattr(target, name, saved[name][1])
            patched.append(f"{target.__name__}.{name}")
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
