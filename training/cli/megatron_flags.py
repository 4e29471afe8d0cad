"""``moefold train``'s flags for Megatron-LM users: the data order, the tokenizer, a Megatron checkpoint as the
starting weights, and the options that keep moefold's earlier conventions where Megatron's are the default."""

from __future__ import annotations

import argparse

from moefold.models.config import ModelConfig
from moefold.moe.router_config import AUX_LOSS_COUNTS
from moefold.training.data.megatron_tokenizer import TOKENIZER_TYPES


def add_megatron_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("coming from Megatron-LM (data order, tokenizer, checkpoints, conventions)")
    g.add_argument("--data-order", choices=("moefold", "megatron"), default="moefold",
                   help="moefold (default): sample i never depends on --train-iters, so a longer run continues a "
                        "shorter one; megatron: Megatron-Core GPTDataset's exact samples for the same --data-path, "
                        "--split (default 969,30,1 as Megatron-LM), --seed, --seq-length, --train-iters, "
                        "--global-batch-size, --eval-interval and --eval-iters")
    g.add_argument("--mid-level-dataset-surplus", type=float, default=0.005,
                   help="--data-order megatron: Megatron's extra samples per blended corpus (default 0.005)")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="the run's tokenizer (through HF tokenizers): the model's vocabulary (padded as Megatron "
                        "pads it) and the tokenizer exports and `moefold generate` use")
    g.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer: a directory with tokenizer.json")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the tokenizer's vocabulary to a multiple of this x tp (Megatron's; default 128)")
    g.add_argument("--load-megatron", metavar="DIR", default=None,
                   help="start from a Megatron-Core torch_dist checkpoint (a Megatron-LM --save directory or one "
                        "iter_N): its args are the model (or --recipe and model flags when it stores none), every "
                        "rank reads its slices; instead of --recipe")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="learning rate of step 0; warmup is lr-warmup-init + (lr - lr-warmup-init) * step / warmup "
                        "(Megatron's; default 0)")
    g.add_argument("--lr-warmup-skip-zero", action="store_true",
                   help="moefold's earlier warmup, lr * (step + 1) / warmup: the first step already learns")
    g.add_argument("--moe-aux-loss-counts", choices=AUX_LOSS_COUNTS, default=None,
                   help="token counts of the balancing losses: topk (default; Megatron-Core, DeepSeek-V3's "
                        "indicator: a plain top-k of the scores) or dispatched (moefold's earlier: the routing with "
                        "expert bias and group limit, so the loss balances what the experts receive)")


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


TRAIN_FIELDS = ("data_order", "mid_level_dataset_surplus", "tokenizer_type", "tokenizer_model", "vocab_file",
                "merge_file", "make_vocab_size_divisible_by", "load_megatron", "lr_warmup_init", "lr_warmup_skip_zero")
