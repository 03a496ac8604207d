#include "tally/protocol/dtype.h"

#include <algorithm>

namespace tally {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat64:
      return 8;
    case DType::kFloat16:
      return 2;
    case DType::kBFloat16:
      return 2;
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float";
    case DType::kFloat64:
      return "double";
    case DType::kFloat16:
      return "half";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
  }
  return "unknown";
}

std::optional<DType> parse_dtype(std::string_view name) {
  for (DType d : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                  DType::kInt32, DType::kInt64}) {
    if (dtype_name(d) == name) return d;
  }
  if (name == "float32" || name == "f32") return DType::kFloat32;
  if (name == "float64" || name == "f64") return DType::kFloat64;
  return std::nullopt;
}

std::string_view redop_name(RedOp op) {
  switch (op) {
    case RedOp::kSum:
      return "sum";
    case RedOp::kAverage:
      return "avg";
  }
  return "unknown";
}

std::optional<RedOp> parse_redop(std::string_view name) {
  if (name == "sum") return RedOp::kSum;
  if (name == "avg" || name == "average") return RedOp::kAverage;
  return std::nullopt;
}

bool is_known_dtype(uint8_t raw) { return raw >= 1 && raw <= 6; }
bool is_known_redop(uint8_t raw) { return raw >= 1 && raw <= 2; }

}  // namespace tally
