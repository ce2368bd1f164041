#include <shardtensor/spec.h>

#include <c10/util/Exception.h>

#include <numeric>
#include <sstream>

namespace shardtensor {

std::vector<int64_t> default_split(int64_t n, int64_t k) {
  TORCH_INTERNAL_ASSERT(k > 0 && n >= 0);
  std::vector<int64_t> sizes(k, n / k);
  for (int64_t i = 0; i < n % k; ++i) sizes[i] += 1;
  return sizes;
}

SpecPtr ShardSpec::make(MeshPtr mesh, Placements placements, std::vector<int64_t> global_shape,
                        const ShardingShapes& sharding_shapes) {
  TORCH_CHECK_VALUE(mesh, "ShardSpec: mesh is null");
  TORCH_CHECK_VALUE(static_cast<int64_t>(placements.size()) == mesh->ndim(), "ShardSpec: got ",
                    placements.size(), " placements ", to_string(placements), " for a ", mesh->ndim(),
                    "-d mesh; give one placement per mesh dim");
  auto spec = std::make_shared<ShardSpec>();
  const auto ndim = static_cast<int64_t>(global_shape.size());
  spec->extents.resize(placements.size());
  std::vector<int64_t> sharded_by(ndim, -1);
  for (int64_t m = 0; m < mesh->ndim(); ++m) {
    auto& p = placements[m];
    if (!p.is_shard()) {
      TORCH_CHECK_VALUE(!sharding_shapes.count(m), "ShardSpec: sharding shapes given for mesh dim ", m,
                        " whose placement is ", p.str());
      continue;
    }
    if (p.dim < 0) p.dim += ndim;
    TORCH_CHECK_VALUE(p.dim >= 0 && p.dim < ndim, "ShardSpec: Shard(", p.dim, ") on mesh dim ", m,
                      " is out of range for a ", ndim, "-d tensor");
    TORCH_CHECK_NOT_IMPLEMENTED(sharded_by[p.dim] < 0, "ShardSpec: tensor dim ", p.dim,
                                " is sharded on mesh dims ", sharded_by[p.dim], " and ", m, " ",
                                to_string(placements),
                                "; sharding one tensor dim over several mesh dims is not supported, "
                                "shard another dim or flatten the mesh");
    sharded_by[p.dim] = m;
    auto it = sharding_shapes.find(m);
    if (it == sharding_shapes.end()) {
      spec->extents[m] = default_split(global_shape[p.dim], mesh->size(m));
    } else {
      const auto& e = it->second;
      TORCH_CHECK_VALUE(static_cast<int64_t>(e.size()) == mesh->size(m), "ShardSpec: mesh dim ", m,
                        " has ", mesh->size(m), " ranks but ", e.size(), " extents were given");
      int64_t total = 0;
      for (auto v : e) {
        TORCH_CHECK_VALUE(v >= 0, "ShardSpec: negative extent ", v, " on mesh dim ", m);
        total += v;
      }
      TORCH_CHECK_VALUE(total == global_shape[p.dim], "ShardSpec: extents on mesh dim ", m, " add up to ",
                        total, " but tensor dim ", p.dim, " has global size ", global_shape[p.dim]);
      spec->extents[m] = e;
    }
  }
  for (const auto& [m, e] : sharding_shapes) {
    TORCH_CHECK_VALUE(m >= 0 && m < mesh->ndim(), "ShardSpec: sharding shapes for mesh dim ", m,
                      " of a ", mesh->ndim(), "-d mesh");
  }
  spec->local_shape = global_shape;
  for (int64_t m = 0; m < mesh->ndim(); ++m) {
    if (placements[m].is_shard()) spec->local_shape[placements[m].dim] = spec->extents[m][mesh->coordinate(m)];
  }
  spec->mesh = std::move(mesh);
  spec->placements = std::move(placements);
  spec->global_shape = std::move(global_shape);
  return spec;
}

SpecPtr ShardSpec::make_with_dim_extents(MeshPtr mesh, Placements placements, std::vector<int64_t> global_shape,
                                         const std::map<int64_t, std::vector<int64_t>>& extents_by_tensor_dim) {
  ShardingShapes shapes;
  const auto ndim = static_cast<int64_t>(global_shape.size());
  for (size_t m = 0; m < placements.size(); ++m) {
    if (!placements[m].is_shard()) continue;
    auto d = placements[m].dim < 0 ? placements[m].dim + ndim : placements[m].dim;
    auto it = extents_by_tensor_dim.find(d);
    if (it != extents_by_tensor_dim.end() && static_cast<int64_t>(it->second.size()) == mesh->size(m)) {
      shapes[static_cast<int64_t>(m)] = it->second;
    }
  }
  return make(std::move(mesh), std::move(placements), std::move(global_shape), shapes);
}

int64_t ShardSpec::mesh_dim_of(int64_t tensor_dim) const {
  for (size_t m = 0; m < placements.size(); ++m)
    if (placements[m].is_shard(tensor_dim)) return static_cast<int64_t>(m);
  return -1;
}

int64_t ShardSpec::offset_of(int64_t mesh_dim, int64_t coord) const {
  const auto& e = extents[mesh_dim];
  return std::accumulate(e.begin(), e.begin() + coord, int64_t{0});
}

int64_t ShardSpec::local_offset(int64_t tensor_dim) const {
  auto m = mesh_dim_of(tensor_dim);
  return m < 0 ? 0 : offset_of(m, mesh->coordinate(m));
}

bool ShardSpec::has_partial() const {
  for (const auto& p : placements)
    if (p.is_partial()) return true;
  return false;
}

bool ShardSpec::has_shard() const {
  for (const auto& p : placements)
    if (p.is_shard()) return true;
  return false;
}

bool ShardSpec::all_replicate() const {
  for (const auto& p : placements)
    if (!p.is_replicate()) return false;
  return true;
}

std::map<int64_t, std::vector<int64_t>> ShardSpec::dim_extents() const {
  std::map<int64_t, std::vector<int64_t>> out;
  for (size_t m = 0; m < placements.size(); ++m)
    if (placements[m].is_shard()) out[placements[m].dim] = extents[m];
  return out;
}

ShardingShapes ShardSpec::sharding_shapes() const {
  ShardingShapes out;
  for (size_t m = 0; m < placements.size(); ++m)
    if (placements[m].is_shard()) out[static_cast<int64_t>(m)] = extents[m];
  return out;
}

bool ShardSpec::same_layout(const ShardSpec& other) const {
  return this == &other ||
      (mesh->same_as(*other.mesh) && placements == other.placements && global_shape == other.global_shape &&
       extents == other.extents);
}

std::string ShardSpec::str() const {
  std::ostringstream os;
  os << "placements=" << to_string(placements) << ", global_shape=[";
  for (size_t i = 0; i < global_shape.size(); ++i) os << (i ? ", " : "") << global_shape[i];
  os << "], local_shape=[";
  for (size_t i = 0; i < local_shape.size(); ++i) os << (i ? ", " : "") << local_shape[i];
  os << "]";
  for (size_t m = 0; m < extents.size(); ++m) {
    if (extents[m].empty()) continue;
    os << ", extents[mesh dim " << m << "]=[";
    for (size_t i = 0; i < extents[m].size(); ++i) os << (i ? ", " : "") << extents[m][i];
    os << "]";
  }
  os << ", " << mesh->str();
  return os.str();
}

} // namespace shardtensor
