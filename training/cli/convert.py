"""``moefold convert``: HF checkpoint <-> moefold checkpoint, and training checkpoints -> either.

    moefold convert HF_DIR OUT_DIR                        # HF -> moefold (auto-detected from config.json)
    moefold convert MOEFOLD_DIR OUT_DIR                   # moefold -> HF (sharded safetensors + index + config.json)
    moefold convert RUN/checkpoints/iter_0000300 OUT_DIR  # a training checkpoint (any layout) -> HF
    moefold convert RUN/checkpoints OUT_DIR --to hf       # the latest complete one under a --save directory
    moefold convert HF_DIR OUT_DIR --to hf --expert-format fused   # HF -> HF, re-sharded / fused experts
    moefold convert --recipe mixtral_tiny --seed 0 OUT_DIR --to hf # a freshly initialised recipe
    moefold convert --from megatron MEGATRON_SAVE OUT_DIR          # a Megatron-Core torch_dist checkpoint -> moefold
    moefold convert MOEFOLD_DIR OUT_DIR --to megatron              # -> a Megatron-LM checkpoint (OUT/release)

Runs in one process (world 1); a checkpoint of any parallel layout can be loaded from the output
(``models.checkpoint.load_checkpoint`` / ``models.hf.importer.import_hf``). The HF ``config.json``
keeps every field of the one the model was imported from (also through ``train --load-hf``), and the
generation config and tokenizer files are copied along. Errors are one line (``--debug``: traceback).
"""

from __future__ import annotations

import argparse

from moefold.models.hf.assets import present_assets
from moefold.models.recipes import RECIPES
from moefold.training.cli.errors import add_debug_argument, one_line_errors

_UNITS = {"KB": 2**10, "MB": 2**20, "GB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '64KB' / '1000' (bytes) -> bytes."""
    number, factor = text, 1
    for unit, unit_bytes in _UNITS.items():
        if text.upper().endswith(unit):
            number, factor = text[: -len(unit)], unit_bytes
            break
    try:
        size = int(float(number) * factor)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"--max-shard-size {text!r} is not a positive size; use e.g. 5GB, 500MB, "
                                         "64KB or a number of bytes")
    return size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", nargs="?", help="HF, moefold or training checkpoint directory (omit with --recipe)")
    parser.add_argument("output", help="output directory")
    parser.add_argument("--recipe", choices=sorted(RECIPES), help="convert a freshly initialised recipe instead")
    parser.add_argument("--seed", type=int, default=0, help="init seed with --recipe")
    parser.add_argument("--from", dest="source_format", choices=("auto", "megatron"), default="auto",
                        help="megatron: the source is a Megatron-Core torch_dist checkpoint (a Megatron-LM --save "
                             "directory or one iter_N of it); the model is its args in common.pt, or --recipe with "
                             "model flags when it has none (default auto: HF, moefold or training checkpoint)")
    parser.add_argument("--to", choices=("moefold", "hf", "megatron"), default=None,
                        help="output format (default: moefold for an HF or Megatron source, else hf); megatron writes "
                             "OUT/latest_checkpointed_iteration.txt and OUT/release/ (torch_dist), which Megatron-LM "
                             "loads with --load OUT")
    parser.add_argument("--expert-format", choices=("per_expert", "fused"), default="per_expert",
                        help="HF routed-expert naming: per expert (what save_pretrained writes) or fused")
    parser.add_argument("--max-shard-size", type=parse_size, default="5GB", help="largest output file, e.g. 5GB, 500MB")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                        help="dtype of the written tensors (routers/expert bias stay fp32; default: fp32, or the "
                             "training run's)")
    add_debug_argument(parser)


@one_line_errors("convert")
def main(args: argparse.Namespace) -> int:
    from moefold.models.checkpoint import save_checkpoint
    from moefold.models.decoder import MoEDecoder
    from moefold.models.hf.exporter import export_hf
    from moefold.models.options import ModelOptions
    from moefold.models.recipes import get_recipe

    options = None if args.dtype is None else ModelOptions(dtype=args.dtype)
    assets = None
    if args.source_format == "megatron":
        from moefold.models.megatron import import_megatron, megatron_args

        if args.source is None:
            raise ValueError("--from megatron needs the checkpoint directory")
        from moefold.models.megatron.convert import find_megatron_checkpoint

        ckpt = find_megatron_checkpoint(args.source)
        has_args = megatron_args(ckpt) is not None
        if args.recipe and has_args:
            raise ValueError(f"--recipe {args.recipe}: {ckpt} stores its Megatron-LM args (the model); drop --recipe")
        if not args.recipe and not has_args:
            raise ValueError(f"{ckpt}: no Megatron-LM args in common.pt; give --recipe NAME (the architecture)")
        model = import_megatron(args.source, options=options, config=get_recipe(args.recipe) if args.recipe else None)
        kind = "megatron"
    elif args.recipe:
        if args.source:
            raise ValueError("give either a source directory or --recipe, not both")
        model = MoEDecoder(get_recipe(args.recipe), options=options)
        model.init_weights(args.seed)
        kind = "recipe"
    elif args.source is None:
        raise ValueError("a source directory (or --recipe) is required")
    else:
        from moefold.models.pretrained import pretrained_kind
        from moefold.training.checkpoint.load_model import find_training_checkpoint, load_model

        model, assets = load_model(args.source, options=options)   # one-line error for what it cannot read
        kind = "training checkpoint" if find_training_checkpoint(args.source) else pretrained_kind(args.source)
    to = args.to or ("moefold" if kind in ("hf", "megatron") else "hf")
    size = args.max_shard_size  # bytes (parse_size)
    if to == "megatron":
        from moefold.models.megatron import export_megatron

        export_megatron(model, args.output)
    elif to == "hf":
        export_hf(model, args.output, expert_format=args.expert_format, max_shard_bytes=size, assets_from=assets)
    else:
        save_checkpoint(model, args.output, max_shard_bytes=size, assets_from=assets)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {to} checkpoint of {model.config.name} ({n / 1e6:.1f}M parameters) from {kind} to {args.output}"
          + (f" (with {', '.join(present_assets(args.output))})" if present_assets(args.output) else ""))
    return 0
