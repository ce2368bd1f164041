// Built-in rule families: each file of src/ops registers its own rules, with no central list to keep in order.
//
//   SHARDTENSOR_RULE_FAMILY(conv) {
//     dispatch::set_handler("aten::convolution", typed_handler(&convolution_rule));
//   }
//
// defines the family's registration function and a static object that announces it when the library loads. The
// announcements are constructed before the library's other static objects (init_priority: static objects of
// different translation units are otherwise constructed in an unspecified order, in practice the link order, which
// puts src/library.cpp first), so the library's installer (src/library.cpp) finds every family announced, and runs
// them before it binds the remaining ops below autograd: the registry is complete before the library finishes
// loading, in Python (`import shardtensor`) and in a C++ program that links it. A family announced after the
// installer ran (a test's) registers at once.
//
// Each op has at most one built-in rule: a family that registers a rule (or an autograd rule) for an op another
// family already has raises, naming the op and both families, so the families' order cannot matter. Users replace
// built-in rules deliberately through `register_handler` (include/shardtensor/handler_registry.h).
#pragma once

#include <string>
#include <vector>

namespace shardtensor::dispatch {

struct RuleFamily {
  // `file` (the defining file, __FILE__) appears in the double-registration error.
  RuleFamily(const char* name, const char* file, void (*register_rules)());
};

// Runs the families announced so far; from then on a family registers as it is announced. Called once, by the
// library's installer.
void install_rule_families();

// The family whose registration function runs on this thread ("name (file)"), or empty: a user's registration.
const std::string& registering_family();

// The families installed so far, in installation order.
std::vector<std::string> installed_rule_families();

} // namespace shardtensor::dispatch

// 101-65535 run in increasing order, all before objects without a priority (GCC and Clang).
#define SHARDTENSOR_RULE_FAMILY_PRIORITY __attribute__((init_priority(1000)))

#define SHARDTENSOR_RULE_FAMILY(family)                                                                       \
  static void register_##family##_rules();                                                                  \
  static const ::shardtensor::dispatch::RuleFamily family##_rule_family SHARDTENSOR_RULE_FAMILY_PRIORITY(     \
      #family, __FILE__, &register_##family##_rules);                                                       \
  static void register_##family##_rules()
