// The precompiled header of the library's translation units (CMake target_precompile_headers). Parsing torch's
// headers is most of every unit's compile time (ATen/ATen.h alone is ~200k lines after preprocessing); compiling
// them once per target instead of once per unit is what keeps a first build within minutes on 2 cores. Only
// headers from outside the project belong here: a project header in the PCH would rebuild every unit on each edit.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>
