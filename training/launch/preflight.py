"""Checks that ``moefold train`` runs in the launching process before any rank starts, so that a run never
trains for hours and then finds it cannot save, or starts ranks that fail on their first read.

- ``--run-dir`` and ``--save`` can be created and written (a file is created and removed in each);
- ``--load`` exists, and holds a checkpoint, unless it is also ``--save`` (the auto-resume pattern: an empty
  or missing directory then means "start from scratch");
- ``--save`` has room for ``--keep-last`` + 1 checkpoints (the estimate, from the tensors the trainer saves);
- a ``--load`` resume keeps the model (any field) and the data order of the checkpoint it will take, whose
  pickled files (``.metadata``, RNG states, each tensor record's pickle) hold nothing but checkpoint data, each
  read only after its checksum matched;
- blend weights are positive and finite;
- every ``--data-path`` / ``--valid-data-path`` prefix opens (``.idx`` header, ``.bin`` size; moefold's or
  Megatron's format), its vocabulary and its largest token id (the ``.idx`` field, or a scan of older files and
  of Megatron's, which record neither) fit the model, it holds at least one sample of ``--seq-length + 1``
  tokens and, with ``--load-hf``, it was tokenised with the model's own ``tokenizer.json``; all corpora of a
  blend were tokenised with one tokenizer (the files' hash; moefold's recorded vocabularies agree);
- the optional packages a flag needs are installed (``--wandb-project``: wandb).

Each failure is a ValueError with one line naming the flag, the path and what would be valid.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from moefold.training.checkpoint.files import checkpoint_dirs, fmt_bytes, free_bytes, is_checkpoint_dir
from moefold.training.checkpoint.identity import checkpoint_run_id
from moefold.training.config import RunConfig


def estimate_checkpoint_bytes(config: RunConfig, world_size: int = 1) -> int:
    """Bytes one checkpoint of ``config`` takes on disk, from the tensors the trainer saves (never less): the model's
    state dict at its dtypes (parameters, buffers such as expert biases, MTP layers) plus each parameter's optimizer
    state at its own dtype (exp_avg, exp_avg_sq, and the fp32 master of a parameter kept in another dtype), each a
    DCP item with its framing and metadata (items counted for ``world_size`` ranks' shards), the RNG files and
    meta.json (``training.checkpoint.sharded.checkpoint_bytes``). Builds the model on the meta device."""
    import dataclasses

    import torch

    from moefold.models.decoder import MoEDecoder
    from moefold.parallel.dims import ParallelDims
    from moefold.training.checkpoint.sharded import checkpoint_bytes
    from moefold.training.observe.memory import optimizer_state_parts

    options = config.options
    dtype = "bf16" if config.train.bf16 else "fp16" if config.train.fp16 else options.dtype
    if options.dtype != dtype:
        options = dataclasses.replace(options, dtype=dtype)
    with torch.device("meta"):
        model = MoEDecoder(config.model, ParallelDims.single(), options)
    state = model.state_dict()
    data = sum(t.numel() * t.element_size() for t in state.values())
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    precision = config.train.optimizer_precision()
    items = len(state)
    for p in model.parameters():
        parts = [b for b in optimizer_state_parts(names.get(p.dtype, "fp32"), precision).values() if b]
        data += p.numel() * sum(parts)
        items += len(parts)
    # a rank holds at most one piece of each tensor per dimension of it, usually one (an upper bound of the items)
    return checkpoint_bytes(data, items * world_size, world_size)


def writable_dir(path: str, flag: str) -> None:
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


def refuse_megatron_load(load: str | None) -> None:
    """``--load`` of a Megatron-LM checkpoint (its ``--save`` directory or one ``iter_N``/``release``): ValueError
    pointing to ``--load-megatron``, which starts a fresh run from its weights (a resume continues moefold's own
    checkpoints only: Megatron's carry neither moefold's optimizer shards nor its run id)."""
    if not load or not Path(load).is_dir():
        return
    from moefold.models.megatron.convert import is_megatron_checkpoint

    if is_megatron_checkpoint(load):
        raise ValueError(f"--load {load} is a Megatron-LM checkpoint; start a new run from its weights with "
                         f"--load-megatron {load} (--load resumes moefold's own checkpoints)")


def _check_load(load: str, save: str | None) -> None:
    refuse_megatron_load(load)
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
    from moefold.training.data.corpus import open_indexed
    from moefold.training.data.megatron_order import parse_blend
    from moefold.training.data.tokenizer import tokenizer_path

    t, vocab = config.train, config.model.vocab_size
    if t.load_hf and not t.data_path:
        raise ValueError(f"--load-hf needs --data-path: a corpus prepared with the model's tokenizer (moefold "
                         f"prepare-data --tokenizer {Path(t.load_hf) / 'tokenizer.json'} ...)")
    model_tok = Path(t.load_hf) / "tokenizer.json" if t.load_hf else None
    hint = f" (moefold prepare-data --tokenizer {model_tok})" if model_tok else ""
    corpora, tokens = 0, 0
    tokenizers: list[tuple[str, str, Path]] = []
    vocabs: list[tuple[str, str, int]] = []
    for flag, items in (("--data-path", t.data_path), ("--valid-data-path", t.valid_data_path)):
        prefixes, weights = parse_blend(list(items)) if items else ([], None)   # Megatron's syntax
        for w, prefix in zip(weights or (), prefixes):
            if not 0 < w < float("inf"):
                raise ValueError(f"{flag}: the weight {w:g} of {prefix} must be a positive finite number (a blend "
                                 "is W1 PREFIX1 W2 PREFIX2 ...; drop a corpus instead of weighting it 0)")
        for prefix in prefixes:
            try:
                data = open_indexed(prefix)
            except (OSError, ValueError) as exc:
                raise ValueError(f"{flag} {prefix}: {exc}") from None
            megatron = getattr(data, "format", None) == "megatron"   # records no vocabulary: its largest id
            if not megatron and data.vocab_size > vocab:
                raise ValueError(f"{flag} {prefix} was tokenised with a vocabulary of {data.vocab_size} ids "
                                 f"({prefix}.idx) but the model has vocab_size={vocab}: pass --vocab-size "
                                 f"{data.vocab_size} or prepare it with the model's tokenizer{hint}")
            largest = data.largest_token_id(progress=True)
            if largest >= vocab:
                kind = ", a Megatron corpus" if megatron else ""
                raise ValueError(f"{flag} {prefix} holds token id {largest} ({prefix}.bin{kind}), outside the "
                                 f"model's vocab_size={vocab}: pass --vocab-size {largest + 1} or prepare the data "
                                 f"with the model's tokenizer{hint}")
            if data.num_tokens < t.seq_length + 1:
                raise ValueError(f"{flag} {prefix}: {data.num_tokens} tokens, but one sample needs --seq-length + 1 "
                                 f"= {t.seq_length + 1}")
            data_tok = tokenizer_path(prefix)
            if model_tok is not None and model_tok.is_file() and data_tok.is_file() \
                    and not same_tokenizer(model_tok, data_tok):
                raise ValueError(f"{flag} {prefix} was tokenised with {data_tok}, not with the model's {model_tok}: "
                                 f"prepare it with moefold prepare-data --tokenizer {model_tok}")
            corpora, tokens = corpora + 1, tokens + data.num_tokens
            tokenizers.append((flag, prefix, data_tok))
            if megatron:
                continue   # its vocab_size is its largest id + 1, which differs between corpora of one tokenizer
            if vocabs and data.vocab_size != vocabs[0][2]:
                raise ValueError(f"{flag} {prefix} was tokenised with a vocabulary of {data.vocab_size} ids, "
                                 f"{vocabs[0][0]} {vocabs[0][1]} with {vocabs[0][2]}: another tokenizer; prepare every "
                                 "corpus of a blend (and the validation data) with one tokenizer")
            vocabs.append((flag, prefix, data.vocab_size))
    _check_same_tokenizer(tokenizers)
    return f"data {corpora} corpus(es), {tokens} tokens, vocab fits {vocab}"


def tokenizer_digest(path: Path) -> str:
    """sha256 of a tokenizer file's bytes."""
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_same_tokenizer(corpora: list[tuple[str, str, Path]]) -> None:
    """Every corpus of a blend (and the validation data) was tokenised with the same tokenizer: the files next
    to them (``PREFIX.tokenizer.json``, written by ``prepare-data``) have the same hash, or, where the bytes
    differ, define the same tokenizer. Corpora without a tokenizer file are not compared."""
    known = [(flag, prefix, tok) for flag, prefix, tok in corpora if tok.is_file()]
    if len(known) < 2:
        return
    flag0, prefix0, tok0 = known[0]
    digest0 = tokenizer_digest(tok0)
    for flag, prefix, tok in known[1:]:
        if tokenizer_digest(tok) != digest0 and not same_tokenizer(tok0, tok):
            raise ValueError(f"{flag} {prefix} was tokenised with {tok} (sha256 {tokenizer_digest(tok)[:12]}), "
                             f"{flag0} {prefix0} with {tok0} (sha256 {digest0[:12]}): another tokenizer, so the same "
                             "id means different text; prepare every corpus with one tokenizer (moefold prepare-data "
                             f"--tokenizer {tok0})")


def _check_resume_before_start(config: RunConfig, ckpt: Path) -> None:
    """The checkpoint the resume will take (``training.launch.claim.resume_checkpoint``): its small files' sizes and
    checksums first (a damaged one is never parsed: the ranks fall back past it, or an explicit one was refused by
    the claim), then its model and data order against this run's (meta.json), then its pickled files read the safe
    way: ``.metadata``, the RNG states, and the pickle of every tensor record in the shards (not their data)."""
    from moefold.training.checkpoint.files import check_before_reading
    from moefold.training.checkpoint.resume import check_resume
    from moefold.training.checkpoint.safe_load import check_shard_records, load_tensors, read_dcp_metadata
    from moefold.training.checkpoint.sharded import read_meta

    if check_before_reading(ckpt):
        return   # damaged (the ranks say how, and fall back)
    try:
        check_resume(read_meta(ckpt), config, str(ckpt), log=lambda _m: None)
    except (TypeError, KeyError, AttributeError, IndexError) as exc:   # a field of the wrong type or missing
        raise ValueError(f"{ckpt / 'meta.json'} does not describe a run ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}); pass --load of another checkpoint, or move "
                         "this one away") from None
    read_dcp_metadata(ckpt / ".metadata")   # a payload is refused here, in one line, before any rank starts
    for rng in sorted((ckpt / "rng").glob("*.pt")):
        load_tensors(rng)
    check_shard_records(ckpt)


def _check_packages(config: RunConfig) -> None:
    """Optional packages that the flags need."""
    import importlib.util

    if config.train.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ValueError(f"--wandb-project {config.train.wandb_project} needs the wandb package: pip install wandb "
                         "(WANDB_MODE=offline logs without network), or drop --wandb-project")


def preflight(config: RunConfig, say: Callable[[str], None] = print, world_size: int = 1,
              resume_from: Path | None = None) -> None:
    """Run the checks of the module docstring; ValueError on the first failure, one summary line via ``say``.
    ``resume_from``: the checkpoint the resume will take (``training.launch.claim``), checked against this run."""
    t = config.train
    _check_packages(config)
    writable_dir(t.run_dir, "--run-dir")
    done = []
    if t.save:
        writable_dir(t.save, "--save")
        one, free = estimate_checkpoint_bytes(config, world_size), free_bytes(t.save)
        # this run's own checkpoints already there count as room: keep-last replaces them
        mine = sum(f.stat().st_size for d in checkpoint_dirs(t.save) if checkpoint_run_id(d) == t.run_id
                   for f in d.rglob("*") if f.is_file()) if t.run_id else 0
        need = (t.keep_last + 1) * one
        if free + mine < need:
            have = f"{fmt_bytes(free)} free" + (f" + {fmt_bytes(mine)} of this run's checkpoints" if mine else "")
            raise ValueError(f"--save {t.save}: {have}, but --keep-last {t.keep_last} + 1 checkpoints of this model "
                             f"need about {t.keep_last + 1} x {fmt_bytes(one)} = {fmt_bytes(need)}; free some space, "
                             "lower --keep-last or choose another --save")
        done.append(f"checkpoints about {fmt_bytes(one)} each, room for --keep-last {t.keep_last} + 1: "
                    f"{fmt_bytes(free)} free in {t.save}")
    if t.load:
        _check_load(t.load, t.save)
        if resume_from is not None:
            _check_resume_before_start(config, resume_from)
    if t.data_path or t.valid_data_path or t.load_hf:
        done.append(_check_data(config))
    say("pre-flight: " + ("; ".join(done) if done else "ok"))
