"""Checks that ``moefold train`` runs in the launching process before any rank starts, so that a run never
trains for hours and then finds it cannot save, or starts ranks that fail on their first read.

- ``--run-dir`` and ``--save`` can be created and written (a file is created and removed in each);
- ``--save`` has room for a checkpoint (the estimate, from the model built on the meta device, is printed);
- ``--load`` exists, and holds a checkpoint, unless it is also ``--save`` (the auto-resume pattern: an empty
  or missing directory then means "start from scratch");
- every ``--data-path`` / ``--valid-data-path`` prefix opens (``.idx`` header, ``.bin`` size; moefold's or Megatron's
  format), its vocabulary (a Megatron corpus: its largest token id) fits the model, it holds at least one
  sample of ``--seq-length + 1`` tokens and, with ``--load-hf``, it was
  tokenised with the model's own ``tokenizer.json``.

Each failure is a ValueError with one line naming the flag, the path and what would be valid.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from moefold.training.checkpoint.files import checkpoint_dirs, fmt_bytes, free_bytes, is_checkpoint_dir
from moefold.training.config import RunConfig


def estimate_checkpoint_bytes(config: RunConfig) -> int:
    """Bytes of one checkpoint: the model's state dict (parameters in the run's dtype, buffers) plus the
    optimizer's state per parameter (exp_avg, exp_avg_sq, and the fp32 master of a bf16 model, in the dtypes
    of ``--exp-avg-dtype`` etc.). Builds the model on the meta device (no memory)."""
    import dataclasses

    import torch

    from moefold.models.decoder import MoEDecoder
    from moefold.parallel.dims import ParallelDims
    from moefold.training.observe.memory import state_parts

    options = config.options
    if config.train.bf16 and options.dtype != "bf16":
        options = dataclasses.replace(options, dtype="bf16")
    with torch.device("meta"):
        model = MoEDecoder(config.model, ParallelDims.single(), options)
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    _, _, optimizer_bytes = state_parts(options.dtype, config.train.optimizer_precision())
    return state + optimizer_bytes * sum(p.numel() for p in model.parameters())


def _writable_dir(path: str, flag: str) -> None:
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag} {path} cannot be created: {exc.strerror or exc}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=p, prefix=".moefold-write-test-") as f:
            f.write(b"x")
            f.flush()
    except OSError as exc:
        raise ValueError(f"{flag} {path} is not writable: {exc.strerror or exc}") from None


def _same_dir(a: str, b: str | None) -> bool:
    return b is not None and os.path.realpath(a) == os.path.realpath(b)


def _check_load(load: str, save: str | None) -> None:
    p = Path(load)
    if _same_dir(load, save):
        return   # resume if there is a checkpoint, else start: the --save --load pair of every restart
    if not p.exists():
        raise ValueError(f"--load {load}: no such directory (to resume from whatever a run saved, pass the same "
                         "directory as --save; to start from scratch, drop --load)")
    if not (p.is_dir() and (is_checkpoint_dir(p) or checkpoint_dirs(p))):
        raise ValueError(f"--load {load} holds no checkpoint (iter_NNNNNNN directories written by --save); to start "
                         "from scratch, drop --load")


def same_tokenizer(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Two tokenizer.json files define the same tokenizer (compared in the library's canonical form)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(a)).to_str() == Tokenizer.from_file(str(b)).to_str()


def _check_data(config: RunConfig) -> str:
    from moefold.training.data.corpus import max_token_id, open_indexed
    from moefold.training.data.megatron_order import parse_blend
    from moefold.training.data.tokenizer import tokenizer_path

    t, vocab = config.train, config.model.vocab_size
    if t.load_hf and not t.data_path:
        raise ValueError(f"--load-hf needs --data-path: a corpus prepared with the model's tokenizer (moefold "
                         f"prepare-data --tokenizer {Path(t.load_hf) / 'tokenizer.json'} ...)")
    model_tok = Path(t.load_hf) / "tokenizer.json" if t.load_hf else None
    hint = f" (moefold prepare-data --tokenizer {model_tok})" if model_tok else ""
    corpora, tokens = 0, 0
    for flag, items in (("--data-path", t.data_path), ("--valid-data-path", t.valid_data_path)):
        for prefix in parse_blend(list(items))[0] if items else []:   # Megatron's syntax, weighted or not
            try:
                data = open_indexed(prefix)
            except (OSError, ValueError) as exc:
                raise ValueError(f"{flag} {prefix}: {exc}") from None
            if getattr(data, "format", None) == "megatron":   # no vocabulary in the index: the largest id
                top = max_token_id(data)
                if top >= vocab:
                    raise ValueError(f"{flag} {prefix} holds token id {top} ({prefix}.bin, a Megatron corpus) but "
                                     f"the model has vocab_size={vocab}: pass --vocab-size {top + 1} or larger, or "
                                     f"the tokenizer the data was prepared with{hint}")
            elif data.vocab_size > vocab:
                raise ValueError(f"{flag} {prefix} was tokenised with a vocabulary of {data.vocab_size} ids "
                                 f"({prefix}.idx) but the model has vocab_size={vocab}: pass --vocab-size "
                                 f"{data.vocab_size} or prepare it with the model's tokenizer{hint}")
            if data.num_tokens < t.seq_length + 1:
                raise ValueError(f"{flag} {prefix}: {data.num_tokens} tokens, but one sample needs --seq-length + 1 "
                                 f"= {t.seq_length + 1}")
            data_tok = tokenizer_path(prefix)
            if model_tok is not None and model_tok.is_file() and data_tok.is_file() \
                    and not same_tokenizer(model_tok, data_tok):
                raise ValueError(f"{flag} {prefix} was tokenised with {data_tok}, not with the model's {model_tok}: "
                                 f"prepare it with moefold prepare-data --tokenizer {model_tok}")
            corpora, tokens = corpora + 1, tokens + data.num_tokens
    return f"data {corpora} corpus(es), {tokens} tokens, vocab fits {vocab}"


def preflight(config: RunConfig, say: Callable[[str], None] = print) -> None:
    """Run the checks of the module docstring; ValueError on the first failure, one summary line via ``say``."""
    t = config.train
    _writable_dir(t.run_dir, "--run-dir")
    done = []
    if t.save:
        _writable_dir(t.save, "--save")
        need, free = estimate_checkpoint_bytes(config), free_bytes(t.save)
        if free < need:
            raise ValueError(f"--save {t.save}: {fmt_bytes(free)} free, but one checkpoint of this model needs about "
                             f"{fmt_bytes(need)}; free some space or choose another --save")
        done.append(f"checkpoints about {fmt_bytes(need)} each, {fmt_bytes(free)} free in {t.save}")
    if t.load:
        _check_load(t.load, t.save)
    if t.data_path or t.valid_data_path or t.load_hf:
        done.append(_check_data(config))
    say("pre-flight: " + ("; ".join(done) if done else "ok"))
