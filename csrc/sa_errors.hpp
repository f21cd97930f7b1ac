// Errors the core throws besides std::invalid_argument (which the bindings map to ValueError).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace sa {

// A request id that is not live; the bindings map it to KeyError.
struct UnknownRequest : std::out_of_range {
  explicit UnknownRequest(int64_t id)
      : std::out_of_range("unknown request id " + std::to_string(id)) {}
};

}  // namespace sa
