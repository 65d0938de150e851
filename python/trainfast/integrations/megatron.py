"""Patch megatron-core (and nvidia-resiliency-ext's copy of its async writer) with trainfast.

>>> from trainfast.integrations import megatron
>>> megatron.patch()    # doctest: +SKIP
['megatron.core.dist_checkpointing.strategies.filesystem_async._split_by_size_and_type', ...]
"""

from __future__ import annotations

from trainfast.integrations._patching import Patcher

__all__ = ["patch", "unpatch", "is_patched", "patcher"]

patcher = Patcher("megatron-core")


def _split_by_size_and_type(original):
    from trainfast.checkpoint import split_by_size_and_type

    def replacement(bins, items):
        return split_by_size_and_type(bins, items, sizing="chunk")

    return replacement


patcher.add(
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "_split_by_size_and_type",
    _split_by_size_and_type,
)
patcher.add(
    "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async",
    "_split_by_size_and_type",
    _split_by_size_and_type,
    required=False,
)


# Replace / restore / query; patch() returns the "module.attribute" names it replaced.
patch = patcher.patch
unpatch = patcher.unpatch
is_patched = patcher.is_patched


# Pipeline layer split: upstream's function and the modules that import it by name.
def _pipeline_drop_in(name):
    def make(original):
        from trainfast import pipeline

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
patcher.add("megatron.core.transformer.transformer_block", "get_num_layers_to_build",
            _pipeline_drop_in("get_num_layers_to_build"))
patcher.add("megatron.core.transformer.transformer_layer", "get_transformer_layer_offset",
            _pipeline_drop_in("get_transformer_layer_offset"))
for _module in ("megatron.core.transformer.transformer_block", "megatron.core.transformer.multi_token_prediction",
                *_SPEC_MODULES):
    patcher.add(_module, "get_transformer_layer_offset", _pipeline_drop_in("get_transformer_layer_offset"),
                required=False)
for _module in _SPEC_MODULES:
    patcher.add(_module, "get_num_layers_to_build", _pipeline_drop_in("get_num_layers_to_build"), required=False)
