// How the library's collectives are issued. `process_group` (the default): c10d ProcessGroup calls, waited on their
// Work. `functional`: the `_c10d_functional` ops through the dispatcher, waited by `wait_tensor` — the form
// torch.compile can trace. The functional form is used automatically whenever the tensors are being traced (fake or
// functional tensors, or a tracer's fake/proxy/functional mode active); this setting selects it for eager runs too (to measure it,
// or to debug a compiled run eagerly). Process-wide; set it alike on every rank. `SHARDTENSOR_COMM_BACKEND=functional`
// in the environment selects it at start-up.
#pragma once

namespace shardtensor {

enum class CommBackend { process_group, functional };

// Returns the previous setting.
CommBackend set_comm_backend(CommBackend backend);
CommBackend comm_backend();

} // namespace shardtensor
