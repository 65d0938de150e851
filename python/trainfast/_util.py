"""Boundary helpers every domain uses: argument checks, array conversion, thread counts."""

from __future__ import annotations

import errno
import functools
import logging
import operator
import os
import stat
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "UpstreamAssertionError",
    "write_atomic",
    "write_atomic_files",
    "as_array",
    "check_choice",
    "check_int",
    "resolve_num_threads",
    "to_tensor",
]

NUM_THREADS_ENV = "TRAINFAST_NUM_THREADS"

_KINDS = {
    "int": ("i", "u"),
    "bool": ("b", "i", "u"),
    "float": ("f", "i", "u"),
}
_ARTICLE = {"int": "an", "bool": "a", "float": "a"}


class UpstreamAssertionError(ValueError, AssertionError):
    """Bad argument where upstream ``assert``s: catchable as either ValueError or AssertionError."""


class UpstreamAttributeError(TypeError, AttributeError):
    """An argument lacks an attribute upstream reads from it: catchable as either TypeError or
    AttributeError (what upstream raises there)."""


class UpstreamIndexError(ValueError, IndexError):
    """An index out of the range upstream indexes with it: catchable as ValueError or IndexError."""


def check_attrs(value: Any, name: str, attrs: Sequence[str], what: str) -> None:
    """UpstreamAttributeError naming ``name`` unless ``value`` has every attribute in ``attrs``."""
    for attr in attrs:
        if not hasattr(value, attr):
            raise UpstreamAttributeError(f"{name} must be {what} with .{attr} (got {type(value).__name__} {value!r:.80})")


# Counts and sizes cross into native code as int64.
INT64_MAX = 2**63 - 1


def check_int(value: Any, name: str, *, min_value: int | None = None, max_value: int | None = None) -> int:
    """Returns ``value`` as an int; TypeError unless it is an integer (bools excluded)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int (got {type(value).__name__} {value!r})")
    try:
        value = operator.index(value)
    except TypeError:  # e.g. a float tensor: every tensor has __index__, only integer ones take it
        raise TypeError(f"{name} must be an int (got {type(value).__name__} {value!r})") from None
    if min_value is not None and value < min_value:
        raise ValueError(f"{name} must be >= {min_value} (got {value})")
    if max_value is not None and value > max_value:
        raise ValueError(f"{name} must be <= {max_value} (got {value})")
    return value


def check_bool(value: Any, name: str) -> bool:
    """Returns ``value`` as a bool; TypeError unless it is one (NumPy's bool too): a flag given "no"
    or 0 would otherwise be read as its truth value."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise TypeError(f"{name} must be a bool (got {type(value).__name__} {value!r})")


def check_choice(value: Any, name: str, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))} (got {value!r})")
    return value


# Native code takes a C int and may start one thread (and a count table) per unit.
MAX_NUM_THREADS = 4096


def resolve_num_threads(num_threads: int | None) -> int:
    """``num_threads``, else $TRAINFAST_NUM_THREADS, else the cores this process may run on."""
    if num_threads is None:
        env = os.environ.get(NUM_THREADS_ENV)
        if env is not None:
            try:
                return check_int(int(env), NUM_THREADS_ENV, min_value=1, max_value=MAX_NUM_THREADS)
            except ValueError as error:
                raise ValueError(
                    f"${NUM_THREADS_ENV} must be an int in [1, {MAX_NUM_THREADS}] (got {env!r})"
                ) from error
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not on Linux
            return max(1, os.cpu_count() or 1)
    return check_int(num_threads, "num_threads", min_value=1, max_value=MAX_NUM_THREADS)


@functools.lru_cache(maxsize=None)
def _bar_type() -> Any:
    from tqdm import tqdm

    return type("_TrainfastBar", (tqdm,), {"monitor_interval": 0})


def progress_bar(**kwargs: Any) -> Any:
    """A tqdm bar that starts no monitor thread: tqdm's monitor outlives the bar, and the call that
    showed it would leave a thread running."""
    return _bar_type()(**kwargs)


def _terminal_gone(error: BaseException) -> bool:
    """Whether ``error`` is what writing to a gone terminal raises: ValueError on a closed file,
    EPIPE / EIO / EBADF on a hung-up or closed one. A signal handler's TimeoutError (an OSError too)
    is not: it must reach the caller."""
    if isinstance(error, ValueError):
        return True
    return (isinstance(error, OSError) and not isinstance(error, (TimeoutError, InterruptedError))
            and error.errno in (errno.EPIPE, errno.EIO, errno.EBADF))


class Progress:
    """Work done so far, for calls that run long: a tqdm bar when stderr is a terminal, an INFO line on
    ``logger`` at most every 5 s otherwise, nothing when ``enabled`` is False. The display is best
    effort: a closed stderr drops the bar, never the work it reports on.

    ``describe(done)`` words a log line (default ``"done/total unit"``); the bar's keyword arguments
    (``unit_scale``, ``leave``) go to tqdm.
    """

    LOG_INTERVAL_S = 5.0

    def __init__(self, *, enabled: bool, total: int | None, desc: str, unit: str, logger: logging.Logger,
                 describe: Callable[[int], str] | None = None, **bar_kwargs: Any) -> None:
        self.enabled, self.total, self.desc, self.done = enabled, total, desc, 0
        self._logger = logger
        self._describe = describe or (lambda done: f"{done:,}{f'/{total:,}' if total else ''} {unit.strip()}")
        self._last_log = time.monotonic()
        self.bar: Any = None  # a tqdm bar (tqdm has no type information)

        def open_bar() -> None:
            if sys.stderr.isatty():
                self.bar = progress_bar(total=total, unit=unit, desc=desc, **bar_kwargs)

        if enabled and sys.stderr is not None:
            self._on_terminal(open_bar)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update_to(self, done: int) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self._on_terminal(lambda: self.bar.update(max(0, done - self.done)))
        elif time.monotonic() - self._last_log >= self.LOG_INTERVAL_S:
            self._last_log = time.monotonic()
            self._logger.info("%s: %s", self.desc, self._describe(done))
        self.done = max(self.done, done)

    def close(self) -> None:
        if self.bar is not None:
            self._on_terminal(self.bar.close)
            self.bar = None

    def _on_terminal(self, display: Callable[[], Any]) -> None:
        """Runs ``display``; if the terminal has gone, drops the bar instead of failing the work."""
        try:
            display()
        except (ValueError, OSError) as error:
            if not _terminal_gone(error):
                raise
            self.bar = None


def check_has_data(tensor: Any, name: str) -> None:
    """ValueError for a tensor on the meta device, which has a shape but no values to plan with;
    TypeError for a sparse (or other non-strided) tensor, which has no dense values to read."""
    if getattr(tensor, "is_nested", False):
        raise TypeError(f"{name} must be a dense tensor of one shape (got a nested tensor)")
    if tensor.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds no data (got shape {tuple(tensor.shape)})")
    layout = getattr(tensor, "layout", None)
    if layout is not None and str(layout) != "torch.strided":
        raise TypeError(f"{name} must be a dense tensor (got layout {layout}); call .to_dense() first")


def as_array(
    value: Any,
    name: str,
    dtype: npt.DTypeLike,
    *,
    kind: str,
    ndim: int | None = 1,
) -> np.ndarray:
    """Converts a torch tensor (any device, detached), NumPy array or sequence to a C-contiguous
    NumPy array of ``dtype``, without copying when it already is one.

    ``kind`` ("int", "bool" or "float") says which source dtypes are accepted; others raise TypeError.
    Half-precision torch floats (bfloat16 has no NumPy dtype) widen to float32, exactly; sparse
    tensors raise TypeError, ragged sequences ValueError.
    """
    import numpy as np  # here, not at import: trainfast.bpe does not need NumPy (~16 MB of RSS)

    torch = sys.modules.get("torch")  # not imported: then value cannot be a tensor
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach()
        check_has_data(value, name)
        if value.device.type != "cpu":
            value = value.cpu()
        if value.is_conj():
            value = value.resolve_conj()
        if value.is_floating_point() and value.element_size() < 4:
            # NumPy has no bfloat16 (nor float8); widening to float32 is exact.
            if kind != "float":
                raise TypeError(f"{name} must have {_ARTICLE[kind]} {kind} dtype (got {value.dtype})")
            value = value.float()
        try:
            value = value.contiguous().numpy()
        except TypeError as error:  # a dtype NumPy lacks
            raise TypeError(f"{name} must have {_ARTICLE[kind]} {kind} dtype (got {value.dtype})") from error
    elif not isinstance(value, np.ndarray):
        if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, range)):
            raise TypeError(
                f"{name} must be a torch tensor, NumPy array or sequence (got {type(value).__name__})"
            )
        try:
            value = np.asarray(value)
        except ValueError as error:  # ragged nesting
            raise ValueError(f"{name} must be a rectangular sequence of numbers ({error})") from None
        if value.size == 0:
            value = value.astype(dtype)
        if value.dtype == object and kind == "int":
            check_ints_fit_int64(value, name)
        elif value.dtype == object and kind == "float" and all(
            isinstance(item, (int, float, np.number)) for item in value.flat
        ):  # numbers, some of them Python ints past int64: as floats (anything else: the dtype check below)
            try:
                value = value.astype(np.float64)
            except OverflowError:
                raise ValueError(f"{name} holds an int too large for a float") from None
    if value.dtype.kind not in _KINDS[kind]:
        raise TypeError(f"{name} must have {_ARTICLE[kind]} {kind} dtype (got {value.dtype})")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D (got shape {tuple(value.shape)})")
    target = np.dtype(dtype)
    if value.dtype != target:
        if kind == "int" and value.dtype.kind == "u" and value.size and value.max() > np.iinfo(target).max:
            raise ValueError(f"{name} has values that do not fit in {target} (max {value.max()})")
        # A flag is "nonzero", not its low byte (256 must not become False).
        value = (value != 0).astype(target) if kind == "bool" else value.astype(target)
    return np.require(value, requirements=["C", "A"])  # a view at an odd byte offset is copied, aligned


def check_ints_fit_int64(values: np.ndarray, name: str) -> None:
    """ValueError naming the first Python int of an object array that int64 cannot hold (NumPy
    falls back to object dtype for it, which would otherwise be reported as a wrong dtype)."""
    import numpy as np

    for index in np.ndindex(values.shape):
        item = values[index]
        if isinstance(item, int) and not isinstance(item, bool) and not -(2**63) <= item < 2**63:
            where = "[" + ", ".join(map(str, index)) + "]"
            shown = item if item.bit_length() <= 256 else f"an int of {item.bit_length()} bits"
            raise ValueError(f"{name}{where} does not fit in int64 (got {shown})")


def to_tensor(array: np.ndarray) -> Any:
    """A torch tensor sharing memory with ``array`` (no copy)."""
    import torch

    return torch.from_numpy(array)


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask would, for every thread, for a moment)
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_output_file(option: str, path: Any, written: Any = None) -> None:
    """For a CLI, before the work: the file ``path`` given to ``option`` (``written``: the name
    actually written, if it differs) is not a directory, and its directory exists."""
    from pathlib import Path

    target = Path(path if written is None else written)
    if target.is_dir() or str(path).endswith(("/", os.sep)):
        raise IsADirectoryError(f"{option} {str(path)!r} is a directory (give a file path)")
    if not target.resolve().parent.is_dir():
        raise FileNotFoundError(f"{option} {str(path)!r}: directory {str(target.resolve().parent)!r} does not exist")


def check_output_dir(option: str, path: Any) -> None:
    """For a CLI, before the work: ``path`` given to ``option`` is a directory or can be made one
    (its nearest existing ancestor is a writable directory). Nothing is created here."""
    from pathlib import Path

    if not str(path):
        raise ValueError(f"{option} must not be empty (give a directory)")
    target = Path(path).absolute()
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{option} {str(path)!r} is not a directory")
    ancestor = target
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise NotADirectoryError(f"{option} {str(path)!r}: {str(ancestor)!r} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise PermissionError(f"{option} {str(path)!r}: directory {str(ancestor)!r} is not writable")


def write_atomic(path: Any, data: bytes | str | Callable[[Any], None]) -> None:
    """Writes ``data`` to ``path`` through a temp file in the same directory and a rename, so readers
    never see a half-written file (str is written as UTF-8 with "\n" newlines; a callable is given
    the open binary file to write into, for data too large to copy into bytes first)."""
    write_atomic_files([(path, data)])


def write_atomic_files(files: Sequence[tuple[Any, bytes | str | Callable[[Any], None]]]) -> None:
    """:func:`write_atomic` for files that belong together: every temp file is written before any is
    renamed, and a target that is a directory is refused first, so a failed write (disk full, a bad
    path, Ctrl-C) replaces none of them."""
    import tempfile
    from pathlib import Path

    targets = [Path(path) for path, _ in files]
    for target in targets:
        if target.is_dir():
            raise IsADirectoryError(f"cannot write {str(target)!r}: it is a directory")
    temps: list[str] = []
    try:
        for target, (_, data) in zip(targets, files):
            payload = data.encode("utf-8") if isinstance(data, str) else data
            try:  # the mode a plain open() would give (mkstemp's is 0600): a replaced file's, else 0666 - umask
                mode = stat.S_IMODE(os.stat(target).st_mode)
            except OSError:
                mode = 0o666 & ~_umask()
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            temps.append(tmp)
            os.fchmod(fd, mode)
            with os.fdopen(fd, "wb") as f:
                if callable(payload):
                    payload(f)
                else:
                    f.write(payload)
                f.flush()
                os.fsync(f.fileno())
        for target, tmp in zip(targets, temps):
            os.replace(tmp, target)
    except BaseException:
        for tmp in temps:
            if os.path.exists(tmp):  # not renamed yet
                os.unlink(tmp)
        raise
