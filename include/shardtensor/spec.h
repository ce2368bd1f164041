// ShardSpec: the immutable description of how a global tensor is laid out over a mesh.
#pragma once

#include <shardtensor/mesh.h>
#include <shardtensor/placement.h>

#include <c10/util/ArrayRef.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace shardtensor {

// Per sharded mesh dim: the extent of the sharded tensor dim on every coordinate along that mesh dim.
using ShardingShapes = std::map<int64_t, std::vector<int64_t>>;

// The default split rule everywhere: torch.tensor_split sizes (the first n % k parts get one more).
std::vector<int64_t> default_split(int64_t n, int64_t k);

struct ShardSpec;
using SpecPtr = std::shared_ptr<const ShardSpec>;

struct ShardSpec {
  MeshPtr mesh;
  Placements placements;             // one per mesh dim
  std::vector<int64_t> global_shape;
  // extents[mesh_dim] is empty unless placements[mesh_dim] is Shard(d); then it holds the extent of tensor
  // dim d on each coordinate along mesh_dim.
  std::vector<std::vector<int64_t>> extents;
  std::vector<int64_t> local_shape;  // derived

  // Validates everything (TORCH_CHECK_VALUE on bad input). Missing extents use default_split.
  static SpecPtr make(MeshPtr mesh, Placements placements, std::vector<int64_t> global_shape,
                      const ShardingShapes& sharding_shapes = {});
  // Same mesh, new placements/shape; extents for sharded dims taken from `extents_by_tensor_dim` when
  // given there (keyed by tensor dim), else the default split.
  static SpecPtr make_with_dim_extents(MeshPtr mesh, Placements placements,
                                       std::vector<int64_t> global_shape,
                                       const std::map<int64_t, std::vector<int64_t>>& extents_by_tensor_dim);

  int64_t ndim() const { return static_cast<int64_t>(global_shape.size()); }
  // The mesh dim that shards tensor dim `d`, or -1.
  int64_t mesh_dim_of(int64_t tensor_dim) const;
  // Global index of this rank's first element along tensor dim `d`.
  int64_t local_offset(int64_t tensor_dim) const;
  // Offset of coordinate `coord` along a sharded mesh dim.
  int64_t offset_of(int64_t mesh_dim, int64_t coord) const;
  bool has_partial() const;
  bool has_shard() const;
  bool all_replicate() const;
  // Extents keyed by tensor dim (for building derived specs).
  std::map<int64_t, std::vector<int64_t>> dim_extents() const;
  ShardingShapes sharding_shapes() const;
  // True when both specs describe the same layout (mesh, placements, shape, extents).
  bool same_layout(const ShardSpec& other) const;
  std::string str() const;
};

} // namespace shardtensor
