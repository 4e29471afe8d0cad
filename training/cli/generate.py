"""``moefold generate``: see what a model writes.

    moefold generate --hf Qwen3-30B-A3B --prompt "The capital of France is"            # greedy
    moefold generate --checkpoint runs/x/checkpoints --prompt "def fib(n):" --max-new-tokens 64 \\
        --temperature 0.8 --top-p 0.95 --seed 0                                       # top-p sampling
    moefold generate --checkpoint runs/x/checkpoints/iter_0000300 --prompt-ids 1 15 27

One process (world 1, the GPU when there is one), a KV cache (``models.generate``). The tokenizer is the
model's: ``tokenizer.json`` of the HF directory, of the training run's ``hf_assets`` or ``--tokenizer FILE``;
generation stops at the ``eos_token_id`` of ``generation_config.json`` (else ``config.json``) unless
``--ignore-eos``. Errors are one line (``--debug``: traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moefold.training.cli.errors import add_debug_argument, one_line_errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", metavar="DIR", help="an HF model directory")
    src.add_argument("--checkpoint", metavar="DIR", help="a training checkpoint (iter_N, or its --save directory: "
                                                         "the latest) or a moefold checkpoint")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="text to continue (repeat for several prompts)")
    prompt.add_argument("--prompt-ids", type=int, nargs="+", help="token ids to continue (no tokenizer needed)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens whose "
                                                                 "probability reaches p (nucleus sampling)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--tokenizer", metavar="FILE", help="a tokenizer.json (default: the model's)")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="precision the model runs in")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto: the GPU when CUDA is available")
    add_debug_argument(parser)


def eos_token_ids(assets: Path | None, hf_config: dict | None) -> list[int]:
    """The stop tokens: ``generation_config.json``'s eos_token_id, else ``config.json``'s (int or list)."""
    for source in ([json.loads((assets / "generation_config.json").read_text())]
                   if assets is not None and (assets / "generation_config.json").is_file() else []) + [hf_config or {}]:
        eos = source.get("eos_token_id")
        if eos is not None:
            return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return []


@one_line_errors("generate")
def main(args: argparse.Namespace) -> int:
    import torch

    from moefold.models.generate import generate
    from moefold.models.options import ModelOptions
    from moefold.training.checkpoint.load_model import describe_source, load_model

    path = args.hf or args.checkpoint
    if args.hf and not (Path(args.hf) / "config.json").is_file():
        raise ValueError(f"--hf {args.hf}: no config.json (not an HF model directory; use --checkpoint for "
                         "moefold and training checkpoints)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine")
    used = describe_source(path)
    if used:   # which iter_N of which run (stderr: stdout is the generated text)
        print(f"moefold generate: using {used}", file=sys.stderr)
    model, assets = load_model(path, options=ModelOptions(sequence_parallel=False, dtype=args.dtype), device=device)
    tokenizer = None
    if args.prompt:
        tok_file = Path(args.tokenizer) if args.tokenizer else assets / "tokenizer.json" if assets else None
        if tok_file is None or not tok_file.is_file():
            raise ValueError(f"{path}: no tokenizer.json with the model; pass --tokenizer FILE or --prompt-ids")
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tok_file))
        prompts = [tokenizer.encode(p).ids for p in args.prompt]
    else:
        prompts = [args.prompt_ids]
    eos = [] if args.ignore_eos else eos_token_ids(assets, model.config.extra.get("hf_config"))
    vocab = model.config.vocab_size
    for ids in prompts:
        if not ids or max(ids) >= vocab or min(ids) < 0:
            raise ValueError(f"prompt ids {ids[:8]}... must be non-empty and in [0, vocab_size={vocab})")
        out = generate(model, torch.tensor([ids]), args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, eos_token_id=eos, seed=args.seed)[0].tolist()
        print(tokenizer.decode(out, skip_special_tokens=False) if tokenizer is not None else " ".join(map(str, out)))
        print("---")
    return 0
