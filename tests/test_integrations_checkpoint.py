"""trainfast.integrations.{megatron,torch_dcp}: patch the real upstream modules and compare."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from trainfast._examples import gpt_write_items
from trainfast.integrations import megatron as megatron_integration
from trainfast.integrations import torch_dcp as torch_dcp_integration

MEGATRON_MODULE = "megatron.core.dist_checkpointing.strategies.filesystem_async"


def import_or_fail(name: str):
    """Upstream packages are test dependencies: a missing one fails loudly instead of skipping."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except ImportError as error:
        pytest.fail(f"{name} is not importable, so the integration cannot be tested: {error}")


def ids(binned):
    return [[id(item) for item in group] for group in binned]


@pytest.fixture
def megatron_fs():
    module = import_or_fail(MEGATRON_MODULE)
    yield module
    megatron_integration.unpatch()


def test_megatron_patch_is_identical_and_reversible(megatron_fs):
    original = megatron_fs._split_by_size_and_type
    items = gpt_write_items(num_layers=12)
    expected = {bins: ids(original(bins, items)) for bins in (1, 2, 3, 8, 17)}

    patched = megatron_integration.patch()
    assert f"{MEGATRON_MODULE}._split_by_size_and_type" in patched
    assert megatron_integration.patch() == patched  # idempotent
    replacement = megatron_fs._split_by_size_and_type
    assert replacement is not original and replacement.__trainfast_original__ is original
    for bins, want in expected.items():
        assert ids(replacement(bins, items)) == want

    megatron_integration.unpatch()
    assert megatron_fs._split_by_size_and_type is original
    assert not megatron_integration.is_patched()


def _reloaded_copy(function):
    """What importlib.reload puts in a module: a new function object with the same name and module."""
    import types

    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__qualname__, copy.__kwdefaults__ = function.__qualname__, function.__kwdefaults__
    return copy


def test_patch_after_reload_wrappers_and_many_threads():
    import functools
    import threading

    torch_fs = importlib.import_module("torch.distributed.checkpoint.filesystem")
    upstream = torch_fs._split_by_size_and_type
    try:
        torch_dcp_integration.patch()
        fresh = torch_fs._split_by_size_and_type = _reloaded_copy(upstream)  # importlib.reload(torch_fs)
        assert not torch_dcp_integration.is_patched()
        torch_dcp_integration.patch()  # patches the reloaded copy
        assert torch_fs._split_by_size_and_type.__trainfast_original__ is fresh
        torch_dcp_integration.unpatch()
        assert torch_fs._split_by_size_and_type is fresh
        torch_dcp_integration.patch()
        torch_fs._split_by_size_and_type = _reloaded_copy(fresh)
        torch_dcp_integration.unpatch()  # leaves the newer copy, not the stale function
        assert torch_fs._split_by_size_and_type is not fresh
        torch_fs._split_by_size_and_type = upstream
        # Another library wraps ours: patch() again is a no-op, unpatch() restores upstream's function.
        torch_dcp_integration.patch()
        ours = torch_fs._split_by_size_and_type
        torch_fs._split_by_size_and_type = functools.partial(ours)
        torch_dcp_integration.patch()
        assert torch_fs._split_by_size_and_type.func is ours and torch_dcp_integration.is_patched()
        torch_dcp_integration.unpatch()
        assert torch_fs._split_by_size_and_type is upstream
        for _ in range(20):  # concurrent patch() calls must record upstream's function, never ours
            threads = [threading.Thread(target=torch_dcp_integration.patch) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            torch_dcp_integration.unpatch()
            assert torch_fs._split_by_size_and_type is upstream
    finally:
        torch_dcp_integration.unpatch()
        torch_fs._split_by_size_and_type = upstream


def test_megatron_writer_looks_the_function_up_at_call_time(megatron_fs):
    # patch() replaces the module attribute, so the writer must call it through the module globals.
    source = importlib.import_module("inspect").getsource(megatron_fs.FileSystemWriterAsync.prepare_write_data)
    assert "_split_by_size_and_type(bins, plan.items)" in source


def test_nvidia_resiliency_ext_copy_is_patched_when_installed(megatron_fs):
    patched = megatron_integration.patch()
    try:
        importlib.import_module("nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async")
    except ImportError:
        assert not any("nvidia_resiliency_ext" in name for name in patched)
    else:
        assert any("nvidia_resiliency_ext" in name for name in patched)
    finally:
        megatron_integration.unpatch()


def test_nvidia_resiliency_ext_copy_is_patched_and_restored(megatron_fs, monkeypatch):
    # The package is not a test dependency: a stand-in module with its function tests the patch path.
    import sys
    import types

    name = "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async"
    parts = name.split(".")
    for depth in range(1, len(parts)):
        monkeypatch.setitem(sys.modules, ".".join(parts[:depth]), types.ModuleType(".".join(parts[:depth])))
    stand_in = types.ModuleType(name)
    stand_in._split_by_size_and_type = megatron_fs._split_by_size_and_type
    monkeypatch.setitem(sys.modules, name, stand_in)
    original = stand_in._split_by_size_and_type
    patched = megatron_integration.patch()
    try:
        assert f"{name}._split_by_size_and_type" in patched
        assert stand_in._split_by_size_and_type is not original
        items = gpt_write_items(num_layers=2)
        assert ids(stand_in._split_by_size_and_type(4, items)) == ids(original(4, items))
    finally:
        megatron_integration.unpatch()
    assert stand_in._split_by_size_and_type is original


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_torch_dcp_patch_round_trips_a_real_checkpoint(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, filesystem, load, save

    original = filesystem._split_by_size_and_type
    calls = []
    try:
        torch_dcp_integration.patch()
        patched = filesystem._split_by_size_and_type
        assert patched.__trainfast_original__ is original
        filesystem._split_by_size_and_type = lambda bins, items: calls.append(bins) or patched(bins, items)
        state = {f"w{i}": torch.randn(17 * (i + 1), 3) for i in range(10)} | {"step": 7}
        save(state, storage_writer=FileSystemWriter(str(tmp_path), thread_count=3), no_dist=True)
        restored = {f"w{i}": torch.zeros(17 * (i + 1), 3) for i in range(10)} | {"step": 0}
        load(restored, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    finally:
        torch_dcp_integration.unpatch()
    assert calls == [3]
    assert filesystem._split_by_size_and_type is original
    for key, value in state.items():
        assert torch.equal(torch.as_tensor(restored[key]), torch.as_tensor(value))


def test_torch_dcp_patch_matches_upstream():
    from torch.distributed.checkpoint import filesystem

    items = gpt_write_items(num_layers=12)
    expected = ids(filesystem._split_by_size_and_type(8, items))
    try:
        torch_dcp_integration.patch()
        assert ids(filesystem._split_by_size_and_type(8, items)) == expected
    finally:
        torch_dcp_integration.unpatch()
