#include <shardtensor/mesh.h>
#include <shardtensor/simulation.h>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <numeric>

namespace shardtensor {

namespace {
std::atomic<uint64_t> next_mesh_id{1};
}

Mesh::Mesh(std::vector<int64_t> shape,
           std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups,
           std::vector<int64_t> coordinate,
           std::vector<std::string> dim_names,
           c10::DeviceType device_type,
           std::vector<int64_t> ranks)
    : shape_(std::move(shape)),
      groups_(std::move(groups)),
      coordinate_(std::move(coordinate)),
      dim_names_(std::move(dim_names)),
      device_type_(device_type),
      ranks_(std::move(ranks)),
      id_(next_mesh_id++),
      simulation_(simulation_epoch()) {
  TORCH_CHECK_VALUE(!shape_.empty(), "Mesh: a mesh needs at least one dimension");
  TORCH_CHECK_VALUE(groups_.size() == shape_.size() && coordinate_.size() == shape_.size(),
                    "Mesh: expected one process group and one coordinate per mesh dim (", shape_.size(),
                    "), got ", groups_.size(), " groups and ", coordinate_.size(), " coordinates");
  if (dim_names_.empty()) {
    for (size_t i = 0; i < shape_.size(); ++i) dim_names_.push_back("dim" + std::to_string(i));
  }
  TORCH_CHECK_VALUE(dim_names_.size() == shape_.size(), "Mesh: expected ", shape_.size(), " dim names");
  for (size_t i = 0; i < shape_.size(); ++i) {
    TORCH_CHECK_VALUE(groups_[i], "Mesh: process group of mesh dim ", i, " is null");
    TORCH_CHECK_VALUE(groups_[i]->getSize() == shape_[i], "Mesh: process group of mesh dim ", i, " has ",
                      groups_[i]->getSize(), " ranks but the mesh dim has size ", shape_[i]);
    TORCH_CHECK_VALUE(groups_[i]->getRank() == coordinate_[i], "Mesh: this rank's coordinate on mesh dim ",
                      i, " is ", coordinate_[i], " but its rank in that dim's group is ",
                      groups_[i]->getRank());
  }
  if (!ranks_.empty()) {
    TORCH_CHECK_VALUE(static_cast<int64_t>(ranks_.size()) == numel(), "Mesh: ", ranks_.size(),
                      " ranks given for a mesh of ", numel(), " ranks");
  }
}

std::shared_ptr<const Mesh> Mesh::from_group_names(std::vector<int64_t> shape,
                                                   const std::vector<std::string>& group_names,
                                                   std::vector<int64_t> coordinate,
                                                   std::vector<std::string> dim_names,
                                                   c10::DeviceType device_type,
                                                   std::vector<int64_t> ranks) {
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups;
  groups.reserve(group_names.size());
  for (const auto& name : group_names) groups.push_back(c10d::resolve_process_group(name));
  return std::make_shared<const Mesh>(std::move(shape), std::move(groups), std::move(coordinate),
                                      std::move(dim_names), device_type, std::move(ranks));
}

std::shared_ptr<const Mesh> Mesh::from_group(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                             c10::DeviceType device_type, const std::string& dim_name) {
  TORCH_CHECK_VALUE(group, "Mesh::from_group: null process group");
  return std::make_shared<const Mesh>(std::vector<int64_t>{group->getSize()},
                                      std::vector<c10::intrusive_ptr<c10d::ProcessGroup>>{group},
                                      std::vector<int64_t>{group->getRank()},
                                      std::vector<std::string>{dim_name}, device_type);
}

int64_t Mesh::numel() const {
  return std::accumulate(shape_.begin(), shape_.end(), int64_t{1}, std::multiplies<>());
}

const c10::intrusive_ptr<c10d::ProcessGroup>& Mesh::group(int64_t mesh_dim) const {
  TORCH_CHECK_VALUE(mesh_dim >= 0 && mesh_dim < ndim(), "Mesh: mesh dim ", mesh_dim,
                    " out of range for a ", ndim(), "-d mesh");
  return groups_[mesh_dim];
}

int64_t Mesh::dim_index(const std::string& name) const {
  for (size_t i = 0; i < dim_names_.size(); ++i)
    if (dim_names_[i] == name) return static_cast<int64_t>(i);
  return -1;
}

std::vector<int64_t> Mesh::coordinate_of(int64_t global_rank) const {
  // A mesh built from process groups alone knows no global ranks: ranks are then its row-major positions.
  int64_t flat = -1;
  if (ranks_.empty()) {
    if (global_rank >= 0 && global_rank < numel()) flat = global_rank;
  } else {
    for (size_t i = 0; i < ranks_.size(); ++i)
      if (ranks_[i] == global_rank) flat = static_cast<int64_t>(i);
  }
  if (flat < 0) return {};
  std::vector<int64_t> coord(shape_.size());
  for (int64_t d = ndim() - 1; d >= 0; --d) {
    coord[d] = flat % shape_[d];
    flat /= shape_[d];
  }
  return coord;
}

bool Mesh::same_as(const Mesh& other) const {
  if (this == &other || id_ == other.id_) return true;
  if (shape_ != other.shape_ || coordinate_ != other.coordinate_) return false;
  for (size_t i = 0; i < groups_.size(); ++i)
    if (groups_[i].get() != other.groups_[i].get()) return false;
  return true;
}

std::string Mesh::str() const {
  std::string s = "Mesh(";
  for (size_t i = 0; i < shape_.size(); ++i) {
    if (i) s += ", ";
    s += dim_names_[i] + "=" + std::to_string(shape_[i]);
  }
  s += "; coordinate=(";
  for (size_t i = 0; i < coordinate_.size(); ++i) s += (i ? "," : "") + std::to_string(coordinate_[i]);
  return s + "))";
}

} // namespace shardtensor
