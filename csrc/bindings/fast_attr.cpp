// AttrReader's resolution: which inline-values slot holds an attribute (CPython 3.11 layout).
#include "bindings/fast_attr.h"

#include <new>

namespace trainfast::bindings {
namespace {

AttrReadCounts g_counts;  // guarded by the GIL

#if TRAINFAST_FAST_ATTR
// Mirrors CPython 3.11's `struct _dictkeysobject` (Include/internal/pycore_dict.h), whose header is
// internal; only the fields read here. A shared-keys ("split") table has kind 2 and its entries are
// (key, value) pairs after the header's `1 << dk_log2_index_bytes` bytes of hash indices.
struct DictKeys311 {
  Py_ssize_t dk_refcnt;
  uint8_t dk_log2_size;
  uint8_t dk_log2_index_bytes;
  uint8_t dk_kind;
  uint32_t dk_version;
  Py_ssize_t dk_usable;
  Py_ssize_t dk_nentries;
  // char dk_indices[] follows (a flexible array member in C)
};
static_assert(sizeof(void*) != 8 || sizeof(DictKeys311) == 32, "dk_indices starts at byte 32");
struct DictUnicodeEntry311 {
  PyObject* me_key;
  PyObject* me_value;
};
constexpr uint8_t kDictKeysSplit = 2;

// Index of `name` among the shared keys (that is, in every instance's values), or -1. Shared keys
// only ever grow at the end while every values array is at least as long as the table was usable,
// so an index below dk_nentries stays valid and in bounds for every instance of the class.
Py_ssize_t shared_key_index(const DictKeys311* keys, PyObject* name) {
  if (keys->dk_kind != kDictKeysSplit) return -1;
  const char* indices = reinterpret_cast<const char*>(keys) + sizeof(DictKeys311);
  const auto* entries = reinterpret_cast<const DictUnicodeEntry311*>(
      indices + (size_t{1} << keys->dk_log2_index_bytes));
  for (Py_ssize_t i = 0; i < keys->dk_nentries; ++i) {
    PyObject* key = entries[i].me_key;
    if (key == name) return i;
    // Shared keys are unique exact str; names are usually interned, compare by value otherwise
    // (two exact str never raise here).
    if (key != nullptr && PyUnicode_CheckExact(key) && PyUnicode_Compare(key, name) == 0) return i;
  }
  return -1;
}
#endif

}  // namespace

void add_attr_read_counts(const AttrReadCounts& counts) {
  g_counts.fast += counts.fast;
  g_counts.generic += counts.generic;
}

AttrReadCounts take_attr_read_counts() {
  AttrReadCounts counts = g_counts;
  g_counts = {};
  return counts;
}

AttrReader::AttrReader(const char* name) : name_(PyUnicode_InternFromString(name)) {
  if (name_ == nullptr) throw std::bad_alloc();
}

AttrReader::~AttrReader() {
  add_attr_read_counts(counts_);
#if TRAINFAST_FAST_ATTR
  clear_cache();
  Py_XDECREF(rejected_type_);
#endif
  Py_DECREF(name_);
}

PyObject* AttrReader::get_generic(PyObject* obj) {
  ++counts_.generic;
  PyObject* value = PyObject_GetAttr(obj, name_);
#if TRAINFAST_FAST_ATTR
  PyTypeObject* type = Py_TYPE(obj);
  // Learn the class once: not for the cached class (this object has no inline value for the
  // name), nor for the last class found ineligible while it is unchanged.
  const bool known = type == type_ ? type->tp_version_tag == version_tag_
                                   : type == rejected_type_ && type->tp_version_tag != 0 &&
                                         type->tp_version_tag == rejected_version_tag_;
  if (value != nullptr && !known) resolve(type, obj, value);
#endif
  return value;
}

#if TRAINFAST_FAST_ATTR
void AttrReader::clear_cache() {
  Py_CLEAR(type_);
  version_tag_ = 0;
  keys_ = nullptr;
  index_ = 0;
}

// Eligible when CPython 3.11's PyObject_GenericGetAttr would return values[index] for every
// instance that has a non-NULL value there: a heap class with managed dict (inline values) and the
// generic getattr, whose MRO has no data descriptor for the name (that would win over the instance
// value). A class attribute of a mutable class could gain __set__ without changing this class's
// version tag, so only immutable-class attributes without __set__ are allowed (like CPython's own
// specializer). The class's version tag, bumped by any change to the class or its bases, keeps
// this valid; `obj`'s own value must match `expected` (from PyObject_GetAttr) as a layout check.
void AttrReader::resolve(PyTypeObject* type, PyObject* obj, PyObject* expected) {
  PyObject* const* values = nullptr;
  const unsigned long required = Py_TPFLAGS_HEAPTYPE | Py_TPFLAGS_MANAGED_DICT | Py_TPFLAGS_HAVE_GC;
  bool eligible = (type->tp_flags & required) == required &&
                  type->tp_getattro == PyObject_GenericGetAttr &&
                  reinterpret_cast<PyHeapTypeObject*>(type)->ht_cached_keys != nullptr;
  if (eligible) {
    values = reinterpret_cast<PyObject* const* const*>(obj)[-4];
    // No inline values here (a __dict__ was made): decide on a later object of this class.
    if (values == nullptr) return;
    PyObject* descr = _PyType_Lookup(type, name_);  // borrowed; may assign the version tag
    if (descr != nullptr) {
      PyTypeObject* descr_type = Py_TYPE(descr);
      eligible = (descr_type->tp_flags & Py_TPFLAGS_IMMUTABLETYPE) != 0 &&
                 descr_type->tp_descr_set == nullptr;
    }
  }
  const unsigned int version_tag = type->tp_version_tag;
  eligible = eligible && version_tag != 0 && (type->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) != 0;
  Py_ssize_t index = -1;
  if (eligible) {
    auto* keys = reinterpret_cast<const DictKeys311*>(
        reinterpret_cast<PyHeapTypeObject*>(type)->ht_cached_keys);
    index = shared_key_index(keys, name_);
    // No value of its own here (deleted; getattr found a class attribute): decide later.
    if (index >= 0 && values[index] == nullptr) return;
    eligible = index >= 0 && values[index] == expected;
  }
  if (!eligible) {
    // The cached class (if any) stays: a few odd items do not slow down the rest.
    Py_INCREF(type);
    Py_XSETREF(rejected_type_, type);
    rejected_version_tag_ = version_tag;
    return;
  }
  clear_cache();
  Py_INCREF(type);
  type_ = type;
  version_tag_ = version_tag;
  keys_ = reinterpret_cast<PyHeapTypeObject*>(type)->ht_cached_keys;
  index_ = index;
}
#endif

}  // namespace trainfast::bindings
