#include <pybind11/pybind11.h>

#include "bindings/common.h"
#include "common/check.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "trainfast native core (private: use the trainfast package)";
  // std::invalid_argument already maps to ValueError; Interrupted is a signal handler's exception
  // (Ctrl-C's KeyboardInterrupt ...) seen by native code.
  pybind11::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const trainfast::Interrupted&) {
      trainfast::bindings::restore_held_error();
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
