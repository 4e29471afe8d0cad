"""``moefold train``'s flags for Megatron-LM users: the data order, the tokenizer, a Megatron checkpoint as the
starting weights, and the options that keep moefold's earlier conventions where Megatron's are the default."""

from __future__ import annotations

import argparse

from moefold.models.config import ModelConfig
from moefold.training.cli.field_flags import add_field_flags
from moefold.training.cli.model_flags import add_flags


def add_megatron_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("coming from Megatron-LM (data order, tokenizer, checkpoints, conventions)")
    add_field_flags(g, ("data_order", "mid_level_dataset_surplus", "tokenizer_type", "tokenizer_model", "vocab_file",
                        "merge_file", "make_vocab_size_divisible_by", "load_megatron", "lr_warmup_init",
                        "lr_warmup_skip_zero"))
    add_flags(g, "megatron")   # --moe-aux-loss-counts: ModelConfig's field (models.model_sections)


def megatron_model(args: argparse.Namespace) -> ModelConfig | None:
    """The architecture of ``--load-megatron`` when the checkpoint stores its args (None: it does not)."""
    from moefold.models.megatron import megatron_args, megatron_config
    from moefold.models.megatron.convert import find_megatron_checkpoint

    if megatron_args(find_megatron_checkpoint(args.load_megatron)) is None:
        return None
    return megatron_config(args.load_megatron)


def tokenizer_vocab(args: argparse.Namespace) -> int | None:
    """The model vocabulary Megatron's tokenizer flags give (padded), None without them."""
    if args.tokenizer_type is None:
        return None
    from moefold.training.data.megatron_tokenizer import megatron_tokenizer, padded_vocab_size

    tok = megatron_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file)
    return padded_vocab_size(tok.get_vocab_size(), args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
