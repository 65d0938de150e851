"""The package itself: version, typed stub complete, CLI entry point."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import trainfast
from trainfast import _core


def test_version():
    assert isinstance(trainfast.__version__, str) and trainfast.__version__.count(".") == 2


def test_version_matches_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == trainfast.__version__


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
    with pytest.raises(AttributeError):
        trainfast.no_such_module


def test_cli_help_lists_commands():
    for module in ("trainfast.cli", "trainfast"):
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=True)
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


def _public_modules() -> list[str]:
    import pkgutil

    names = ["trainfast"]
    for info in pkgutil.walk_packages(trainfast.__path__, "trainfast."):
        if not any(part.startswith("_") for part in info.name.split(".")[1:]):
            names.append(info.name)
    return sorted(names)


def test_docstring_examples_run():
    # Every `>>>` example in a public module's docstrings is output the reader can trust.
    import doctest
    import importlib

    attempted_by_module = {}
    for name in _public_modules():
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0, f"a docstring example in {name} fails (doctest output above)"
        attempted_by_module[name] = result.attempted
    for name in ("trainfast.bpe.pretokenize", "trainfast.bpe.train", "trainfast.bpe.tokenizer", "trainfast.buckets",
                 "trainfast.checkpoint", "trainfast.eplb", "trainfast.pipeline"):
        assert attempted_by_module[name] > 0, f"{name} has no docstring example"


@pytest.mark.slow
def test_demo_runs_and_every_comparison_is_identical():
    # `make demo` is the first thing a newcomer runs: each section must run and agree with upstream.
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "trainfast.cli", "demo"], capture_output=True, text=True, cwd=root,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    for section in ("bpe:", "pretokenize:", "bpe encode:", "buckets:", "checkpoint:", "eplb:", "pipeline:",
                    "balanced_layout:"):
        assert any(line.startswith(section) for line in out.stdout.splitlines()), (section, out.stdout)
    assert out.stdout.count("identical=True") >= 6 and "identical=False" not in out.stdout, out.stdout
    assert "same counts=True" in out.stdout and "round trip decode(encode(text)) == text: True" in out.stdout


def test_package_source_needs_no_python_newer_than_pyproject_says():
    """pyproject.toml promises Python 3.9, and CI runs only 3.11: vermin checks the package's own
    source against the promise, as far as it can see (syntax, standard-library modules, functions
    and arguments by name; not a method called on a value whose type it cannot tell)."""
    pytest.importorskip("vermin")
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    oldest = pyproject["project"]["requires-python"].removeprefix(">=")
    package = Path(trainfast.__file__).parent
    run_vermin = "import sys, vermin; sys.exit(vermin.main())"  # no `python -m vermin`
    out = subprocess.run([sys.executable, "-c", run_vermin, "--no-tips", "--violations", "--no-parse-comments",
                          f"-t={oldest}-", str(package)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_package_type_checks(tmp_path):
    """The package ships py.typed, so its annotations are what users' type checkers see: mypy (the
    settings in pyproject.toml) must find no error in the copy under test, stub included."""
    pytest.importorskip("mypy")
    # A copy: checked in place, an installed package's root would be site-packages, whose other
    # modules (typing_extensions.py) mypy then refuses as shadowing its own.
    package = tmp_path / "src" / "trainfast"
    shutil.copytree(Path(trainfast.__file__).parent, package, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    config = Path(__file__).parents[1] / "pyproject.toml"
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir",
                          str(tmp_path / "cache"), "--no-error-summary", str(package)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
