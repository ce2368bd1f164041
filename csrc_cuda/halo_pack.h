// CUDA kernels for the halo exchange: pack strided boundary slabs (rows of one dim) into a contiguous buffer for
// the collectives, and add received rows back (the backward). Plain C++ declarations: no CUDA headers needed.
#pragma once

#include <cstdint>

namespace shardtensor::cuda {

// dst[o, r, i] = src[o, rows[r], i]; src is [outer, dim_size, inner] contiguous, dst [outer, n_rows, inner].
// `rows` lives in device memory. Any element size (values are moved, not interpreted).
void pack_rows(const void* src, void* dst, const int64_t* rows, int64_t n_rows, int64_t outer, int64_t dim_size,
               int64_t inner, int64_t element_size, void* stream);

// dst[o, rows[r], i] += src[o, r, i] with atomics (rows may repeat, e.g. reflect padding); float (is_double =
// false) or double.
void add_rows(const void* src, void* dst, const int64_t* rows, int64_t n_rows, int64_t outer, int64_t dim_size,
              int64_t inner, bool is_double, void* stream);

} // namespace shardtensor::cuda
