"""Megatron-Core interop: ``torch_dist`` checkpoints of a GPTModel with MoE layers, read into and written from
moefold models at any layout (``convert``), Megatron-LM's ``args`` <-> ``ModelConfig`` with every argument read,
refused or not the model's (``args``), the three layer layouts Megatron-Core stores (``layouts``), the name mapping
(``mapping``) and the safe DCP reader (``dcp_io``).
Model code only: imports torch, moefold.parallel/dense/moe and models; never megatron itself."""

from moefold.models.megatron.args import config_from_megatron, megatron_args_from_config
from moefold.models.megatron.convert import (
    export_megatron,
    find_megatron_checkpoint,
    import_megatron,
    is_megatron_checkpoint,
    load_megatron_weights,
    megatron_args,
    megatron_config,
)

__all__ = ["import_megatron", "load_megatron_weights", "export_megatron", "megatron_config", "megatron_args",
           "config_from_megatron", "megatron_args_from_config", "find_megatron_checkpoint", "is_megatron_checkpoint"]
