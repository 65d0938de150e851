"""``trainfast`` command line: one subcommand module per domain in this package.

Each module defines ``register(subparsers)`` and may define ``demo()``, which ``trainfast demo``
runs in module-name order.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import signal
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["main"]


def _domain_modules() -> list[ModuleType]:
    names = sorted(info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_"))
    return [importlib.import_module(f"{__name__}.{name}") for name in names]


def _run_demo(args: argparse.Namespace) -> int:
    for module in _domain_modules():
        if hasattr(module, "demo"):
            module.demo()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trainfast",
        description="trainfast: checkpoint binning, gradient buckets, EPLB, pipeline splits and BPE from the "
                    "command line (`trainfast demo` runs each on built-in examples).")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    subparsers = parser.add_subparsers(dest="command", required=True)
    demo = subparsers.add_parser("demo", help="run every kernel on built-in examples")
    demo.set_defaults(handler=_run_demo)
    for module in _domain_modules():
        module.register(subparsers)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return int(args.handler(args) or 0)
    except BrokenPipeError:  # `trainfast ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so exit's flush stays quiet
        return 128 + signal.SIGPIPE
    except (ValueError, TypeError, OSError, ImportError) as error:  # ImportError: an optional package (regex ...)
        message = str(error)
        if hasattr(args, "errors"):  # the library's hint names its keyword; here the option does the same
            message = message.replace("pass errors='replace' or errors='ignore'", "pass --errors replace or --errors ignore")
        logging.getLogger("trainfast").error("trainfast %s: error: %s", args.command, message)
        return 2
    except MemoryError:  # sizes asked on the command line (--layers, --bins ...) beyond this machine
        logging.getLogger("trainfast").error("trainfast %s: error: out of memory for these arguments", args.command)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
