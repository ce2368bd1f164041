#include "dispatch/consistency.h"

#include "comm/agreement.h"
#include "dispatch/args.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace shardtensor::dispatch {

namespace {

std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> flag{[] {
    const char* v = std::getenv("SHARDTENSOR_CHECK_CONSISTENCY");
    return v && *v && std::strcmp(v, "0") != 0;
  }()};
  return flag;
}

// Integers describing one argument (tensors: layout and dtype, not values).
void describe(const c10::IValue& v, std::vector<int64_t>& out) {
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    if (!t.defined()) {
      out.push_back(-1);
      return;
    }
    out.push_back(static_cast<int64_t>(t.scalar_type()));
    const auto sizes = t.sizes();
    out.insert(out.end(), sizes.begin(), sizes.end());
    if (auto* impl = shard_impl(t)) {
      out.push_back(comm::digest(to_string(impl->spec()->placements)));
      for (const auto& ext : impl->spec()->extents) out.insert(out.end(), ext.begin(), ext.end());
    } else {
      out.push_back(-2); // plain (Replicate)
    }
  } else if (v.isTensorList() || v.isList()) {
    const auto& items = v.toListRef();
    out.push_back(static_cast<int64_t>(items.size()));
    for (const auto& e : items) describe(e, out);
  } else if (v.isInt()) {
    out.push_back(v.toInt());
  } else if (v.isBool()) {
    out.push_back(v.toBool());
  } else if (v.isDouble()) {
    const double d = v.toDouble();
    int64_t bits;
    std::memcpy(&bits, &d, sizeof(bits));
    out.push_back(bits);
  } else if (v.isNone()) {
    out.push_back(-3);
  }
}

} // namespace

bool consistency_check_enabled() {
  return enabled_flag().load(std::memory_order_relaxed);
}

bool set_consistency_check(bool enabled) {
  return enabled_flag().exchange(enabled);
}

void check_op_consistency(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  if (!first_shard_arg(op, stack)) return;
  auto mesh = common_mesh(op, stack);
  std::vector<int64_t> layouts, others;
  std::ostringstream shown;
  for (const auto& v : op_args(op, stack)) {
    bool tensors = v.isTensor() || v.isTensorList() || (v.isList() && !v.toListRef().empty() && v.toListRef()[0].isTensor());
    describe(v, tensors ? layouts : others);
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (auto* impl = shard_impl(t)) shown << (shown.tellp() ? "; " : "") << impl->spec()->str() << " " << t.scalar_type();
    });
  }
  const auto name = qualified_name(op);
  comm::check_agreement(*mesh,
                        {{"op", comm::digest(name), name},
                         {"argument layouts", comm::digest(layouts), shown.str()},
                         {"non-tensor arguments", comm::digest(others), "(see the op's arguments)"}},
                        "ShardTensor consistency check (SHARDTENSOR_CHECK_CONSISTENCY) before " + name);
}

} // namespace shardtensor::dispatch
