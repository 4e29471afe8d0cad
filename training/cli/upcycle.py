"""``moefold upcycle``: a dense checkpoint becomes the MoE of its family that computes the same logits.

    moefold upcycle Qwen3-8B qwen3-8b-8e --num-experts 8 --moe-router-topk 2          # HF Qwen3 -> Qwen3-MoE
    moefold upcycle Mistral-7B mistral-16e --num-experts 16 --moe-router-topk 4 --moe-ffn-hidden-size 7168
    moefold upcycle runs/dense/checkpoints mixtral-up --num-experts 8     # a moefold dense run (latest iter_N)

Every expert is a copy of the dense MLP, or with ``--moe-ffn-hidden-size`` a slice of it (granular
upcycling: the granularity ffn/moe-ffn must divide the experts and the top-k); see ``models.upcycle``.
The output is an HF directory (``--to moefold``: a moefold checkpoint) with the source's generation
config and tokenizer; continue with ``moefold train --load-hf OUT`` (or upcycle while loading:
``train --load-hf DENSE --moe-use-upcycling ...``). Runs in one process. Errors are one line.
"""

from __future__ import annotations

import argparse

from moefold.training.cli.convert import parse_size
from moefold.training.cli.errors import add_debug_argument, one_line_errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moefold.training.cli.model_flags import parse_layer_pattern

    parser.add_argument("source", help="dense HF directory (Qwen3, Mistral), moefold checkpoint or training checkpoint")
    parser.add_argument("output", help="output directory")
    parser.add_argument("--num-experts", type=int, required=True, help="experts per MoE layer")
    parser.add_argument("--moe-router-topk", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                        help="expert size (default: the dense FFN size; a divisor of it: granular upcycling)")
    parser.add_argument("--moe-layer-freq", type=parse_layer_pattern, default=1,
                        help='which layers become MoE: N or a 0/1 pattern such as "([0]*2+[1]*30)" (default: all)')
    parser.add_argument("--seed", type=int, default=0, help="router initialisation seed")
    parser.add_argument("--init-method-std", type=float, default=0.02, help="router initialisation std")
    parser.add_argument("--to", choices=("hf", "moefold"), default="hf", help="output format (default hf)")
    parser.add_argument("--max-shard-size", type=parse_size, default="5GB", help="largest output file")
    add_debug_argument(parser)


@one_line_errors("upcycle")
def main(args: argparse.Namespace) -> int:
    from moefold.models.checkpoint import save_checkpoint
    from moefold.models.decoder import MoEDecoder
    from moefold.models.hf.exporter import export_hf
    from moefold.models.options import ModelOptions
    from moefold.models.pretrained import pretrained_config
    from moefold.models.upcycle import load_upcycled_weights, upcycle_model, upcycled_config
    from moefold.training.checkpoint.load_model import (
        find_training_checkpoint,
        load_training_checkpoint,
        training_assets,
        training_run_config,
    )

    ckpt = find_training_checkpoint(args.source)
    dense_model, assets = None, None
    if ckpt is not None:
        dense_model = load_training_checkpoint(ckpt)
        dense, assets = dense_model.config, training_assets(ckpt, training_run_config(ckpt))
    else:
        dense, assets = pretrained_config(args.source), args.source
    config = upcycled_config(dense, args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size,
                             args.moe_layer_freq)
    model = MoEDecoder(config, options=ModelOptions(init_std=args.init_method_std))
    model.init_weights(args.seed)
    if dense_model is not None:
        upcycle_model(dense_model, model)
    else:
        load_upcycled_weights(model, args.source)
    if args.to == "hf":
        export_hf(model, args.output, max_shard_bytes=args.max_shard_size, assets_from=assets)
    else:
        save_checkpoint(model, args.output, max_shard_bytes=args.max_shard_size, assets_from=assets)
    g = dense.ffn_hidden_size // config.moe_ffn_hidden_size
    print(f"wrote {args.to} checkpoint of {config.name} to {args.output}: {config.num_experts} experts "
          f"(top-{config.moe_topk}, granularity {g}) in {sum(map(config.is_moe_layer, range(config.num_layers)))} "
          f"of {config.num_layers} layers")
    return 0
