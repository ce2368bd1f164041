#include <shardtensor/placement.h>

#include <c10/util/Exception.h>

namespace shardtensor {

std::string to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

ReduceOp reduce_op_from_string(const std::string& name) {
  if (name == "sum") return ReduceOp::Sum;
  if (name == "avg" || name == "mean") return ReduceOp::Avg;
  if (name == "max") return ReduceOp::Max;
  if (name == "min") return ReduceOp::Min;
  TORCH_CHECK_VALUE(false, "Partial: unknown reduce op '", name, "'; expected sum, avg, max or min");
}

std::string Placement::str() const {
  switch (kind) {
    case Kind::Replicate: return "Replicate()";
    case Kind::Shard: return "Shard(" + std::to_string(dim) + ")";
    case Kind::Partial: return "Partial(" + to_string(op) + ")";
  }
  return "?";
}

std::string to_string(const Placements& placements) {
  std::string s = "(";
  for (size_t i = 0; i < placements.size(); ++i) {
    if (i) s += ", ";
    s += placements[i].str();
  }
  return s + ")";
}

} // namespace shardtensor
