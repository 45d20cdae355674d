#pragma once
#include <stdexcept>
#include <string>

namespace mixkv {

// Typed errors of the public API. Every message names the offending argument
// and the value that was expected. The Python bindings map them to
// ValueError, MemoryError, KeyError and IndexError.

// A malformed argument: wrong shape, size, precision, plan length, NaN input...
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A pool (or the arena behind it) cannot provide the blocks a call needs.
class OutOfMemory : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An unknown sequence or request id. (Adding an id that is already present
// is an InvalidArgument.)
class UnknownId : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

// An index (layer, window, head, block id) outside its range.
class IndexOutOfRange : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

// check_invariants() found the cache's bookkeeping inconsistent: a bug.
class InvariantViolation : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

// A CUDA runtime or cuBLAS call failed.
class DeviceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace mixkv
