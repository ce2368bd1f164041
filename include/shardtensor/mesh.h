// Mesh: an N-d grid of ranks, one c10d process group per mesh dimension.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace shardtensor {

class Mesh {
 public:
  // `groups[d]` is the process group of the line along mesh dim `d` that holds this rank; its group rank
  // must equal `coordinate[d]`. `ranks` is the flattened (row-major) grid of global ranks.
  Mesh(std::vector<int64_t> shape,
       std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups,
       std::vector<int64_t> coordinate,
       std::vector<std::string> dim_names,
       c10::DeviceType device_type,
       std::vector<int64_t> ranks = {});

  // Resolve groups registered in c10d by name (what a torch DeviceMesh holds).
  static std::shared_ptr<const Mesh> from_group_names(
      std::vector<int64_t> shape,
      const std::vector<std::string>& group_names,
      std::vector<int64_t> coordinate,
      std::vector<std::string> dim_names,
      c10::DeviceType device_type,
      std::vector<int64_t> ranks = {});

  // A 1-D mesh over one process group.
  static std::shared_ptr<const Mesh> from_group(
      const c10::intrusive_ptr<c10d::ProcessGroup>& group,
      c10::DeviceType device_type,
      const std::string& dim_name = "domain");

  int64_t ndim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t mesh_dim) const { return shape_.at(mesh_dim); }
  int64_t numel() const;
  int64_t coordinate(int64_t mesh_dim) const { return coordinate_.at(mesh_dim); }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& coordinates() const { return coordinate_; }
  const std::vector<std::string>& dim_names() const { return dim_names_; }
  const std::vector<int64_t>& ranks() const { return ranks_; }
  c10::DeviceType device_type() const { return device_type_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& group(int64_t mesh_dim) const;
  // Index of a mesh dim by name, or -1.
  int64_t dim_index(const std::string& name) const;
  // Coordinate of a global rank, or empty if not in the mesh. Without `ranks` (a mesh built from process groups
  // only) a rank is its row-major position in the mesh.
  std::vector<int64_t> coordinate_of(int64_t global_rank) const;
  uint64_t id() const { return id_; }
  // The simulation this mesh was built in (shardtensor/simulation.h), 0 for a real one.
  uint64_t simulation() const { return simulation_; }

  // Same ranks, same groups, same layout.
  bool same_as(const Mesh& other) const;
  std::string str() const;

 private:
  std::vector<int64_t> shape_;
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups_;
  std::vector<int64_t> coordinate_;
  std::vector<std::string> dim_names_;
  c10::DeviceType device_type_;
  std::vector<int64_t> ranks_;
  uint64_t id_;
  uint64_t simulation_;
};

using MeshPtr = std::shared_ptr<const Mesh>;

} // namespace shardtensor
