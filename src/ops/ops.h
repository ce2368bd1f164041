// Built-in domain-parallel handlers, one registration function per op family.
#pragma once

namespace shardtensor::ops {

void register_all();

void register_pointwise();
void register_factory();
void register_reduction();
void register_reduction_grad();
void register_view();
void register_linear();
void register_softmax();
void register_embedding();
void register_norm();
void register_batch_norm();
void register_loss();
void register_attention();
void register_transformer_fastpath();
void register_conv();
void register_pad();
void register_interpolate();
void register_pool();
void register_point_search();
void register_neighborhood_attention();
void register_indexing();
void register_sort_fft();
void register_fft();
void register_roll();
void register_unfold();
void register_im2col();
void register_rot90();
void register_grid_sample();
void register_view_inplace();
void register_diagonal();
void register_position_writes();
void register_foreach();

} // namespace shardtensor::ops
