"""WriteItem reads on the native fast path (CPython 3.11 inline values) fall back exactly like getattr.

Every case builds a plan of real WriteItems, changes some of them in a way that moves an attribute
out of the inline values (materialized __dict__, deleted or added attributes, subclasses with
properties, duck-typed and slots classes, class attributes that turn into data descriptors) and
checks that sizes and bins equal the oracle's, which reads everything through plain Python.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import types

import pytest
import torch
from reference import checkpoint as ref
from test_checkpoint import byte_item, names, random_write_items, tensor_item
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from trainfast import _core, checkpoint

FAST_PATH = sys.version_info[:2] == (3, 11)  # the only layout the native fast path reads


def oracle_sizes(items, sizing):
    is_bytes = [item.type == WriteItemType.BYTE_IO for item in items]
    sizes = [0 if b else ref.item_size(item, sizing, torch._utils._element_size) for b, item in zip(is_bytes, items)]
    return is_bytes, sizes


def assert_matches_oracle(items, bins=5):
    for sizing in ("chunk", "global"):
        is_bytes, sizes = checkpoint.write_item_sizes(items, sizing=sizing)
        assert (is_bytes.tolist(), sizes.tolist()) == oracle_sizes(items, sizing)
        got = checkpoint.split_by_size_and_type(bins, items, sizing=sizing)
        assert names(got) == names(ref.split_by_size_and_type(bins, items, sizing))


def read_counts():
    fast_items, fast_attrs, generic_attrs = _core.checkpoint_read_counts()
    return fast_items, fast_attrs, generic_attrs


def plan(seed, n=300):
    return random_write_items(random.Random(seed), n)


def test_plain_write_items_take_the_fast_path():
    items = plan(0)
    read_counts()
    assert_matches_oracle(items)
    fast_items, _, generic_attrs = read_counts()
    if FAST_PATH:
        # Per call, the first items (one per class) teach the readers through getattr.
        assert fast_items >= 4 * (len(items) - 2) and generic_attrs <= 4 * 2 * 6
    else:
        assert fast_items == 0


# Each changes one item so that some attribute no longer comes from the class's inline values, or
# comes from them with a new value; `rng` picks replacement values.
def materialize_dict(item, rng):
    vars(item)  # the instance now keeps a real __dict__; its inline values are gone


def replace_via_dict(item, rng):
    other = tensor_item("r", (rng.randrange(1, 9), 3), (16, 3), torch.float64, WriteItemType.SHARD)
    vars(item)["tensor_data"] = other.tensor_data
    vars(item)["type"] = WriteItemType.SHARD


def replace_in_place(item, rng):
    # object.__setattr__ bypasses the frozen dataclass; the value stays inline
    object.__setattr__(item.tensor_data.chunk if item.tensor_data else item, "sizes" if item.tensor_data else "type",
                       torch.Size((rng.randrange(0, 7), 5)) if item.tensor_data else WriteItemType.BYTE_IO)


def add_attributes(item, rng):
    for k in range(rng.randrange(1, 40)):  # enough to overflow the shared keys
        object.__setattr__(item, f"extra_{rng.randrange(100)}_{k}", k)
    if item.tensor_data is not None:
        object.__setattr__(item.tensor_data.properties, "note", "x")


def delete_bytes_io_data(item, rng):
    try:
        object.__delattr__(item, "bytes_io_data")  # getattr now finds the class default (None)
    except AttributeError:
        pass  # deleted before


def materialize_nested(item, rng):
    if item.tensor_data is not None:
        vars(item.tensor_data)
        vars(item.tensor_data.chunk)
        vars(item.tensor_data.properties)


class TypeOverride(WriteItem):
    """A subclass whose `type` is a property (a data descriptor: it wins over the instance value)."""

    @property
    def type(self):
        return WriteItemType.BYTE_IO if self.tensor_data is None else WriteItemType.SHARD

    @type.setter
    def type(self, value):
        pass


class ChunkOverride(TensorWriteData):
    @property
    def chunk(self):
        return ChunkStorageMetadata(offsets=torch.Size((0,)), sizes=torch.Size((7,)))


def subclass_with_properties(item, rng):
    object.__setattr__(item, "__class__", TypeOverride)
    if item.tensor_data is not None:
        object.__setattr__(item.tensor_data, "__class__", ChunkOverride)


@dataclasses.dataclass(slots=True)
class SlotsProperties:
    dtype: torch.dtype


class Namespace(types.SimpleNamespace):
    pass


class LazyAttributes:
    """Duck type answering through __getattr__."""

    def __init__(self, **fields):
        self._fields = fields

    def __getattr__(self, name):
        try:
            return self.__dict__["_fields"][name]
        except KeyError:
            raise AttributeError(name) from None


def duck_typed(item, rng):
    if item.tensor_data is None:
        return
    td = item.tensor_data
    chunk = Namespace(sizes=list(td.chunk.sizes), offsets=td.chunk.offsets)
    duck_td = LazyAttributes(chunk=chunk, size=tuple(td.size), properties=SlotsProperties(td.properties.dtype))
    object.__setattr__(item, "tensor_data", duck_td)


MUTATIONS = [materialize_dict, replace_via_dict, replace_in_place, add_attributes, delete_bytes_io_data,
             materialize_nested, subclass_with_properties, duck_typed]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("seed", range(3))
def test_changed_items_match_the_oracle(mutation, seed):
    rng = random.Random(seed)
    items = plan(seed)
    for idx in rng.sample(range(len(items)), 40) + [0, len(items) - 1]:
        mutation(items[idx], rng)
    assert_matches_oracle(items)


def test_all_mutations_mixed():
    rng = random.Random(7)
    items = plan(7, n=2000)
    for item in items:
        if rng.random() < 0.3:
            rng.choice(MUTATIONS)(item, rng)
    read_counts()
    assert_matches_oracle(items, bins=8)
    fast_items, _, generic_attrs = read_counts()
    assert generic_attrs > 0
    if FAST_PATH:
        assert fast_items > 0


def test_deleted_tensor_data_falls_back_to_the_class_default():
    item = tensor_item("x", (2, 2))
    object.__delattr__(item, "tensor_data")  # the dataclass default None is what getattr sees
    with pytest.raises(ValueError, match=r"items\[1\] is a tensor item but its tensor_data is None"):
        checkpoint.split_by_size_and_type(2, [tensor_item("y", (2, 2)), item])


def test_deleted_dtype_is_a_missing_attribute():
    item = tensor_item("x", (2, 2))
    object.__delattr__(item.tensor_data.properties, "dtype")  # no class default: AttributeError
    with pytest.raises(TypeError, match=r"items\[1\] has no attribute 'dtype'"):
        checkpoint.split_by_size_and_type(2, [tensor_item("y", (2, 2)), item])


class Float64:
    """A non-data descriptor: an instance value of the same name wins over it."""

    def __get__(self, obj, owner=None):
        return torch.float64


def test_class_attribute_changed_while_reading():
    # Reading item 1's dtype installs a property on TensorWriteData.chunk; a class attribute that is
    # a data descriptor wins over the instance values from then on, so items 2.. see it.
    class Trigger:
        @property
        def dtype(self):
            TensorWriteData.chunk = property(lambda self: ChunkStorageMetadata(torch.Size((0,)), torch.Size((3,))))
            return torch.bfloat16

    trigger = tensor_item("trigger", (5,))
    object.__setattr__(trigger.tensor_data, "properties", Trigger())
    items = [tensor_item("a", (8, 8)), trigger] + [tensor_item(f"t{i}", (4, 4)) for i in range(5)]
    try:
        read_counts()
        _, sizes = checkpoint.write_item_sizes(items)
        assert sizes.tolist() == [128, 10] + [6] * 5
    finally:
        del TensorWriteData.chunk
    assert read_counts()[0] == 0  # every item after the change needed getattr
    items.remove(trigger)
    assert checkpoint.write_item_sizes(items)[1].tolist() == [128] + [32] * 5
    if FAST_PATH:
        assert read_counts()[0] == len(items) - 1


def test_non_data_descriptor_and_mutable_descriptor_class():
    items = [tensor_item(f"t{i}", (4, 4), dtype=torch.float32) for i in range(4)]
    try:
        TensorProperties.dtype = Float64()  # non-data: the instances' own dtype still wins
        assert checkpoint.write_item_sizes(items)[1].tolist() == [64] * 4
        Float64.__set__ = lambda self, obj, value: None  # now a data descriptor: it wins
        assert [item.tensor_data.properties.dtype for item in items] == [torch.float64] * 4
        assert checkpoint.write_item_sizes(items)[1].tolist() == [128] * 4
    finally:
        del TensorProperties.dtype
        del Float64.__set__
    assert checkpoint.write_item_sizes(items)[1].tolist() == [64] * 4


def test_item_list_emptied_while_reading():
    items = [tensor_item("a", (2,))]

    class Clears:
        @property
        def type(self):
            items.clear()
            return WriteItemType.BYTE_IO

    items += [Clears(), tensor_item("b", (2,)), byte_item("c")]
    with pytest.raises(ValueError, match="changed length"):
        checkpoint.split_by_size_and_type(2, items)


def test_item_list_grown_by_its_last_item():
    """Growth after the last item is read was an internal "bin plan does not cover every item"."""
    items = [tensor_item("a", (2,))]

    class Grows:
        @property
        def type(self):
            items.append(byte_item("late"))
            return WriteItemType.BYTE_IO

    items.append(Grows())
    with pytest.raises(ValueError, match="changed length"):
        checkpoint.split_by_size_and_type(2, items)


# --- large plans: runs of plain items are read on worker threads ------------------------------------


@pytest.fixture(scope="module")
def large_plan():
    from trainfast._examples import many_write_items

    return many_write_items(80_000)


@pytest.mark.parametrize("seed", range(2))
def test_large_plan_with_changed_items_matches_the_oracle(large_plan, seed):
    rng = random.Random(seed)
    items = list(large_plan)
    for idx in sorted(rng.sample(range(len(items)), 12)) + [40_000, 70_001]:
        items[idx] = copy_item(items[idx])
        rng.choice(MUTATIONS)(items[idx], rng)
    expected = oracle_sizes(items, "chunk")
    for num_threads in (1, 2, 3):
        read_counts()
        is_bytes, sizes = checkpoint.write_item_sizes(items, num_threads=num_threads)
        assert (is_bytes.tolist(), sizes.tolist()) == expected
        if FAST_PATH:
            assert read_counts()[0] >= len(items) - 100
    got = checkpoint.split_by_size_and_type(8, items, num_threads=2)
    assert names(got) == names(ref.split_by_size_and_type(8, items, "chunk"))


def copy_item(item):
    """A deep copy (the fixture's items are shared between tests)."""
    import copy

    return copy.deepcopy(item)


def test_large_plan_class_changed_while_reading(large_plan):
    class Trigger:
        @property
        def dtype(self):
            TensorWriteData.chunk = property(lambda self: ChunkStorageMetadata(torch.Size((0,)), torch.Size((3,))))
            return torch.bfloat16

    items = list(large_plan)
    trigger_idx = 50_000
    while items[trigger_idx].tensor_data is None:
        trigger_idx += 1
    items[trigger_idx] = copy_item(items[trigger_idx])
    object.__setattr__(items[trigger_idx].tensor_data, "properties", Trigger())
    before = oracle_sizes(items[:trigger_idx], "chunk")
    # The trigger's own chunk is read before its dtype, so before the property exists.
    trigger_size = math.prod(items[trigger_idx].tensor_data.chunk.sizes) * 2
    try:
        is_bytes, sizes = checkpoint.write_item_sizes(items, num_threads=2)
        after = oracle_sizes(items[trigger_idx:], "chunk")  # the property is installed by now
    finally:
        del TensorWriteData.chunk
    assert is_bytes.tolist() == before[0] + after[0]
    assert sizes.tolist() == before[1] + [trigger_size] + after[1][1:]
    assert set(after[1][1:]) <= {0, 6, 12}  # 3 elements of bf16 or fp32


@pytest.mark.parametrize("num_threads", [0, -1, 1.5, "2"])
def test_bad_num_threads(num_threads):
    with pytest.raises((ValueError, TypeError), match="num_threads"):
        checkpoint.split_by_size_and_type(2, [byte_item("a")], num_threads=num_threads)
