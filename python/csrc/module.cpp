// shardtensor._C: the pybind11 bindings (torch's bundled pybind11; tensors cross via torch's caster).
#include <shardtensor/attention.h>
#include <shardtensor/comm_backend.h>
#include <shardtensor/comm_stats.h>
#include <shardtensor/fallback.h>
#include <shardtensor/handler_registry.h>
#include <shardtensor/memory_tracker.h>
#include <shardtensor/replication.h>
#include <shardtensor/ring.h>
#include <shardtensor/shard_tensor.h>
#include <shardtensor/simulation.h>

#include "comm/comm_timing.h"
#include "comm/functional.h"
#include "comm/halo_plan.h"
#include "comm/peer_exchange_fn.h"
#include "comm/shm_transport.h"
#include "comm/wait.h"
#include "dispatch/consistency.h"
#include "dispatch/grad_buckets.h"
#include "dispatch/promote.h"
#include "dispatch/registry.h"

#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/python.h>

namespace py = pybind11;
using namespace shardtensor;

namespace {

// Placements cross as (kind, dim, op) tuples: kind 0 Replicate, 1 Shard, 2 Partial.
Placements to_placements(const std::vector<std::tuple<int, int64_t, std::string>>& items) {
  Placements out;
  for (const auto& [kind, dim, op] : items) {
    switch (kind) {
      case 0: out.push_back(Placement::replicate()); break;
      case 1: out.push_back(Placement::shard(dim)); break;
      case 2: out.push_back(Placement::partial(reduce_op_from_string(op))); break;
      default: TORCH_CHECK_VALUE(false, "unknown placement kind ", kind);
    }
  }
  return out;
}

std::vector<std::tuple<int, int64_t, std::string>> from_placements(const Placements& p) {
  std::vector<std::tuple<int, int64_t, std::string>> out;
  for (const auto& x : p) {
    out.emplace_back(x.is_replicate() ? 0 : x.is_shard() ? 1 : 2, x.is_shard() ? x.dim : -1,
                     x.is_partial() ? to_string(x.op) : "");
  }
  return out;
}

// A collective that failed inside an API call (a peer died or raised first, a timeout) names the call and the
// layout it worked on.
template <typename F, typename L>
auto with_context(const char* what, L&& layout, F&& f) {
  try {
    return f();
  } catch (const c10::DistBackendError& e) {
    const std::string where = layout();
    C10_THROW_ERROR(DistBackendError, std::string(e.what_without_backtrace()) + "\n  while running shardtensor." +
                                          what + (where.empty() ? "" : " on " + where));
  }
}

std::string layout_of(const at::Tensor& t) {
  auto* impl = shard_impl(t);
  return impl ? impl->spec()->str() : "";
}

// "file:line in function" of the innermost Python frame of this thread outside the shardtensor package (the user's
// call), for error messages; takes the GIL.
std::string python_location() {
  if (!Py_IsInitialized()) return "";
  py::gil_scoped_acquire gil;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  std::string out;
  while (frame && out.empty()) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    const char* file = PyUnicode_AsUTF8(code->co_filename);
    const char* name = PyUnicode_AsUTF8(code->co_name);
    if (file && std::string(file).find("/shardtensor/") == std::string::npos)
      out = std::string(file) + ":" + std::to_string(PyFrame_GetLineNumber(frame)) + " in " + (name ? name : "?");
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  if (PyErr_Occurred()) PyErr_Clear();
  return out;
}

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ShardTensor C++ core";

  // Collectives wait without the GIL (see comm/wait.h): ops reached from Python's indexing still hold it.
  comm::set_python_location_hook(&python_location);
  comm::set_gil_hooks({[]() -> void* { return Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr; },
                       [](void* state) { PyEval_RestoreThread(static_cast<PyThreadState*>(state)); }});

  py::class_<Mesh, std::shared_ptr<Mesh>>(m, "Mesh")
      .def_static(
          "from_group_names",
          [](std::vector<int64_t> shape, std::vector<std::string> names, std::vector<int64_t> coordinate,
             std::vector<std::string> dim_names, const std::string& device_type, std::vector<int64_t> ranks) {
            auto mesh = Mesh::from_group_names(std::move(shape), names, std::move(coordinate), std::move(dim_names),
                                               c10::Device(device_type).type(), std::move(ranks));
            return std::const_pointer_cast<Mesh>(mesh);
          })
      .def_property_readonly("shape", &Mesh::shape)
      .def_property_readonly("coordinate", &Mesh::coordinates)
      .def_property_readonly("dim_names", &Mesh::dim_names)
      .def_property_readonly("ranks", &Mesh::ranks)
      .def_property_readonly("id", &Mesh::id)
      .def_property_readonly("device_type", [](const Mesh& self) { return c10::DeviceTypeName(self.device_type(), true); })
      .def_property_readonly("group_names", [](const Mesh& self) {
        std::vector<std::string> names;
        for (int64_t d = 0; d < self.ndim(); ++d) names.push_back(self.group(d)->getGroupName());
        return names;
      })
      .def("same_as", [](const Mesh& self, const Mesh& other) { return self.same_as(other); })
      .def("__repr__", &Mesh::str);

  m.def("is_shard_tensor", &is_shard_tensor);
  m.def("placements", [](const at::Tensor& t) {
    return from_placements(checked_shard_impl(t, "placements").spec()->placements);
  });
  m.def("mesh_of", [](const at::Tensor& t) {
    return std::const_pointer_cast<Mesh>(checked_shard_impl(t, "device_mesh").spec()->mesh);
  });
  m.def("sharding_shapes", [](const at::Tensor& t) { return checked_shard_impl(t, "sharding_shapes").spec()->sharding_shapes(); });
  m.def("local_shape", [](const at::Tensor& t) { return checked_shard_impl(t, "local_shape").spec()->local_shape; });
  m.def("local_offsets", [](const at::Tensor& t) {
    auto& spec = *checked_shard_impl(t, "offsets").spec();
    std::vector<int64_t> out;
    for (int64_t d = 0; d < spec.ndim(); ++d) out.push_back(spec.local_offset(d));
    return out;
  });
  m.def("shard_repr", &shard_repr);

  m.def(
      "from_local",
      [](const at::Tensor& local, const std::shared_ptr<Mesh>& mesh,
         const std::vector<std::tuple<int, int64_t, std::string>>& placements, const std::string& mode,
         const ShardingShapes& shapes, std::optional<std::vector<int64_t>> global_shape, bool check) {
        auto inference = mode == "infer" ? ShapeInference::Infer : mode == "even" ? ShapeInference::Even
                                                                                  : ShapeInference::Explicit;
        auto pl = to_placements(placements);
        return with_context("from_local", [&] { return to_string(pl) + (mesh ? " on " + mesh->str() : ""); }, [&] {
          return from_local(local, mesh, pl, inference, shapes, std::move(global_shape), check);
        });
      },
      py::arg("local"), py::arg("mesh"), py::arg("placements"), py::arg("mode"), py::arg("sharding_shapes"),
      py::arg("global_shape"), py::arg("check") = true, py::call_guard<py::gil_scoped_release>());
  m.def("to_local", &to_local, py::call_guard<py::gil_scoped_release>());
  // Raw wrapping for the traced representation (python/shardtensor/_traced.py): no autograd, no communication, no
  // agreement check; the layout is the one a traced tensor carries.
  m.def("_wrap_local", [](const at::Tensor& local, const std::shared_ptr<Mesh>& mesh,
                          const std::vector<std::tuple<int, int64_t, std::string>>& placements,
                          const ShardingShapes& shapes, std::vector<int64_t> global_shape) {
    return make_shard_tensor(local, ShardSpec::make(mesh, to_placements(placements), std::move(global_shape), shapes));
  });
  m.def("_local_of", [](const at::Tensor& t) { return checked_shard_impl(t, "_local_of").local(); });
  m.def("full_tensor", [](const at::Tensor& t) { return with_context("full_tensor", [&] { return layout_of(t); }, [&] { return full_tensor(t); }); },
        py::call_guard<py::gil_scoped_release>());
  m.def("redistribute", [](const at::Tensor& t, const std::vector<std::tuple<int, int64_t, std::string>>& p,
                           const ShardingShapes& shapes) {
    return with_context("redistribute", [&] { return layout_of(t) + " to " + to_string(to_placements(p)); },
                        [&] { return redistribute(t, to_placements(p), shapes); });
  },
        py::call_guard<py::gil_scoped_release>());
  m.def("distribute_tensor", [](const at::Tensor& t, const std::shared_ptr<Mesh>& mesh,
                                const std::vector<std::tuple<int, int64_t, std::string>>& p,
                                const ShardingShapes& shapes) { return distribute_tensor(t, mesh, to_placements(p), shapes); },
        py::call_guard<py::gil_scoped_release>());
  m.def("scatter_tensor", [](std::optional<at::Tensor> t, int64_t src, const std::shared_ptr<Mesh>& mesh,
                             const std::vector<std::tuple<int, int64_t, std::string>>& p, const ShardingShapes& shapes) {
    return scatter_tensor(t.value_or(at::Tensor()), src, mesh, to_placements(p), shapes);
  }, py::call_guard<py::gil_scoped_release>());

  m.def("ring_pass", [](const std::vector<at::Tensor>& tensors, const std::shared_ptr<Mesh>& mesh, int64_t mesh_dim,
                        const std::vector<std::vector<int64_t>>& recv_shapes, bool backward) {
    return with_context("ring_pass", [&] { return "mesh dim " + std::to_string(mesh_dim) + " of " + mesh->str(); },
                        [&] {
                          return ring_pass(tensors, mesh, mesh_dim, recv_shapes,
                                           backward ? RingDirection::Backward : RingDirection::Forward);
                        });
  }, py::arg("tensors"), py::arg("mesh"), py::arg("mesh_dim"), py::arg("recv_shapes"), py::arg("backward"),
        py::call_guard<py::gil_scoped_release>());

  // Internal: routed Python code's exchange of pieces whose shapes every rank derives from layouts (no agreement).
  m.def("_peer_exchange", [](const std::vector<at::Tensor>& send, const std::vector<std::vector<int64_t>>& recv_shapes,
                             const at::Tensor& like, const std::shared_ptr<Mesh>& mesh, int64_t mesh_dim) {
    return comm::differentiable_peer_exchange(send, recv_shapes, like, mesh, mesh_dim);
  }, py::arg("send"), py::arg("recv_shapes"), py::arg("like"), py::arg("mesh"), py::arg("mesh_dim"),
        py::call_guard<py::gil_scoped_release>());

  m.def("register_handler", [](const std::string& name, py::function fn) {
    // The Python handler receives the op's arguments and returns its result(s); it runs with the GIL.
    auto holder = std::make_shared<py::object>(std::move(fn));
    register_handler(name, [holder](const c10::OperatorHandle& op, torch::jit::Stack* stack) {
      const auto n = op.schema().arguments().size();
      py::gil_scoped_acquire gil;
      py::tuple args(n);
      for (size_t i = 0; i < n; ++i) args[i] = torch::jit::toPyObject((*stack)[stack->size() - n + i]);
      torch::jit::drop(*stack, n);
      py::object result = (*holder)(*args);
      const auto& returns = op.schema().returns();
      if (returns.size() == 1) {
        torch::jit::push(*stack, torch::jit::toIValue(result, returns[0].type()));
      } else {
        auto tup = result.cast<py::tuple>();
        for (size_t i = 0; i < returns.size(); ++i) torch::jit::push(*stack, torch::jit::toIValue(tup[i], returns[i].type()));
      }
    });
  });
  // SHARDTENSOR_CHECK_CONSISTENCY gives the initial setting; tests switch it per case.
  m.def("set_consistency_check", &dispatch::set_consistency_check);
  m.def("has_handler", &has_handler);
  m.def("registered_handlers", &registered_handlers);
  m.def("rules_above_autograd", &dispatch::rules_above_autograd);
  m.def("_take_traced_receives", &comm::functional::take_traced_receives);
  m.def("collective_thread_cpu_seconds", &comm::collective_thread_cpu_seconds);
  m.def("_set_trace_anchor", &comm::functional::set_trace_anchor);

  m.def("comm_stats", []() {
    auto s = comm_stats();
    return py::make_tuple(s.calls, s.bytes, s.messages, s.replications, s.replicated_bytes);
  });
  m.def("reset_comm_stats", &reset_comm_stats);
  // Parameter-gradient buckets (dispatch/grad_buckets.h).
  m.def("grad_bucket_bytes", &dispatch::grad_bucket_bytes);
  m.def("set_grad_bucket_bytes", &dispatch::set_grad_bucket_bytes, py::arg("bytes"));
  m.def("wait_grad_reductions", &dispatch::wait_grad_reductions, py::call_guard<py::gil_scoped_release>());
  m.def("grad_reduction_stats", &dispatch::grad_reduction_stats);
  m.def("reset_grad_reduction_stats", &dispatch::reset_grad_reduction_stats);
  // Communication hidden per step (comm/comm_timing.h): exposed time per kind, and the recorded collectives replayed
  // alone.
  m.def("set_comm_timing", &comm::set_comm_timing, py::arg("on"));
  m.def("reset_comm_timing", &comm::reset_comm_timing);
  m.def("comm_timing_stats", []() {
    std::map<std::string, std::map<std::string, double>> out;
    for (const auto& [kind, t] : comm::comm_timing_stats())
      out[kind] = {{"waits", static_cast<double>(t.waits)}, {"issued", static_cast<double>(t.issued)},
                   {"exposed_s", t.exposed_s}};
    return out;
  });
  m.def("comm_timing_records", []() {
    py::list out;
    for (const auto& r : comm::comm_timing_records()) out.append(py::make_tuple(r.kind, r.posted_s, r.waits));
    return out;
  });
  m.def("replay_recorded_collectives", &comm::replay_recorded_collectives, py::arg("reps") = 3,
        py::call_guard<py::gil_scoped_release>());
  // Shared-memory rings for neighbour exchanges on one host (comm/shm_transport.h).
  m.def("set_shm_capacity", &set_shm_capacity, py::arg("bytes"));
  m.def("shm_capacity", &shm_capacity);
  m.def("shm_stats", []() {
    auto s = comm::shm::shm_stats();
    return std::map<std::string, int64_t>{
        {"sent", s.sent}, {"deferred", s.deferred}, {"received", s.received}, {"groups", s.groups},
        {"released", s.released}};
  });
  // The halo plan cache (tests: a backward builds no plan of its own).
  m.def("_halo_plan_stats", []() {
    auto s = comm::plan_cache_stats();
    return std::map<std::string, int64_t>{{"hits", s.hits}, {"misses", s.misses}, {"size", s.size}};
  });
  m.def("_reset_halo_plan_stats", &comm::reset_plan_cache_stats);

  // `with _C.CpuMemoryTracker() as t: ...` then t.peak_bytes: the tracker lives between __enter__ and __exit__;
  // afterwards the final figures stay readable.
  struct PyCpuMemoryTracker {
    std::unique_ptr<CpuMemoryTracker> tracker;
    int64_t peak = 0, current = 0;
  };
  py::class_<PyCpuMemoryTracker>(m, "CpuMemoryTracker")
      .def(py::init<>())
      .def("__enter__",
           [](PyCpuMemoryTracker& s) -> PyCpuMemoryTracker& {
             s.tracker = std::make_unique<CpuMemoryTracker>();
             return s;
           },
           py::return_value_policy::reference)
      .def("__exit__",
           [](PyCpuMemoryTracker& s, const py::args&) {
             if (s.tracker) {
               s.peak = s.tracker->peak_bytes();
               s.current = s.tracker->current_bytes();
               s.tracker.reset();
             }
             return false;
           })
      .def_property_readonly("peak_bytes",
                             [](const PyCpuMemoryTracker& s) { return s.tracker ? s.tracker->peak_bytes() : s.peak; })
      .def_property_readonly("current_bytes", [](const PyCpuMemoryTracker& s) {
        return s.tracker ? s.tracker->current_bytes() : s.current;
      });

  m.def("set_attention_strategy", [](const std::string& name) {
    return to_string(set_attention_strategy(parse_attention_strategy(name)));
  });
  m.def("attention_strategy", [] { return to_string(attention_strategy()); });
  m.def("set_thread_attention_strategy", [](const std::optional<std::string>& name) -> std::optional<std::string> {
    auto previous = set_thread_attention_strategy(name ? std::optional(parse_attention_strategy(*name)) : std::nullopt);
    if (!previous) return std::nullopt;
    return to_string(*previous);
  });
  m.def("set_comm_backend", [](const std::string& name) {
    TORCH_CHECK_VALUE(name == "process_group" || name == "functional",
                      "set_comm_backend: expected \"process_group\" or \"functional\", got \"", name, "\"");
    auto previous = set_comm_backend(name == "functional" ? CommBackend::functional : CommBackend::process_group);
    return std::string(previous == CommBackend::functional ? "functional" : "process_group");
  });
  m.def("comm_backend", [] {
    return std::string(comm_backend() == CommBackend::functional ? "functional" : "process_group");
  });
  m.def("set_strict", &set_strict, py::arg("strict"));
  m.def("strict", &strict);
  m.def("set_fallback_budget", &set_fallback_budget, py::arg("bytes"));
  m.def("fallback_budget", &fallback_budget);
  m.def("_reset_fallback_warnings", &reset_fallback_warnings);
  m.def("set_replication_threshold", &set_replication_threshold, py::arg("numel"));
  m.def("replication_threshold", &replication_threshold);
  m.def("_reset_replication_warnings", &reset_replication_warnings);
  m.def("set_simulating", &set_simulating, py::arg("on"));
  m.def("simulating", &simulating);
}
