"""``moefold inspect``: a model's total and active-per-token parameters with a per-layer breakdown.

    moefold inspect --recipe deepseek_v3          # a recipe (built on the meta device: no memory)
    moefold inspect --hf PATH | --checkpoint PATH # the config of an HF or moefold checkpoint directory
    moefold inspect --list                        # every recipe with its totals
"""

from __future__ import annotations

import argparse

from moefold.models.recipes import RECIPES, get_recipe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--recipe", choices=sorted(RECIPES), help="a recipe name")
    src.add_argument("--hf", metavar="DIR", help="an HF checkpoint directory (its config.json)")
    src.add_argument("--checkpoint", metavar="DIR", help="a moefold checkpoint directory")
    src.add_argument("--list", action="store_true", help="list every recipe with total/active parameters")
    parser.add_argument("--no-layers", action="store_true", help="omit the per-layer breakdown")
    parser.add_argument("--config", action="store_true", help="also print the ModelConfig")


def main(args: argparse.Namespace) -> int:
    from moefold.models.params import count_parameters, fmt_count, format_report

    if args.list:
        print(f"{'recipe':<22}{'total':>12}{'active':>12}")
        for name in RECIPES:
            r = count_parameters(get_recipe(name))
            print(f"{name:<22}{fmt_count(r.total):>12}{fmt_count(r.active):>12}")
        return 0
    if args.recipe:
        config = get_recipe(args.recipe)
    elif args.hf:
        from moefold.models.hf.config_map import from_hf_config
        from moefold.models.hf.importer import read_hf_config

        config = from_hf_config(read_hf_config(args.hf), name=args.hf)
    else:
        from moefold.models.checkpoint import load_config

        config = load_config(args.checkpoint)
    if args.config:
        print(config)
    print(format_report(count_parameters(config), per_layer=not args.no_layers))
    return 0
