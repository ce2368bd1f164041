// Placements: how a tensor is laid out along one mesh dimension.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardtensor {

// The pending reduction of a Partial placement.
enum class ReduceOp : uint8_t { Sum, Avg, Max, Min };

std::string to_string(ReduceOp op);
ReduceOp reduce_op_from_string(const std::string& name);

struct Placement {
  enum class Kind : uint8_t { Replicate, Shard, Partial };

  Kind kind = Kind::Replicate;
  int64_t dim = -1;            // tensor dim, for Shard only
  ReduceOp op = ReduceOp::Sum; // for Partial only

  static Placement shard(int64_t d) { return {Kind::Shard, d, ReduceOp::Sum}; }
  static Placement replicate() { return {Kind::Replicate, -1, ReduceOp::Sum}; }
  static Placement partial(ReduceOp o = ReduceOp::Sum) { return {Kind::Partial, -1, o}; }

  bool is_shard() const { return kind == Kind::Shard; }
  bool is_shard(int64_t d) const { return kind == Kind::Shard && dim == d; }
  bool is_replicate() const { return kind == Kind::Replicate; }
  bool is_partial() const { return kind == Kind::Partial; }

  bool operator==(const Placement& o) const {
    return kind == o.kind && (kind != Kind::Shard || dim == o.dim) &&
        (kind != Kind::Partial || op == o.op);
  }
  bool operator!=(const Placement& o) const { return !(*this == o); }

  std::string str() const;
};

using Placements = std::vector<Placement>;

std::string to_string(const Placements& placements);

} // namespace shardtensor
