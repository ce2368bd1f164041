import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _close_pools():
    yield
    harness.close_all()


# The quick tier (`make test-quick`, `pytest -m quick`): a representative case of every test file, in about three
# minutes on 2 cores. Each entry names a test function (its first parametrization is taken) or one exact
# parametrization ("name[id]"). A file without an entry must say here why it has none; a stale entry is an error,
# so the tier cannot shrink silently when tests are renamed.
QUICK = {
    "test_api.py": ["test_redistribute_1d[3]", "test_errors_raise_on_every_rank"],
    "test_autocast.py": ["test_op_dtypes"],
    "test_double_backward.py": ["test_double_backward[conv-du]"],
    "test_argument_checks.py": ["test_arguments_checked_against_global_shapes[2]"],
    "test_attention.py": ["test_self_attention[ring-2]"],
    "test_checkpoint.py": ["test_save_2_ranks_load_other_layouts[3]"],
    "test_comm_backend.py": ["test_primitives[2]"],
    "test_compat_physicsnemo.py": ["test_ring_pass[forward-3]"],
    "test_compile.py": ["test_compiled_function"],
    "test_compile_eager_frames.py": ["test_skipped_frame_runs_like_eager[uneven]"],
    "test_complex_comm.py": ["test_complex_collectives"],
    "test_complex_ops.py": ["test_complex_ops[2]"],
    "test_low_precision.py": ["test_index_reduce_prod_half"],
    "test_consistency.py": ["test_from_local_disagreement_raises"],
    "test_conv.py": ["test_conv_2d_mesh", "test_conv_module_training"],
    "test_cuda.py": ["test_elementwise"],
    "test_ecosystem.py": ["test_data_x_domain"],
    "test_factory_autograd.py": ["test_autograd_plumbing", "test_random_streams[mesh_shape1]"],
    "test_empty_blocks.py": ["test_empty_blocks[channels]"],
    "test_failures.py": ["test_peer_failure_names_op_and_placements"],
    "test_fallback.py": ["test_long_tail[case_median-2]"],
    "test_fuzz_nets.py": ["test_fuzz_nets[0-window]"],
    "test_fft_sharded.py": ["test_transforms[2-uneven]"],
    "test_fold_rot90_grid.py": ["test_unfold_h[2-uneven]"],
    "test_gpu_check.py": ["test_error_bars_of_one_rounded_sample"],
    "test_grad_buckets.py": ["test_training_step[1048576-2]"],
    "test_grad_layout.py": ["test_leaf_grad_layout[2-uneven]"],
    "test_grad_layouts_backward.py": ["test_backward_with_grad_layouts[conv2d-w2]"],
    "test_halo_plan.py": ["test_backward_builds_no_plan"],
    "test_histogram.py": ["test_histograms[2-False]"],
    "test_torchvision_detection.py": ["test_roi_align[2-uneven]", "test_batch_buffer[2]"],
    "test_deform_conv.py": ["test_deform_conv[2-uneven]"],
    "test_indexing_rules.py": ["test_index_select[3]"],
    "test_inference_mode.py": ["test_model_eval[2]"],
    "test_func_transforms.py": ["test_transform[jvp]", "test_pinn[2]"],
    "test_autograd_function.py": ["test_adjoint_parameters"],
    "test_inplace_views.py": ["test_inplace_views[0-2]", "test_relaid_view_written[permute.reshape-2]"],
    "test_interpolate.py": ["test_interp_module_and_layout"],
    "test_io.py": ["test_roundtrip[npy-3]"],
    "test_linalg_batched.py": ["test_batched[2-uneven]"],
    "test_linear.py": ["test_linear[3]"],
    "test_local_rules.py": ["test_sort_topk_scans[2]"],
    "test_loss_scan.py": ["test_cross_entropy[3]"],
    "test_matrix_parts.py": ["test_diagonal[2-uneven]"],
    "test_mixed_dtensor.py": ["test_mixed_dtensor_raises"],
    "test_models.py": ["test_vit_2d_image[2]"],
    "test_neighborhood_attention.py": ["test_sharded_2d"],
    "test_norm.py": ["test_gn_bn_model"],
    "test_op_sweep.py": ["test_docs_section_current"],
    "test_module_sweep.py": ["test_docs_section_current"],
    "test_optim_sharded.py": ["test_optimizer"],
    "test_pad_negative.py": ["test_issue_example"],
    "test_comm_timing.py": ["test_records"],
    "test_conv_mesh2d.py": ["test_conv2d_mesh_2x1_1x2"],
    "test_patches.py": ["test_namespace_is_the_api", "test_torch_version_checks"],
    "test_physicsnemo_examples.py": ["test_example"],
    "test_point_search.py": ["test_sharded_batched"],
    "test_healpix.py": ["test_healpix_layers[2-False-True]", "test_padding_one_exchange[2]"],
    "test_physicsnemo_grid_derivatives.py": ["test_grid_derivatives[2-uneven]"],
    "test_physicsnemo_neighbors.py": ["test_ball_query_split_queries[2-uneven]", "test_custom_op_defined_after_import"],
    "test_pointwise.py": ["test_binary_broadcast[3]"],
    "test_pool.py": ["test_pool2d"],
    "test_profiling.py": ["test_peak_memory_threads_and_nesting"],
    "test_reduction.py": ["test_reductions[0-3]"],
    "test_segment_reduce.py": ["test_segment_reduce_axis_split[2]"],
    "test_relative_position_bias.py": ["test_transformers_wavlm[2-uneven]"],
    "test_rotary_positions.py": ["test_ltx_video_rope[2-uneven]"],
    "test_projection.py": ["test_least_share_over_workloads"],
    "test_roll.py": ["test_roll_sharded_dim[3]"],
    "test_torchvision_roi_pooling.py": ["test_multiscale_roi_align[2-pyramid-uneven]"],
    "test_pixel_ops.py": ["test_pixel_ops[3]"],
    "test_sim_agreement.py": ["test_within_and_outside_noise"],
    "test_select_divided.py": ["test_levels_select_stays_divided[2-l_ext1-0]"],
    "test_shm_transport.py": ["test_conv_step_through_rings[2]", "test_all_reduce_through_rings[3]",
                              "test_all_to_all_through_rings"],
    "test_simulate.py": ["test_simulated_rank_equals_real_rank"],
    "test_stft.py": ["test_stft[2-uneven]"],
    "test_rnn.py": ["test_time_split[3-gru-tiny]", "test_sharded_initial_state"],
    "test_torchaudio_filtering.py": ["test_lfilter[3-tiny]"],
    "test_neuralop_gno.py": ["test_gino[3-tiny]"],
    "test_spectral_layers.py": ["test_neuralop_layers[2-uneven]", "test_physicsnemo_layers[2-uneven]"],
    "test_smoke.py": ["test_roundtrip"],
    "test_strided_inputs.py": ["test_halo_ops_strided"],
    "test_torch_harmonics.py": ["test_disco_layers[2-uneven]"],
    "test_transformer.py": ["test_encoder_layer"],
    "test_unet.py": ["test_unet_training_1d_mesh"],
    "test_unique.py": ["test_unique[2-uneven]"],
    "test_unfold.py": ["test_unfold_sharded_dim[2-uneven]"],
    "test_vector_ops.py": ["test_vector_products[2]"],
    "test_view.py": ["test_views"],
    "test_windows.py": ["test_swin_block"],
    "test_write_through.py": ["test_select_writes_through"],
    "test_zoo.py": ["test_zoo_model"],
}
QUICK_EXEMPT = {
    "test_compile_bench.py": "a benchmark's smoke run (a minute of compiling); test_compile.py stands for compile",
    "test_validate_sim.py": "a launch of 2P processes; test_simulate.py stands for the simulation",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the quick tier (make test-quick), chosen in QUICK below")


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselect: the entries are checked against everything collected
def pytest_collection_modifyitems(config, items):
    by_file = {}
    for item in items:
        by_file.setdefault(os.path.basename(item.fspath), []).append(item)
    problems = []
    for name in by_file:
        if name not in QUICK and name not in QUICK_EXEMPT:
            problems.append(f"{name} has no quick case: add one to QUICK in tests/python/conftest.py (or say in "
                            "QUICK_EXEMPT why not)")
    for name, entries in QUICK.items():
        if name not in by_file:
            continue  # the file was not collected in this run (a path or -k selection)
        for entry in entries:
            if "[" in entry:
                chosen = [i for i in by_file[name] if i.name == entry]
            else:
                chosen = [i for i in by_file[name] if i.originalname == entry][:1]
            if not chosen:
                problems.append(f"QUICK names {name}::{entry}, which does not exist")
            for item in chosen:
                item.add_marker(pytest.mark.quick)
    config.quick_tier_problems = problems  # test_smoke.py fails on them in a full run
    if problems and "quick" in (config.getoption("markexpr", "") or ""):
        raise pytest.UsageError("; ".join(problems))
