// AttrReader: `getattr(obj, name)` for millions of objects of one plain Python class (dataclasses
// such as torch DCP's WriteItem), without CPython's per-call hash lookup of the name.
//
// On CPython 3.11 an instance of a plain class keeps its attributes in "inline values": an array
// of PyObject* (pointed to from just before the object) indexed like the class's shared keys
// (`PyHeapTypeObject::ht_cached_keys`). CPython's own LOAD_ATTR_INSTANCE_VALUE instruction reads
// `values[index]` after checking only the type and its version tag; AttrReader does the same, with
// the index found once per class, and checks a little more (see fast_attr.cpp). Anything else (other
// classes, subclasses, a materialized __dict__, a missing value, data descriptors, __getattr__,
// other Python versions) takes PyObject_GetAttr, so results are always those of getattr.
#pragma once

#include <Python.h>

#include <cstdint>

// The inline-values layout read below is CPython 3.11's; other versions (and PyPy, and builds
// with -DTRAINFAST_NO_FAST_ATTR) always use PyObject_GetAttr.
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000 && !defined(Py_LIMITED_API) && \
    !defined(PYPY_VERSION) && !defined(TRAINFAST_NO_FAST_ATTR)
#define TRAINFAST_FAST_ATTR 1
#else
#define TRAINFAST_FAST_ATTR 0
#endif

namespace trainfast::bindings {

// Counts how attributes were read (the tests check that the fast path runs and falls back).
struct AttrReadCounts {
  int64_t fast = 0;
  int64_t generic = 0;
};

// Adds to the process-wide counts read back by `checkpoint_read_counts` (GIL held).
void add_attr_read_counts(const AttrReadCounts& counts);
AttrReadCounts take_attr_read_counts();

class AttrReader {
 public:
  explicit AttrReader(const char* name);
  ~AttrReader();
  AttrReader(const AttrReader&) = delete;
  AttrReader& operator=(const AttrReader&) = delete;

  // getattr(obj, name) as a new reference, or nullptr with a Python exception set. GIL held.
  PyObject* get(PyObject* obj) {
#if TRAINFAST_FAST_ATTR
    if (Py_TYPE(obj) == type_ && type_->tp_version_tag == version_tag_ &&
        reinterpret_cast<PyHeapTypeObject*>(type_)->ht_cached_keys == keys_) {
      // Slot -4 before a managed-dict object: its inline values, or NULL once a __dict__ exists.
      PyObject* const* values = reinterpret_cast<PyObject* const* const*>(obj)[-4];
      if (values != nullptr) {
        PyObject* value = values[index_];
        if (value != nullptr) {
          ++counts_.fast;
          Py_INCREF(value);
          return value;
        }
      }
    }
#endif
    return get_generic(obj);
  }

  // obj.name when the fast path applies, else nullptr: reads memory only (no reference is taken,
  // no Python code runs, nothing is written), so other threads may call it while the GIL's holder
  // waits for them. The result is borrowed: valid until Python code runs. `obj` may be nullptr.
  PyObject* peek(PyObject* obj) const {
    PyObject* const* slot = slot_of(obj);
    return slot != nullptr ? *slot : nullptr;
  }

  // Where obj.name is stored when the fast path applies, else nullptr (reads as peek()).
  PyObject* const* slot_of(PyObject* obj) const {
#if TRAINFAST_FAST_ATTR
    if (obj != nullptr && Py_TYPE(obj) == type_ && type_->tp_version_tag == version_tag_ &&
        reinterpret_cast<PyHeapTypeObject*>(type_)->ht_cached_keys == keys_) {
      PyObject* const* values = reinterpret_cast<PyObject* const* const*>(obj)[-4];
      if (values != nullptr) return values + index_;
    }
#else
    (void)obj;
#endif
    return nullptr;
  }

  PyObject* name() const { return name_; }

 private:
  PyObject* get_generic(PyObject* obj);
#if TRAINFAST_FAST_ATTR
  // Caches where `name_` lives in `type`'s inline values; leaves the cache empty when it cannot.
  void resolve(PyTypeObject* type, PyObject* obj, PyObject* expected);
  void clear_cache();

  PyTypeObject* type_ = nullptr;  // strong reference while cached
  unsigned int version_tag_ = 0;  // never 0 while cached: CPython's "no valid tag"
  void* keys_ = nullptr;
  Py_ssize_t index_ = 0;
  PyTypeObject* rejected_type_ = nullptr;  // last class found ineligible (strong reference, like type_)
  unsigned int rejected_version_tag_ = 0;
#endif
  PyObject* name_;
  AttrReadCounts counts_;
};

}  // namespace trainfast::bindings
