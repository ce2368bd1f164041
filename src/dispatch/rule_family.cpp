#include "dispatch/rule_family.h"

#include <c10/util/Exception.h>

#include <mutex>

namespace shardtensor::dispatch {

namespace {

struct Family {
  std::string label; // "conv (src/ops/conv.cpp)"
  void (*register_rules)();
};

// Built before any family announces itself (a function-local static), whatever the order of static construction
// across translation units; never destroyed, like the rule registry.
struct Families {
  std::mutex mutex;
  std::vector<Family> waiting; // announced before the installer ran
  std::vector<std::string> installed;
  bool installing = false;
};

Families& families() {
  static auto* f = new Families();
  return *f;
}

thread_local const std::string* running_family = nullptr;

// The path from the repository's src/ on (the build passes relative or absolute paths), so the label does not
// depend on where the library was built.
std::string short_path(const char* file) {
  std::string path(file);
  if (const auto at = path.rfind("/src/"); at != std::string::npos) return path.substr(at + 1);
  while (path.rfind("../", 0) == 0) path = path.substr(3);
  return path;
}

// Caller holds the mutex (families register one at a time, so a double registration names a stable pair).
void run_family(Families& f, Family& family) {
  running_family = &family.label;
  try {
    family.register_rules();
  } catch (...) {
    running_family = nullptr;
    throw;
  }
  running_family = nullptr;
  f.installed.push_back(family.label);
}

} // namespace

RuleFamily::RuleFamily(const char* name, const char* file, void (*register_rules)()) {
  auto& f = families();
  std::lock_guard<std::mutex> lock(f.mutex);
  Family family{std::string(name) + " (" + short_path(file) + ")", register_rules};
  if (!f.installing) {
    f.waiting.push_back(std::move(family));
    return;
  }
  run_family(f, family);
}

void install_rule_families() {
  auto& f = families();
  std::lock_guard<std::mutex> lock(f.mutex);
  TORCH_INTERNAL_ASSERT(!f.installing, "install_rule_families: the built-in rules are installed already");
  f.installing = true;
  for (auto& family : f.waiting) run_family(f, family);
  f.waiting.clear();
}

const std::string& registering_family() {
  static const std::string none;
  return running_family ? *running_family : none;
}

std::vector<std::string> installed_rule_families() {
  auto& f = families();
  std::lock_guard<std::mutex> lock(f.mutex);
  return f.installed;
}

} // namespace shardtensor::dispatch
