// What both Python bindings ask of an array's byte order.
#pragma once

#include <pybind11/numpy.h>

// The array's elements are in this machine's byte order ('=' native, '|' bytes have none).
inline bool native_byte_order(const pybind11::array& arr) {
  const char order = arr.dtype().byteorder(), native = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ ? '<' : '>';
  return order == '=' || order == '|' || order == native;
}
