// Do all ranks of a mesh agree on a few values (dtype, placements, shapes, ...)? One small fixed-size all-reduce per
// mesh dim answers it on every rank, so a disagreement raises the same ValueError everywhere instead of a wrong
// number or a hang in a later, mismatched collective.
#pragma once

#include <shardtensor/mesh.h>

#include <string>
#include <vector>

namespace shardtensor::comm {

struct AgreementField {
  std::string name;  // "dtype", "placements", ...
  int64_t value;     // a digest (see digest below); only equality matters
  std::string shown; // this rank's value, for the message
};

// Raises c10::ValueError on every rank of `mesh` when some rank's values differ: "<what>: ranks disagree on
// <names> (this rank: ...)". Collective: every rank of the mesh calls it with the same number of fields.
void check_agreement(const Mesh& mesh, const std::vector<AgreementField>& fields, const std::string& what);

// A digest of integers, in [0, 2^62).
int64_t digest(const std::vector<int64_t>& values);
int64_t digest(const std::string& text);

} // namespace shardtensor::comm
