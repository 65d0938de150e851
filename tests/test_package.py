"""The package itself: version, typed stub complete, CLI entry point."""

import ast
import subprocess
import sys
from pathlib import Path

import trainfast
from trainfast import _core


def test_version():
    assert isinstance(trainfast.__version__, str) and trainfast.__version__.count(".") == 2


def test_stub_declares_every_native_name():
    stub = Path(trainfast.__file__).with_name("_core.pyi")
    declared = {node.name for node in ast.parse(stub.read_text()).body if isinstance(node, ast.FunctionDef)}
    declared |= {node.name for node in ast.parse(stub.read_text()).body if isinstance(node, ast.ClassDef)}
    exported = {name for name in dir(_core) if not name.startswith("_")}
    assert exported - declared == set(), "names in trainfast._core missing from _core.pyi"
    assert declared - exported == set(), "names in _core.pyi that trainfast._core lacks"


def test_py_typed_marker_installed():
    assert Path(trainfast.__file__).with_name("py.typed").exists()


def test_unknown_attribute():
    import pytest

    with pytest.raises(AttributeError):
        trainfast.no_such_module


def test_cli_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "trainfast.cli", "--help"], capture_output=True, text=True, check=True)
    assert "demo" in out.stdout and "checkpoint" in out.stdout


def test_native_core_uses_no_iostreams():
    """Built with a toolchain that links libstdc++ into the module (GCC 13 on the GPU machines'
    image), the module's copy of the stream code segfaulted in `operator<<` on the first error
    message it formatted. Messages are built with to_string/to_chars instead."""
    import re

    csrc = Path(__file__).resolve().parents[1] / "csrc"
    uses = [f"{path.relative_to(csrc)}:{number}"
            for path in sorted(csrc.rglob("*.[ch]*"))
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if re.search(r"#include\s*<(sstream|iostream|fstream|ostream|istream)>", line)]
    assert uses == []
