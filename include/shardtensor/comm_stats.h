// A communication counter: every collective the library issues is counted here (calls and bytes sent),
// per collective kind. Users read it like torch's CommDebugMode to check what an op communicates.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace shardtensor {

struct CommStats {
  std::map<std::string, int64_t> calls;
  std::map<std::string, int64_t> bytes;
  int64_t total_calls() const;
  int64_t total_bytes() const;
};

CommStats comm_stats();
void reset_comm_stats();

} // namespace shardtensor
