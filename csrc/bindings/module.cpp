#include <cerrno>

#include <pybind11/pybind11.h>

#include "bindings/common.h"
#include "common/check.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "trainfast native core (private: use the trainfast package)";
  // The one place C++ exceptions become Python ones (pybind11 itself maps std::invalid_argument to
  // ValueError): Interrupted is a signal handler's exception (Ctrl-C's KeyboardInterrupt ...) seen
  // by native code; a FileError is an OSError carrying errno and the path.
  pybind11::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const trainfast::Interrupted&) {
      trainfast::bindings::restore_held_error();
    } catch (const trainfast::FileError& e) {
      errno = e.error_number();
      PyErr_SetFromErrnoWithFilename(PyExc_OSError, e.path().c_str());
    }
  });
  trainfast::bindings::register_checkpoint(m);
  trainfast::bindings::register_buckets(m);
  trainfast::bindings::register_pipeline(m);
  trainfast::bindings::register_eplb(m);
  // bpe_train defines BpeWordTable, which bpe_pretokenize's signatures name: registered first.
  trainfast::bindings::register_bpe_train(m);
  trainfast::bindings::register_bpe_pretokenize(m);
  trainfast::bindings::register_bpe_encode(m);
}
