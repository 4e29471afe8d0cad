"""``moefold inspect``: a model's total and active-per-token parameters with a per-layer breakdown.

    moefold inspect --recipe deepseek_v3          # a recipe (built on the meta device: no memory)
    moefold inspect --hf PATH                     # an HF directory: what it holds, and the model it describes
    moefold inspect --checkpoint PATH             # a moefold checkpoint, or a training checkpoint (iter_N / --save)
    moefold inspect --list                        # every recipe with its totals

For an HF directory the report describes what is there, not only what ``config.json`` announces: a
DeepSeek-V3 directory without MTP tensors (what ``save_pretrained`` writes) has no MTP modules, and the
weight files, tensor count, dtype, tokenizer and generation config present are listed. Errors are one
line (``--debug``: traceback).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moefold.models.recipes import RECIPES, get_recipe
from moefold.training.cli.errors import add_debug_argument, one_line_errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--recipe", choices=sorted(RECIPES), help="a recipe name")
    src.add_argument("--hf", metavar="DIR", help="an HF checkpoint directory (its config.json and tensors)")
    src.add_argument("--checkpoint", metavar="DIR", help="a moefold checkpoint or a training checkpoint directory")
    src.add_argument("--list", action="store_true", help="list every recipe with total/active parameters")
    parser.add_argument("--no-layers", action="store_true", help="omit the per-layer breakdown")
    parser.add_argument("--config", action="store_true", help="also print the ModelConfig")
    add_debug_argument(parser)


def describe_hf_dir(path: str | Path):
    """(ModelConfig of what the directory holds, lines describing its contents)."""
    from moefold.models.hf.assets import present_assets
    from moefold.models.hf.config_map import from_hf_config
    from moefold.models.hf.importer import load_config, open_hf_tensors, raw_hf_config, read_hf_config

    path = Path(path)
    announced = from_hf_config(read_hf_config(path), name=path.name)
    lines = []
    try:
        reader = open_hf_tensors(path)
    except ValueError:
        lines.append(f"  {path}: config.json only, no weights (the counts are the config's)")
        config = announced
    else:
        with reader:
            files = sorted(set(reader.weight_map.values()))
            size = sum((path / f).stat().st_size for f in files)
            dtypes = sorted({reader.dtype(n) for n in reader.names()})
            lines.append(f"  {path}: {len(reader.names())} tensors in {len(files)} safetensors file(s), "
                         f"{size / 2**30:.2f} GiB, dtype {', '.join(dtypes)}")
            if getattr(reader, "skipped", None):   # a multimodal directory read as its text model
                lines.append(f"  the text model of {raw_hf_config(path)['architectures'][0]}: its "
                             f"{len(reader.skipped)} vision-tower tensors are not read")
            config = load_config(path, reader)
            from moefold.models.hf.bounds import (
                SLACK,
                check_weights_match_config,
                floor_numel,
                held_numel,
                implied_numel,
            )
            from moefold.models.hf.fp8_blocks import fp8_reader

            weights = fp8_reader(reader, (config.extra or {}).get("hf_config"))
            held = held_numel(weights, config)
            if floor_numel(config) > SLACK * held:   # too big to even count (built on meta): refused, one line
                check_weights_match_config(path, config, weights, read_hf_config(path))
            implied = implied_numel(config)
            if implied != held:
                lines.append(f"  config.json describes {implied:,} parameters but the safetensors hold {held:,}: "
                             "they do not belong together (--load-hf / convert refuse them)")
            lines += _fp8_lines(reader, config)
    if announced.mtp_num_layers and not config.mtp_num_layers:
        lines.append(f"  config.json announces {announced.mtp_num_layers} MTP layer(s) (num_nextn_predict_layers) "
                     "but the directory holds no MTP tensors: no MTP modules")
    assets = present_assets(path)
    lines.append(f"  also: {', '.join(assets)}" if assets else "  no tokenizer or generation config")
    return config, lines


def _fp8_lines(reader, config) -> list[str]:
    """A block-quantised checkpoint: how many tensors are FP8 (their block and scale format) and packed FP4
    (DeepSeek-V4's experts), or the one-line refusal of a format moefold does not read."""
    from moefold.models.hf.fp8_blocks import ScaleFormat, fp8_reader
    from moefold.models.hf.importer import check_quantization

    block = check_quantization(config)
    if block is None:
        return []
    fp8 = fp8_reader(reader, (config.extra or {}).get("hf_config"))
    names = fp8.names()
    n4 = sum(map(fp8.is_fp4, names))
    n8 = sum(map(fp8.is_fp8, names)) - n4
    scales = "weight_scale_inv" if fp8.format.scale_fmt is ScaleFormat.FLOAT else "ue8m0 scales"
    lines = [f"  quantization_config: FP8 e4m3 in {block[0]}x{block[1]} blocks ({scales}): {n8} of {len(names)} "
             "tensors; read dequantised (w_fp8 * scale_inv)"]
    if n4:
        lines.append(f"  routed experts packed FP4 (e2m1, a ue8m0 scale per row and 32 values): {n4} tensors; read "
                     "dequantised")
    return lines


@one_line_errors("inspect")
def main(args: argparse.Namespace) -> int:
    from moefold.models.params import count_parameters, fmt_count, format_report

    if args.list:
        print(f"{'recipe':<22}{'total':>12}{'active':>12}")
        for name in RECIPES:
            r = count_parameters(get_recipe(name))
            print(f"{name:<22}{fmt_count(r.total):>12}{fmt_count(r.active):>12}")
        return 0
    lines: list[str] = []
    if args.recipe:
        config = get_recipe(args.recipe)
    elif args.hf:
        config, lines = describe_hf_dir(args.hf)
    else:
        from moefold.training.checkpoint.identity import describe_checkpoint
        from moefold.training.checkpoint.load_model import find_training_checkpoint, training_run_config

        ckpt = find_training_checkpoint(args.checkpoint)
        if ckpt is not None:
            config = training_run_config(ckpt).model
            lines = [f"  training checkpoint {describe_checkpoint(ckpt)}"]
        else:
            from moefold.models.checkpoint import load_config

            config = load_config(args.checkpoint)
    if args.config:
        print(config)
    print(format_report(count_parameters(config), per_layer=not args.no_layers))
    for line in lines:
        print(line)
    return 0
