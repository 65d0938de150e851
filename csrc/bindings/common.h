// Conversions shared by every binding: zero-copy NumPy views in and out, Ctrl-C polling.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/parallel.h"
#include "common/utf8.h"

namespace trainfast::bindings {

namespace py = pybind11;

template <typename T>
using CArray = py::array_t<T, py::array::c_style>;

// A read-only span over a 1-D C-contiguous array; `name` is the Python argument name for errors.
// NumPy keeps a view at any byte offset (np.frombuffer(buf, offset=1)) C-contiguous; reading its
// elements through a T* would be undefined behaviour.
template <typename T>
void check_aligned(const CArray<T>& array, const char* name) {
  if (reinterpret_cast<uintptr_t>(array.data()) % alignof(T) != 0) {
    throw py::value_error(std::string(name) + " must be an aligned array (got a view at an odd byte offset; "
                          "pass numpy.require(a, requirements='CA'))");
  }
}

template <typename T>
std::span<const T> span_1d(const CArray<T>& array, const char* name) {
  if (array.ndim() != 1) {
    throw py::value_error(std::string(name) + " must be 1-D (got " + std::to_string(array.ndim()) +
                          "-D)");
  }
  check_aligned(array, name);
  return {array.data(), static_cast<size_t>(array.shape(0))};
}

// Runs Python's signal handlers at step 0, 2^16, 2^17 ... of a loop that holds the GIL over
// millions of items, and raises what they raise (Ctrl-C): such a loop never lets Python do it.
inline void check_signals_every_2_16(uint64_t step) {
  if ((step & 0xFFFF) == 0 && PyErr_CheckSignals() != 0) throw py::error_already_set();
}

// Clears the pending Python error, which stands for bad input, so that the caller can say what
// is wrong or take another path. Ctrl-C (KeyboardInterrupt, as anything not an Exception) and
// MemoryError are never swallowed: they propagate from here.
inline void clear_input_error() {
  if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError)) {
    throw py::error_already_set();
  }
  PyErr_Clear();
}

// Raises trainfast._util.UpstreamAssertionError (a ValueError and an AssertionError) where the
// upstream code asserts, so callers catching either see what they did before a patch. Needs the GIL.
[[noreturn]] inline void raise_upstream_assertion(const std::string& message) {
  const py::object error_type = py::module_::import("trainfast._util").attr("UpstreamAssertionError");
  PyErr_SetString(error_type.ptr(), message.c_str());
  throw py::error_already_set();
}

// `value` as a Python int: an int as it is, anything with __index__ (NumPy integers) through it,
// nothing (an empty object) for anything else, bool included. __index__ may run Python code; an
// error from it other than TypeError (Ctrl-C, MemoryError) propagates.
inline py::object as_index(PyObject* value) {
  if (PyBool_Check(value)) return {};
  if (PyLong_Check(value)) return py::reinterpret_borrow<py::object>(value);
  if (!PyIndex_Check(value)) return {};
  auto out = py::reinterpret_steal<py::object>(PyNumber_Index(value));
  if (!out) {
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw py::error_already_set();
    PyErr_Clear();
  }
  return out;
}

// A private copy of an input that the core reads without the GIL: another Python thread may write
// to the caller's array meanwhile, and the core reads some values more than once (sizes its
// outputs in one pass, fills them in another), so a changing value could overrun an output.
template <typename T>
std::vector<T> snapshot(std::span<const T> values) {
  return {values.begin(), values.end()};
}

// The T inside `obj`, or nullptr when `obj` is no T. `T.__new__(T)` makes an instance whose
// __init__ never ran (for a class with no Python constructor, the only way to make one), and
// pybind11 would hand a method lazily allocated, uninitialised memory for it: a TypeError instead.
// "Registered" is set for every instance pybind11 initialised, holder or not (one returned by
// reference from C++ has none).
template <typename T>
T* bound_value(py::handle obj) {
  const py::detail::type_info* type = py::detail::get_type_info(typeid(T), /*throw_if_missing=*/true);
  if (!PyObject_TypeCheck(obj.ptr(), type->type)) return nullptr;
  auto holder = reinterpret_cast<py::detail::instance*>(obj.ptr())->get_value_and_holder(type);
  if (!holder.instance_registered()) {
    throw py::type_error("this " + std::string(type->type->tp_name) +
                         " was never initialised (made by __new__ without __init__)");
  }
  return holder.template value_ptr<T>();
}

// A bound T taken as an argument (self included) through bound_value(): an object of another type
// fails overload matching as usual, and signatures still name T.
template <typename T>
struct Self {
  T* value = nullptr;
  T& operator*() const { return *value; }
  T* operator->() const { return value; }
};

// A method of T for py::class_::def whose self is taken as Self<T>.
template <typename T, typename Result, typename... Args>
auto method(Result (T::*member)(Args...)) {
  return [member](Self<T> self, Args... args) -> Result { return ((*self).*member)(std::forward<Args>(args)...); };
}
template <typename T, typename Result, typename... Args>
auto method(Result (T::*member)(Args...) const) {
  return [member](Self<T> self, Args... args) -> Result { return ((*self).*member)(std::forward<Args>(args)...); };
}

// Moves a vector into a NumPy array that owns it (no copy); torch.from_numpy then shares it too.
template <typename T, typename Allocator>
py::array_t<T> to_numpy(std::vector<T, Allocator>&& values, std::vector<py::ssize_t> shape = {}) {
  using Vector = std::vector<T, Allocator>;
  auto* owned = new Vector(std::move(values));
  py::capsule free_when_done(owned, [](void* p) { delete static_cast<Vector*>(p); });
  if (shape.empty()) shape = {static_cast<py::ssize_t>(owned->size())};
  return py::array_t<T>(shape, owned->data(), free_when_done);
}

// What a signal handler raised during a poll (Ctrl-C's KeyboardInterrupt, a SIGTERM handler's
// SystemExit, an alarm's TimeoutError), held until the Interrupted it causes reaches Python, where
// the translator in module.cpp raises it again. Polls run on the calling thread, with the GIL.
struct SignalError {
  PyObject* type = nullptr;
  PyObject* value = nullptr;
  PyObject* traceback = nullptr;
};
inline thread_local SignalError g_signal_error;

// Drops a held error (a call whose Interrupted was overtaken by another error); the GIL is held.
inline void clear_signal_error() {
  Py_CLEAR(g_signal_error.type);
  Py_CLEAR(g_signal_error.value);
  Py_CLEAR(g_signal_error.traceback);
}

// Moves the pending Python error into g_signal_error (the GIL is held).
inline void hold_current_error() {
  clear_signal_error();
  PyErr_Fetch(&g_signal_error.type, &g_signal_error.value, &g_signal_error.traceback);
}

// Sets the held error as Python's pending one (KeyboardInterrupt if none is held); the GIL is held.
inline void restore_held_error() {
  if (g_signal_error.type == nullptr) {
    PyErr_SetNone(PyExc_KeyboardInterrupt);
    return;
  }
  PyErr_Restore(std::exchange(g_signal_error.type, nullptr), std::exchange(g_signal_error.value, nullptr),
                std::exchange(g_signal_error.traceback, nullptr));
}

// Runs Python's signal handlers (the GIL is held): true, holding what they raised, to stop.
inline bool poll_signal_handlers() {
  if (PyErr_CheckSignals() == 0) return false;
  hold_current_error();
  return true;
}

// An Interrupt whose poll runs Python's signal handlers (so Ctrl-C stops native work); it must be
// checked only from the thread that called into the extension, with the GIL released. Made with
// the GIL held, at the start of a call.
inline Interrupt python_interrupt() {
  clear_signal_error();
  return Interrupt([] {
    py::gil_scoped_acquire gil;
    return poll_signal_handlers();
  });
}

// The UTF-8 of str arguments without asking Python for it: Python encodes with the GIL held (about
// a second per 100M non-ASCII characters, deaf to Ctrl-C) and keeps that copy inside the str for
// its lifetime. ASCII strs are read in place; the others are encoded together by encode().
class StrsUtf8 {
 public:
  StrsUtf8() = default;
  explicit StrsUtf8(const py::handle& text) { add(text); }
  // Takes text (a str; callers name a wrong type themselves) as number size(); the GIL is held.
  void add(const py::handle& text) {
    if (!PyUnicode_Check(text.ptr())) throw py::type_error("expected a str");
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(text.ptr()) < 0) throw py::error_already_set();
#endif
    texts_.push_back(py::reinterpret_borrow<py::object>(text));
    if (PyUnicode_IS_ASCII(text.ptr())) {
      encoded_idx_.push_back(-1);
    } else {
      encoded_idx_.push_back(static_cast<int64_t>(code_points_.size()));
      code_points_.push_back({PyUnicode_DATA(text.ptr()), static_cast<int>(PyUnicode_KIND(text.ptr())),
                              static_cast<size_t>(PyUnicode_GET_LENGTH(text.ptr()))});
    }
  }
  // Needs no GIL; lone surrogates come out in their 3-byte form ("surrogatepass").
  void encode(int num_threads, Interrupt* interrupt) {
    encoded_ = encode_utf8(code_points_, num_threads, interrupt);
    is_encoded_ = true;
  }

  size_t size() const { return texts_.size(); }
  bool is_ascii(size_t k) const { return encoded_idx_[k] < 0; }
  // Text k's UTF-8, once encoded.
  std::string_view operator[](size_t k) const {
    if (is_ascii(k)) {
      return {static_cast<const char*>(PyUnicode_DATA(texts_[k].ptr())), static_cast<size_t>(PyUnicode_GET_LENGTH(texts_[k].ptr()))};
    }
    check_encoded();
    const auto j = static_cast<size_t>(encoded_idx_[k]);
    return {encoded_.bytes.data() + encoded_.offsets[j], encoded_.offsets[j + 1] - encoded_.offsets[j]};
  }
  // Code point index of text k's first lone surrogate (-1: none), once encoded.
  int64_t first_surrogate_idx(size_t k) const {
    if (is_ascii(k)) return -1;
    check_encoded();
    return encoded_.first_surrogate_idx[static_cast<size_t>(encoded_idx_[k])];
  }

 private:
  void check_encoded() const {
    if (!is_encoded_) throw std::logic_error("StrsUtf8 read before encode()");
  }

  std::vector<py::object> texts_;    // keeps the code points alive while the GIL is released
  std::vector<int64_t> encoded_idx_;  // per text: its index in code_points_, -1 when ASCII
  std::vector<CodePoints> code_points_;
  EncodedUtf8 encoded_;
  bool is_encoded_ = false;
};

void register_checkpoint(py::module_& m);
void register_buckets(py::module_& m);
void register_pipeline(py::module_& m);
void register_eplb(py::module_& m);
void register_bpe_pretokenize(py::module_& m);
void register_bpe_train(py::module_& m);
void register_bpe_encode(py::module_& m);

}  // namespace trainfast::bindings

namespace pybind11::detail {

template <typename T>
struct type_caster<trainfast::bindings::Self<T>> {
  static constexpr auto name = make_caster<T>::name;
  bool load(handle src, bool /*convert*/) {
    value.value = trainfast::bindings::bound_value<T>(src);
    return value.value != nullptr;
  }
  template <typename>
  using cast_op_type = trainfast::bindings::Self<T>;
  operator trainfast::bindings::Self<T>() const { return value; }

 private:
  trainfast::bindings::Self<T> value;
};

}  // namespace pybind11::detail
