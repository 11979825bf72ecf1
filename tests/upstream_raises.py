"""Every ``raise`` in upstream's ``torch/distributed/fsdp/_fully_shard/``, release by release.

``UPSTREAM_RAISES`` is torch 2.13's list; ``CHANGES`` holds what each later
tested release added and removed, and ``raises_for(release)`` the list of that
release, so the test on a new torch names exactly the raises it added.

Each entry names the file, the enclosing function, upstream's class, then either
the row of ``test_upstream_errors.py`` that triggers it against both
implementations, or why a user cannot reach it (or not on this machine), and
fsdp2's counterpart. ``test_every_upstream_raise_is_accounted_for`` checks this
list against upstream's source. Reasons:

- ``internal``: an invariant of upstream's own bookkeeping; no input reaches it.
- ``private``: reachable only through a private torch API (a field of a
  torch-private class, experimental annotations); fsdp2's counterpart is named.
- ``accelerator``: needs two device types, NCCL or a non-CPU device; the CPU
  test machines have neither. fsdp2 raises the same class with upstream's
  message first where it has the check.
- ``ranks``: raised only on some ranks (upstream's others then wait in a
  collective), so no table row can run it on both implementations.
- ``tested``: reached by the named test file against both implementations
  (features newer than this table's rows).
- ``unsupported``: upstream's check of a feature fsdp2 does not have (said in
  docs/differences.md).
"""

from __future__ import annotations

from typing import NamedTuple


class Raise(NamedTuple):
    file: str
    function: str
    cls: str
    covered_by: str  # a row of test_upstream_errors.py, or "<reason>: <why>"
    fsdp2: str = "same class, upstream's message first"


_S = "same class, upstream's message first"
_SV = "same class (also a ValueError), upstream's message first"
_MOE = "tested: tests/test_moe.py (per-parameter meshes, ShardPlacementResult)"
_P8 = "API added by issue 14 point 8; the row skips for fsdp2 until it lands"

UPSTREAM_RAISES: list[Raise] = [
    Raise("_fsdp_api.py", "DataParallelMeshDims.__post_init__", "ValueError",
          "mesh_dims_empty", _P8),
    Raise("_fsdp_collectives.py", "foreach_reduce", "AssertionError",
          "internal: Shard(k > 0) gradients always divide evenly (fully_shard requires it)", "-"),
    Raise("_fsdp_collectives.py", "foreach_reduce", "AssertionError",
          "plain_tensor_as_sharded_grad", _SV),
    Raise("_fsdp_common.py", "DataParallelMeshInfo.__post_init__", "AssertionError",
          "internal: mesh infos are built with a shard or replicate dim", "-"),
    Raise("_fsdp_common.py", "FSDPMeshInfo.__post_init__", "AssertionError",
          "internal: as above", "-"),
    Raise("_fsdp_common.py", "DDPMeshInfo.__post_init__", "AssertionError",
          "internal: as above", "-"),
    Raise("_fsdp_common.py", "_raise_assert_with_print", "AssertionError",
          "internal: helper for upstream's state and size invariants", "-"),
    Raise("_fsdp_common.py", "resolve_shard_placement", "ValueError",
          "shard_placement_fn_returns_replicate shard_placement_fn_returns_int", _S),
    Raise("_fsdp_init.py", "_validate_module", "ValueError", "container_without_forward", _S),
    Raise("_fsdp_init.py", "_validate_mesh", "ValueError", "mesh_dims_emptied_later", _P8),
    Raise("_fsdp_init.py", "_validate_mesh", "ValueError", "mesh_dims_on_unnamed_mesh", _P8),
    Raise("_fsdp_init.py", "_validate_mesh", "ValueError", "mesh_dims_unknown_name", _P8),
    Raise("_fsdp_init.py", "_validate_mesh", "ValueError", "mesh_3d", _S),
    Raise("_fsdp_init.py", "_validate_mesh", "AssertionError", "mesh_2d_without_names", _SV),
    Raise("_fsdp_init.py", "_get_post_forward_mesh_info", "ValueError",
          "reshard_after_forward_str reshard_after_forward_float", _S),
    Raise("_fsdp_init.py", "_get_post_forward_mesh_info", "ValueError",
          "reshard_after_forward_0 reshard_after_forward_negative "
          "reshard_after_forward_not_a_factor", _S),
    Raise("_fsdp_init.py", "_verify_managed_param", "ValueError", "scalar_parameter", _S),
    Raise("_fsdp_init.py", "_move_states_to_device", "ValueError",
          "accelerator: a DTensor parameter on a CPU mesh with an accelerator FSDP mesh", _S),
    Raise("_fsdp_init.py", "_move_states_to_device", "AssertionError",
          "accelerator: a DTensor parameter on another accelerator index", _SV),
    Raise("_fsdp_init.py", "_init_param_group", "ValueError",
          "mesh_dims_replicate_only_with_placement_fn", _P8),
    Raise("_fsdp_init.py", "_init_param_group", "ValueError", _MOE, _S),
    Raise("_fsdp_param.py", "FSDPParam._init_sharded_param", "AssertionError",
          "internal: parameters were moved to the mesh's device just before", "-"),
    Raise("_fsdp_param.py", "FSDPParam._init_sharded_param", "NotImplementedError",
          "non_contiguous_parameter", _SV),
    Raise("_fsdp_param.py", "FSDPParam._init_sharded_param", "AssertionError",
          "private: a ShardPlacementResult whose placement is not a Shard (a torch-private class's "
          "field)", "AssertionError (FSDPAssertionError), upstream's message"),
    Raise("_fsdp_param.py", "FSDPParam._init_sharded_param", "AssertionError",
          "dtensor_with_non_contiguous_local", _SV),
    Raise("_fsdp_param.py", "FSDPParam._init_sharded_param", "AssertionError",
          "shard_dim_beyond_tensor", _SV),
    Raise("_fsdp_param.py", "FSDPParam._init_sharded_param", "NotImplementedError",
          "uneven_shard_on_dim_1", _SV),
    Raise("_fsdp_param.py", "FSDPParam._init_sharded_param", "AssertionError",
          "internal: a narrow along the shard dim of a contiguous padded shard", "-"),
    Raise("_fsdp_param.py", "FSDPParam._init_sharding_spec", "ValueError",
          "mesh_dims_plain_parameter", _P8),
    Raise("_fsdp_param.py", "FSDPParam._init_sharding_spec_spmd", "AssertionError",
          "internal: dp_mesh_dims is set on this path", "-"),
    Raise("_fsdp_param.py", "FSDPParam._init_sharding_spec_spmd", "AssertionError",
          "internal: the mesh's dim names were checked by _validate_mesh", "-"),
    Raise("_fsdp_param.py", "FSDPParam._init_sharding_spec_spmd", "ValueError",
          "mesh_dims_parameter_on_other_mesh", _P8),
    Raise("_fsdp_param.py", "FSDPParam._init_sharding_spec_spmd", "ValueError",
          "mesh_dims_sharded_on_shard_dim", _P8),
    Raise("_fsdp_param.py", "FSDPParam._init_sharding_spec_spmd", "ValueError",
          "mesh_dims_sharded_on_replicate_dim", _P8),
    Raise("_fsdp_param.py", "FSDPParam._build_spmd_sharding_spec", "AssertionError",
          "internal: set just before", "-"),
    Raise("_fsdp_param.py", "FSDPParam._build_spmd_sharding_spec", "AssertionError",
          "internal: checked by _validate_mesh", "-"),
    Raise("_fsdp_param.py", "FSDPParam._init_sharding_spec_tp", "AssertionError",
          "internal: meshes are never None", "-"),
    Raise("_fsdp_param.py", "FSDPParam._init_sharding_spec_tp", "NotImplementedError",
          "tensor_parallel_over_3_dims", _SV),
    Raise("_fsdp_param.py", "FSDPParam._init_sharding_spec_tp", "AssertionError",
          "internal: 1-2 data-parallel dims plus at most 2 checked just before", "-"),
    Raise("_fsdp_param.py", "FSDPParam._init_sharding_spec_tp", "AssertionError",
          "internal: HSDP mesh infos replicate on dim 0", "-"),
    Raise("_fsdp_param.py", "FSDPParam._init_sharded_post_forward_param_metadata",
          "AssertionError", "internal: called only with a post-forward mesh", "-"),
    Raise("_fsdp_param.py", "FSDPParam._init_extensions", "AssertionError",
          "extension_with_one_hook", _SV + " (the tensor shown is the full parameter)"),
    Raise("_fsdp_param.py", "FSDPParam.init_unsharded_param", "AssertionError",
          "internal: the default all-gather has one output", "-"),
    Raise("_fsdp_param.py", "FSDPParam._get_unsharded_dtensor_spec", "AssertionError",
          "internal: DTensor parameters have the spec", "-"),
    Raise("_fsdp_param.py", "FSDPParam.to_sharded_post_forward", "NotImplementedError",
          "tensor_parallel_with_int_reshard", _SV + ", at fully_shard (upstream: first forward)"),
    Raise("_fsdp_param.py", "FSDPParam.to_sharded_post_forward", "AssertionError",
          "internal: called only with a post-forward mesh", "-"),
    Raise("_fsdp_param.py", "FSDPParam.to_sharded_post_forward", "AssertionError",
          "internal: extensions are rejected with int resharding before", "-"),
    Raise("_fsdp_param.py", "FSDPParam.to_sharded_post_forward_dtensor", "AssertionError",
          "internal: post-forward mesh infos are HSDP-shaped", "-"),
    Raise("_fsdp_param.py", "FSDPParam.all_gather_inputs", "AssertionError",
          "extension_pre_hook_signature", _SV + ", at fully_shard (upstream: first all-gather)"),
    Raise("_fsdp_param.py", "FSDPParam.all_gather_inputs", "AssertionError",
          "ranks: only ranks holding padding check fsdp_pre_all_gather's input sizes", _SV),
    Raise("_fsdp_param.py", "FSDPParam.all_gather_inputs", "NotImplementedError",
          "extension_with_int_reshard", _SV + ", at fully_shard (upstream: backward)"),
    Raise("_fsdp_param.py", "FSDPParam.unsharded_grad_data", "AssertionError",
          "internal: read only for parameters with a gradient", "-"),
    Raise("_fsdp_param.py", "FSDPParam.unsharded_accumulated_grad_data", "AssertionError",
          "internal: as above", "-"),
    Raise("_fsdp_param.py", "FSDPParam._get_grad_inner_tensor", "AssertionError",
          "internal: gradients of DTensor parameters are DTensors", "-"),
    Raise("_fsdp_param.py", "FSDPParam._get_grad_inner_tensor", "AssertionError",
          "internal: DTensor parameters have the spec", "-"),
    Raise("_fsdp_param.py", "FSDPParam._get_grad_inner_tensor", "AssertionError",
          "internal: a gradient has its parameter's mesh", "-"),
    Raise("_fsdp_param.py", "FSDPParam._get_grad_inner_tensor", "AssertionError",
          "internal: as above", "-"),
    Raise("_fsdp_param.py", "FSDPParam._init_shard_mesh", "AssertionError",
          "internal: 2-D meshes are named (checked by _validate_mesh)", "-"),
    Raise("_fsdp_param.py", "FSDPParam.reset_sharded_param", "AssertionError",
          "internal: with swap_tensors, load_state_dict and _apply keep parameter objects", "-"),
    Raise("_fsdp_param.py", "FSDPParam.reset_sharded_param", "AssertionError",
          "load_other_layout_into_shard_dim_1", _SV + ", at the next use (upstream: at load)"),
    Raise("_fsdp_param.py", "FSDPParam.reset_sharded_param", "AssertionError",
          "internal: sharded parameters are DTensors", "-"),
    Raise("_fsdp_param.py", "FSDPParam.reset_sharded_param", "AssertionError",
          "internal: a narrow of a contiguous padded shard", "-"),
    Raise("_fsdp_param_group.py", "FSDPParamGroup._init_mp_dtypes", "AssertionError",
          "mixed_trainable_dtypes", _SV),
    Raise("_fsdp_param_group.py", "FSDPParamGroup._init_mp_dtypes", "AssertionError",
          "internal: one trainable dtype gives one reduce dtype", "-"),
    Raise("_fsdp_param_group.py", "FSDPParamGroup.set_symm_mem", "AssertionError",
          "symm_mem_after_custom_all_gather", _P8),
    Raise("_fsdp_param_group.py", "FSDPParamGroup.set_symm_mem", "AssertionError",
          "accelerator: the symmetric-memory all-gather needs NCCL before this check", _P8),
    Raise("_fsdp_param_group.py", "FSDPParamGroup.set_allocate_memory_from_process_group",
          "AssertionError", "pg_allocation_after_custom_all_gather", _P8),
    Raise("_fsdp_param_group.py", "FSDPParamGroup.set_allocate_memory_from_process_group",
          "AssertionError", "pg_allocation_after_custom_reduce_scatter", _P8),
    Raise("_fsdp_param_group.py", "FSDPParamGroup.post_backward", "AssertionError",
          "all_reduce_hook_stream_without_hook", _SV),
    Raise("_fsdp_param_group.py", "FSDPParamGroup.post_backward", "AssertionError",
          "internal: an accelerator all-reduce records its event", "-"),
    Raise("_fsdp_param_group.py", "FSDPParamGroup._prefetch_unshard", "ValueError",
          "internal: called with 'forward' or 'backward'", "-"),
    Raise("_fsdp_param_group.py", "FSDPParamGroup._register_state_dict_hooks", "AssertionError",
          "internal: hooks are registered in pairs", "-"),
    Raise("_fsdp_param_group.py", "FSDPParamGroup._all_gather_process_group", "AssertionError",
          "internal: sharded groups have a shard mesh", "-"),
    Raise("_fsdp_param_group.py", "FSDPParamGroup._reduce_scatter_process_group",
          "AssertionError", "internal: as above", "-"),
    Raise("_fsdp_param_group.py", "FSDPParamGroup._set_separate_reduce_scatter_group",
          "AssertionError", "internal: as above", "-"),
    Raise("_fsdp_param_group.py", "FSDPParamGroup._all_reduce_process_group", "AssertionError",
          "internal: read only for replicated meshes", "-"),
    Raise("_fsdp_param_group.py", "FSDPParamGroup._validate_no_meta_params", "RuntimeError",
          "forward_with_meta_parameters", _S),
    Raise("_fsdp_param_group.py", "FSDPParamGroup._validate_cpu_offload_params", "RuntimeError",
          "accelerator: sharded parameters off the CPU under CPUOffloadPolicy", _S),
    Raise("_fsdp_param_group.py", "FSDPParamGroup._validate_reduce_scatter_max_input_buffers",
          "ValueError", "accelerator: the symmetric-memory reduce-scatter needs NCCL", _P8),
    Raise("_fsdp_param_group.py", "_get_param_module_infos", "AssertionError",
          "internal: parameters are collected from the same module tree", "-"),
    Raise("_fsdp_state.py", "FSDPState._fsdp_param_group", "AssertionError",
          "internal: upstream's private accessor of a state's one group", "-"),
    Raise("_fsdp_state.py", "FSDPState._lazy_init", "RuntimeError",
          "group_of_several_modules_as_root", _S),
    Raise("_fsdp_state.py", "FSDPState._lazy_init", "RuntimeError",
          "child_forwarded_before_root", _S),
    Raise("_fsdp_state.py", "FSDPState._validate_no_duplicate_params", "ValueError",
          "tied_weight_in_two_groups", _S + " (more cases: test_shared_params.py)"),
    Raise("_fsdp_state.py", "FSDPState._init_fqns", "AssertionError",
          "internal: called on the root", "-"),
    Raise("_fsdp_state.py", "FSDPState._init_fqns", "AssertionError",
          "internal: FQNs are strings", "-"),
    Raise("_fsdp_state.py", "FSDPState._reset_iter_state", "RuntimeError",
          "reset_iter_state_on_non_root", _S),
    Raise("_fully_shard.py", "fully_shard", "NotImplementedError",
          "mesh_dims_with_int_reshard", _P8),
    Raise("_fully_shard.py", "_unimplemented_deepcopy", "AssertionError", "deepcopy", _SV),
    Raise("_fully_shard.py", "FSDPModule.set_reshard_after_forward", "ValueError",
          "set_reshard_after_forward_int", _S),
    Raise("_fully_shard.py", "FSDPModule.set_reshard_after_forward", "AssertionError",
          "mesh_dims_replicate_only_set_reshard", _P8),
    Raise("_fully_shard.py", "FSDPModule.set_custom_all_gather", "ValueError", _MOE, _S),
    Raise("_fully_shard.py", "FSDPModule.set_custom_reduce_scatter", "ValueError", _MOE, _S),
    Raise("_fully_shard.py", "FSDPModule.set_all_reduce_hook", "ValueError", _MOE, _S),
    Raise("_fully_shard.py", "FSDPModule.set_all_reduce_hook", "ValueError",
          "all_reduce_hook_stream_on_hsdp", _S),
    Raise("_fully_shard.py", "FSDPModule.set_reduce_scatter_max_input_buffers", "TypeError",
          "max_input_buffers_bool", _P8),
    Raise("_fully_shard.py", "FSDPModule.set_reduce_scatter_max_input_buffers", "ValueError",
          "max_input_buffers_zero", _P8),
    Raise("_fully_shard.py", "FSDPModule._get_fsdp_state", "AssertionError",
          "internal: only fully_shard gives a module the FSDP class, with its state", "-"),
    Raise("_fully_shard.py", "register_fsdp_forward_method", "ValueError",
          "register_missing_forward_method", _S),
    Raise("_fully_shard.py", "share_comm_ctx", "ValueError",
          "share_comm_ctx_with_plain_module", _P8),
    Raise("_fully_shard.py", "_assert_all_fsdp_modules", "ValueError",
          "prefetch_list_with_plain_module", _S),
]

#: Rows for raises outside the package, reached through fully_shard.
EXTRA_ROWS = {
    "applied_twice": "torch/distributed/_composable/contract.py: AssertionError; fsdp2: " + _SV,
}


_MANUAL = "tested: tests/test_finalize_backward.py (manual / async backward finalization)"
_CROSS_ROOT = (
    "unsupported: fsdp2 does not track which root owns a reduction across roots "
    "sharing a communication context"
)

#: release -> (raises it added, raises it removed), against the release before in this dict.
CHANGES: dict[tuple[int, int], tuple[list[Raise], list[Raise]]] = {
    (2, 15): (
        [
            Raise("_fsdp_api.py", "MixedPrecisionPolicy._resolve_for_param", "ValueError",
                  "tested: tests/test_mixed_precision_policy.py (bad param_dtype_override_fn answers)"),
            Raise("_fsdp_api.py", "MixedPrecisionPolicy._resolve_for_param", "ValueError",
                  "tested: as above"),
            Raise("_fsdp_collectives.py", "_default_reduce_scatter_input_fn", "AssertionError",
                  "internal: Shard(k > 0) gradients always divide evenly (moved from foreach_reduce)",
                  "-"),
            *[Raise("_fsdp_param.py", "FSDPParam._resolve_spmd_types_for_storage", "ValueError",
                    "private: spmd_types annotations (torch.distributed's experimental SPMD "
                    "types), which fsdp2 does not read", "-")] * 7,
            *[Raise("_fsdp_param.py", "FSDPParam._init_extensions", "AssertionError",
                    "unsupported: the extension hook fsdp_should_release_all_gather_outputs_"
                    "after_post_all_gather", "-")] * 2,
            Raise("_fsdp_param.py", "FSDPParam._init_extensions", "NotImplementedError",
                  "unsupported: as above", "-"),
            *[Raise("_fsdp_param.py", "FSDPParam._get_grad_inner_tensor", "AssertionError",
                    "internal: DTensor and SPMD-type gradient invariants", "-")] * 2,
            Raise("_fsdp_param_group.py", "FSDPParamGroup._validate_unused_param_grad_dtypes",
                  "ValueError", "unsupported: explicit Tensor.grad_dtype on parameters", "-"),
            Raise("_fsdp_param_group.py", "FSDPParamGroup._set_separate_reduce_scatter_group",
                  "AssertionError", "internal: mesh info type", "-"),
            Raise("_fsdp_state.py", "FSDPState._lazy_init", "RuntimeError", _MANUAL, _S),
            Raise("_fsdp_state.py", "FSDPState._pre_forward", "RuntimeError", _MANUAL, _S),
            Raise("_fsdp_state.py", "FSDPState._root_post_backward_final_callback",
                  "AssertionError", "internal: the mode is set when backward starts", "-"),
            *[Raise("_fsdp_state.py", "FSDPState._validate_finalize_backward", "RuntimeError",
                    _MANUAL, _S)] * 7,
            Raise("_fsdp_state.py", "FSDPState.wait_for_gradient_reduction", "RuntimeError",
                  _MANUAL, _S),
            Raise("_fsdp_state.py", "FSDPState._reset_iter_state", "RuntimeError", _CROSS_ROOT, "-"),
            *[Raise("_fully_shard.py", "FSDPModule.set_manual_backward_finalization",
                    "RuntimeError", _MANUAL, _S)] * 3,
            *[Raise("_fully_shard.py", "FSDPModule.finalize_backward", "RuntimeError",
                    _MANUAL, _S)] * 2,
            Raise("_fully_shard.py", "FSDPModule.finalize_backward", "RuntimeError",
                  _CROSS_ROOT, "-"),
        ],
        [
            Raise("_fsdp_collectives.py", "foreach_reduce", "AssertionError", ""),
            Raise("_fsdp_param.py", "FSDPParam._get_unsharded_dtensor_spec", "AssertionError", ""),
            Raise("_fsdp_param.py", "FSDPParam.unsharded_accumulated_grad_data",
                  "AssertionError", ""),
        ],
    ),
}


def raises_for(release: tuple[int, int]) -> list[Raise] | None:
    """Upstream's raises in ``release`` (``None`` for a release this file does not describe)."""
    if release[:2] == (2, 13):
        return list(UPSTREAM_RAISES)
    if release not in CHANGES:
        return None
    raises = raises_for(max(r for r in [(2, 13), *CHANGES] if r < release))
    added, removed = CHANGES[release]
    for gone in removed:
        site = (gone.file, gone.function, gone.cls)
        index = next(i for i, r in enumerate(raises) if (r.file, r.function, r.cls) == site)
        del raises[index]
    return raises + added
