"""Patch megatron-core (and nvidia-resiliency-ext's copy of its async writer) with trainfast.

Checkpoint write-item binning, and gradient-bucket planning: ``partition_buckets`` and the distributed
optimizer's range builders (``DistributedOptimizer._build_model_gbuf_range`` /
``_build_model_gbuf_param_range_map``), plus the layout functions of newer releases
(``group_params_for_buffers``, ``_compute_default_per_buffer_param_layout``,
``DistributedOptimizer._compute_per_buffer_param_layout`` / ``compute_full_param_layout``) where the
installed megatron-core has them; and the pipeline layer split (``get_num_layers_to_build``,
``get_transformer_layer_offset``, validated: a split Megatron would build wrongly raises).

>>> from trainfast.integrations import megatron
>>> megatron.patch()    # doctest: +SKIP
['megatron.core.dist_checkpointing.strategies.filesystem_async._split_by_size_and_type', ...]
"""

from __future__ import annotations

from trainfast.integrations._patching import Patcher, split_by_size_and_type_with

__all__ = ["patch", "unpatch", "is_patched", "patcher"]

patcher = Patcher("megatron-core")

patcher.add(
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "_split_by_size_and_type",
    split_by_size_and_type_with("chunk"),
)
patcher.add(
    "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async",
    "_split_by_size_and_type",
    split_by_size_and_type_with("chunk"),
    required=False,
)


# --- gradient-bucket planning (trainfast.buckets) ---
# Targets that the installed megatron-core lacks are skipped: 0.16.x computes the layout inside
# _ParamAndGradBuffer.__init__ (nothing separate to swap) and has the range builders and
# partition_buckets; newer releases add the layout functions below.
_PGB = "megatron.core.distributed.param_and_grad_buffer"
_DDP = "megatron.core.distributed.distributed_data_parallel"
_DISTOPT = "megatron.core.optimizer.distrib_optimizer"


def _source_of(function) -> str | None:
    """The function's source, or None where it cannot be read (then upstream is kept)."""
    import inspect

    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return None


def _partition_buckets(original):
    import inspect
    import re

    from trainfast import buckets

    names = list(inspect.signature(original).parameters)
    source = _source_of(original)
    if source is None:
        return None  # which form it is cannot be told: keep upstream
    if names == ["buffers", "force_single_bucket_group", "reduce_scatter_with_fp32_accumulation"]:
        # The three-argument form: megatron-core 0.17 still refuses two buffers of one param dtype
        # (`assert dtype not in dtype_to_buffer_map`); >= 0.18 refuses only a second uint8 buffer.
        distinct = re.search(r"^\s*assert\s+\w+\s+not\s+in\s+dtype_to_buffer_map\b", source, re.MULTILINE) is not None

        def three_argument_form(buffers, force_single_bucket_group=False, reduce_scatter_with_fp32_accumulation=False):
            return buckets.partition_buckets(buffers, force_single_bucket_group, reduce_scatter_with_fp32_accumulation,
                                             require_distinct_param_dtypes=distinct)

        return three_argument_form
    if names == ["buffers", "force_single_bucket_group"] and "reduce_scatter_with_fp32_accumulation" not in source:
        # megatron-core <= 0.16 (the two-argument form): buffers of one param dtype are refused too.
        def two_argument_form(buffers, force_single_bucket_group=False):
            return buckets.partition_buckets(buffers, force_single_bucket_group, require_distinct_param_dtypes=True)

        return two_argument_form
    return None  # a form whose semantics trainfast does not reproduce: keep upstream


def _build_model_gbuf_range(original):
    from trainfast.buckets import build_model_gbuf_range

    def replacement(cls, param_and_grad_buffer, bucket_index):
        return build_model_gbuf_range(param_and_grad_buffer, bucket_index, cls=cls)

    return replacement


def _build_model_gbuf_param_range_map(original):
    from trainfast.buckets import build_model_gbuf_param_range_map

    def replacement(cls, param_world_index_map, gbuf_world_range, bucket_offset):
        return build_model_gbuf_param_range_map(param_world_index_map, gbuf_world_range, bucket_offset)

    # the range builder may then answer through its cached index of the map (same result)
    replacement._trainfast_range_map = True
    return replacement


def _group_params_for_buffers(original):
    from trainfast.buckets import group_params_for_buffers

    def replacement(params, grad_reduce_in_fp32):
        return group_params_for_buffers(params, grad_reduce_in_fp32)

    return replacement


def _default_layout(original):
    from trainfast.buckets import compute_default_per_buffer_param_layout

    def replacement(params, bucket_size):
        return compute_default_per_buffer_param_layout(params, bucket_size)

    return replacement


def _per_buffer_layout(original):
    from trainfast.buckets import compute_per_buffer_param_layout

    def replacement(params, bucket_size, data_parallel_world_size, ddp_config, param_indices=None):
        return compute_per_buffer_param_layout(params, bucket_size, data_parallel_world_size, ddp_config, param_indices)

    return replacement


def _full_layout(original):
    from trainfast.buckets import compute_full_param_layout

    # Params of the layer-wise optimizer get their own BufferKey and the same layout, as upstream here
    # (LayerWiseDistributedOptimizer.compute_full_param_layout, its own layout, is not swapped).
    def replacement(params, bucket_size, data_parallel_world_size, ddp_config, expert_data_parallel_world_size=None):
        return compute_full_param_layout(
            params, bucket_size, data_parallel_world_size, ddp_config, expert_data_parallel_world_size
        )

    return replacement


for _module in (_PGB, _DDP, _DISTOPT):
    patcher.add(_module, "partition_buckets", _partition_buckets, required=False)
patcher.add(_DISTOPT, "DistributedOptimizer._build_model_gbuf_range", _build_model_gbuf_range, required=False)
patcher.add(
    _DISTOPT, "DistributedOptimizer._build_model_gbuf_param_range_map", _build_model_gbuf_param_range_map,
    required=False,
)
for _module in (_PGB, _DISTOPT, _DDP, "megatron.core.optimizer.layer_wise_optimizer"):
    patcher.add(_module, "group_params_for_buffers", _group_params_for_buffers, required=False)
patcher.add(_PGB, "_compute_default_per_buffer_param_layout", _default_layout, required=False)
patcher.add(_DISTOPT, "DistributedOptimizer._compute_per_buffer_param_layout", _per_buffer_layout, required=False)
patcher.add(_DISTOPT, "DistributedOptimizer.compute_full_param_layout", _full_layout, required=False)


# Replace / restore / query; patch() returns the "module.attribute" names it replaced.
patch = patcher.patch
unpatch = patcher.unpatch
is_patched = patcher.is_patched


def _megatron_release() -> tuple[int, int]:
    """(major, minor) of the installed megatron-core; (0, 0) when it cannot be told."""
    import re

    try:
        from megatron.core import package_info

        match = re.match(r"(\d+)\.(\d+)", str(package_info.__version__))
    except Exception:  # an install without package_info: treat as too old to patch
        return (0, 0)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


# Pipeline layer split: upstream's function and the modules that import it by name. Swapped only on
# megatron-core >= 0.16 (with its (config, vp_stage, pp_rank) form): the drop-ins validate splits as
# 0.16's TransformerConfig does, while older releases accept splits it refuses (0.15: no middle
# layers for middle stages) or read the ranks from parallel_state (0.12: no vp_stage argument).
def _pipeline_drop_in(name):
    def make(original):
        import inspect

        from trainfast import pipeline

        if list(inspect.signature(original).parameters) != ["config", "vp_stage", "pp_rank"] or \
                _megatron_release() < (0, 16):
            return None

        drop_in = getattr(pipeline, name)

        def replacement(config, vp_stage=None, pp_rank=None):
            return drop_in(config, vp_stage=vp_stage, pp_rank=pp_rank)

        return replacement

    return make


_SPEC_MODULES = (
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs",
    "megatron.core.post_training.modelopt.gpt.model_specs",
)
# Optional like the bucket targets: a release without them still gets the checkpoint patch.
patcher.add("megatron.core.transformer.transformer_block", "get_num_layers_to_build",
            _pipeline_drop_in("get_num_layers_to_build"), required=False)
patcher.add("megatron.core.transformer.transformer_layer", "get_transformer_layer_offset",
            _pipeline_drop_in("get_transformer_layer_offset"), required=False)
for _module in ("megatron.core.transformer.transformer_block", "megatron.core.transformer.multi_token_prediction",
                *_SPEC_MODULES):
    patcher.add(_module, "get_transformer_layer_offset", _pipeline_drop_in("get_transformer_layer_offset"),
                required=False)
for _module in _SPEC_MODULES:
    patcher.add(_module, "get_num_layers_to_build", _pipeline_drop_in("get_num_layers_to_build"), required=False)
