#include "comm/agreement.h"

#include "comm/collectives.h"

#include <c10/util/Exception.h>

namespace shardtensor::comm {

namespace {
constexpr uint64_t kMask = (uint64_t{1} << 62) - 1;

uint64_t mix(uint64_t h, uint64_t v) {
  // splitmix64 step: a well-spread digest; equal inputs give equal digests on every rank.
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebULL;
  return h ^ (h >> 31);
}
} // namespace

int64_t digest(const std::vector<int64_t>& values) {
  uint64_t h = values.size();
  for (auto v : values) h = mix(h, static_cast<uint64_t>(v));
  return static_cast<int64_t>(h & kMask);
}

int64_t digest(const std::string& text) {
  uint64_t h = text.size();
  for (unsigned char c : text) h = mix(h, c);
  return static_cast<int64_t>(h & kMask);
}

void check_agreement(const Mesh& mesh, const std::vector<AgreementField>& fields, const std::string& what) {
  // min over ranks of v and of -v gives both the minimum and the maximum of every field in one all-reduce.
  std::vector<int64_t> values;
  for (const auto& f : fields) values.push_back(f.value);
  for (const auto& f : fields) values.push_back(-f.value);
  auto reduced = all_reduce_min_ints(values, mesh);
  const auto n = fields.size();
  std::string names, shown;
  for (size_t i = 0; i < n; ++i) {
    if (reduced[i] == -reduced[n + i]) continue;
    names += (names.empty() ? "" : ", ") + fields[i].name;
    shown += (shown.empty() ? "" : "; ") + fields[i].name + ": " + fields[i].shown;
  }
  TORCH_CHECK_VALUE(names.empty(), what, ": ranks disagree on ", names, " (this rank: ", shown,
                    "). Every rank of the mesh must pass the same values.");
}

} // namespace shardtensor::comm
