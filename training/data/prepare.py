"""``moefold prepare-data``: text / JSONL files, or an HF ``datasets`` dataset -> ``PREFIX.bin`` + ``PREFIX.idx`` +
``PREFIX.tokenizer.json``.

Inputs are files or directories (searched recursively for ``--glob`` patterns, sorted, so the output
is deterministic). A ``.jsonl`` file holds one document per line (the ``--text-key`` field, default
``text``); any other file is one document. ``--hf-dataset PATH`` reads a local dataset instead
(``save_to_disk``, Parquet, JSON: ``training.data.hf_dataset``), one document per row. Empty documents are
skipped; every document gets the EOS separator appended. Tokenisation runs in ``--workers`` processes
(documents stay in input order), with a progress bar on a terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from moefold.training.data.indexed import IndexedDatasetWriter
from moefold.training.data.megatron_indexed import MegatronIndexedDatasetWriter
from moefold.training.data.tokenizer import eos_id, load_tokenizer, tokenizer_path, train_bpe

if TYPE_CHECKING:
    from tokenizers import Tokenizer

DEFAULT_GLOBS = ("*.txt", "*.jsonl", "*.md")
FORMATS = ("moefold", "megatron")
JSONL_SUFFIXES = (".jsonl",)
_CHUNK_DOCS = 64


@dataclass(frozen=True)
class PrepareStats:
    prefix: str
    num_docs: int
    num_tokens: int
    vocab_size: int
    tokenizer: str


def expand_inputs(inputs: Sequence[str | os.PathLike], globs: Sequence[str] = DEFAULT_GLOBS) -> list[Path]:
    """Files as given; directories expanded recursively to their files matching ``globs``, sorted."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = {f for g in globs for f in p.rglob(g) if f.is_file()}
            files.extend(sorted(found, key=lambda f: f.relative_to(p).as_posix()))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"input {p}: no such file or directory")
    return files


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc})") from exc


def _jsonl_documents(path: Path, json_key: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not UTF-8 ({exc})") from exc
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object per line, got {type(record).__name__}")
            if json_key not in record:
                raise ValueError(f"{path}:{lineno}: no {json_key!r} field (fields present: "
                                 f"{sorted(record)}); choose the field with --text-key")
            text = record[json_key]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: field {json_key!r} is a {type(text).__name__}, expected a string")
            yield text


def iter_documents(files: Iterable[Path], json_key: str = "text") -> Iterator[str]:
    """Every non-empty document of ``files`` in order (see the module docstring for the formats)."""
    for path in files:
        if path.suffix in JSONL_SUFFIXES:
            yield from (t for t in _jsonl_documents(path, json_key) if t)
        else:
            text = _read_text(path)
            if text:
                yield text


class Documents(Protocol):
    """A corpus read as documents, in order, as often as needed; ``total``: how many rows, when known up front;
    ``where``: how to name it in messages."""

    total: int | None

    @property
    def where(self) -> str: ...

    def __iter__(self) -> Iterator[str]: ...


@dataclass(frozen=True)
class FileDocuments:
    """The documents of text / JSONL files (``iter_documents``)."""

    files: tuple[Path, ...]
    json_key: str = "text"
    total: int | None = None

    @property
    def where(self) -> str:
        return f"the {len(self.files)} input file(s)"

    def __iter__(self) -> Iterator[str]:
        return iter_documents(self.files, self.json_key)


def _chunks(docs: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for d in docs:
        chunk.append(d)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# Set once per worker process by the Pool initializer (the tokenizer is not picklable per task).
_WORKER: dict = {}


def _init_worker(tokenizer_json: str, eos: int) -> None:
    from tokenizers import Tokenizer

    _WORKER["tok"] = Tokenizer.from_str(tokenizer_json)
    _WORKER["eos"] = eos


def _encode_chunk(chunk: list[str]) -> list[np.ndarray]:
    return _encode_with(_WORKER["tok"], _WORKER["eos"], chunk)


def _encode_with(tok, eos: int, chunk: list[str]) -> list[np.ndarray]:
    out = []
    for enc in tok.encode_batch(chunk, add_special_tokens=False):
        ids = np.empty(len(enc.ids) + 1, dtype=np.int64)
        ids[:-1] = enc.ids
        ids[-1] = eos
        out.append(ids)
    return out


def _encoded(tok, docs: Iterable[str], workers: int) -> Iterator[list[np.ndarray]]:
    eos = eos_id(tok)
    if workers <= 1:
        for chunk in _chunks(docs, _CHUNK_DOCS):
            yield _encode_with(tok, eos, chunk)
        return
    import multiprocessing as mp

    # The parent may have used the tokenizer's thread pool (training); children must not use theirs
    # after fork. Setting the variable also silences the library's fork warning.
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        with mp.get_context(method).Pool(workers, _init_worker, (tok.to_str(), eos)) as pool:
            yield from pool.imap(_encode_chunk, _chunks(docs, _CHUNK_DOCS))
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def _finish(bar) -> None:
    """End a bar at 100%: its total was the rows known up front, and empty rows are no documents."""
    if bar.total is not None and bar.n != bar.total:
        bar.total = bar.n
        bar.refresh()


def prepare(inputs: Sequence[str | os.PathLike], output_prefix: str | os.PathLike, *,
            vocab_size: int | None = None, tokenizer: str | os.PathLike | Tokenizer | None = None,
            json_key: str = "text", workers: int = 1, globs: Sequence[str] = DEFAULT_GLOBS,
            progress: bool | None = None, files: Sequence[Path] | None = None, documents: Documents | None = None,
            format: str = "moefold") -> PrepareStats:
    """Tokenise ``inputs`` into ``output_prefix``.{bin,idx} and save the tokenizer next to them.

    Exactly one of ``vocab_size`` (train a byte-level BPE on the inputs) and ``tokenizer`` (a
    ``tokenizer.json``) is given. ``files``, when given, replaces the expansion of ``inputs``; ``documents``
    (e.g. ``hf_dataset.HFDocuments``) replaces both. ``progress``: progress bars (None: when stderr is a
    terminal). ``tokenizer`` may also be a loaded ``tokenizers.Tokenizer`` (Megatron's tokenizer flags).
    ``format``: "moefold" (``MOEFIDX``) or "megatron" (``MMIDIDX``, what Megatron's ``tools/preprocess_data.py
    --append-eod`` writes: one sequence per document, uint16 below 65500 ids, else int32). Raises ValueError for
    an empty corpus or malformed input, naming the file (and line for JSONL).
    """
    if (vocab_size is None) == (tokenizer is None):
        raise ValueError("give exactly one of --vocab-size (train a BPE) and --tokenizer (load tokenizer.json)")
    if format not in FORMATS:
        raise ValueError(f"--format {format!r}; valid: {', '.join(FORMATS)}")
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1")
    if documents is None:
        files = list(files) if files is not None else expand_inputs(inputs, globs)
        where = ", ".join(str(i) for i in inputs) or "(no inputs)"
        if not files:
            raise ValueError(f"empty corpus: no input files found in {where} (directories are searched for "
                             f"{list(globs)})")
        documents = FileDocuments(tuple(files), json_key)
        where = f"{documents.where} in {where}"
    else:
        where = documents.where
    from tqdm import tqdm

    disable = None if progress is None else not progress   # tqdm: None = only on a terminal
    num_docs = documents.total
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        tok = tokenizer
    elif tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    else:
        counter = [0]
        read = tqdm(total=documents.total, unit="doc", desc="training the BPE", disable=disable, file=sys.stderr)

        def counted() -> Iterator[str]:
            for d in documents:
                counter[0] += 1
                read.update()
                yield d

        with read:
            tok = train_bpe(counted(), vocab_size)
            _finish(read)
        num_docs = counter[0]
        if num_docs == 0:
            raise ValueError(f"empty corpus: {where} hold no non-empty document")
    prefix = os.fspath(output_prefix)
    vocab = tok.get_vocab_size()
    writer_cls = MegatronIndexedDatasetWriter if format == "megatron" else IndexedDatasetWriter
    with writer_cls(prefix, vocab) as writer:
        bar = tqdm(total=num_docs, unit="doc", desc=f"tokenising -> {Path(prefix).name}", disable=disable,
                   file=sys.stderr)
        with bar:
            for encoded in _encoded(tok, iter(documents), workers):
                for ids in encoded:
                    writer.add_document(ids)
                bar.update(len(encoded))
            _finish(bar)
        if writer.num_docs == 0:
            raise ValueError(f"empty corpus: {where} hold no non-empty document")
        stats = PrepareStats(prefix, writer.num_docs, writer.num_tokens, vocab, str(tokenizer_path(prefix)))
        tok.save(str(tokenizer_path(prefix)))  # before the .idx appears: a present .idx means a complete set
    return stats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("input (one of --input, --hf-dataset)")
    one = src.add_mutually_exclusive_group(required=True)
    one.add_argument("--input", nargs="+", metavar="PATH",
                     help="text / .jsonl files or directories (searched recursively for --glob)")
    one.add_argument("--hf-dataset", metavar="PATH",
                     help="a local HF datasets dataset: a save_to_disk directory, or Parquet / JSON files (or a "
                          "directory of them); one document per row; needs pip install 'moefold[datasets]'")
    src.add_argument("--hf-split", default="train", help="--hf-dataset of several splits (a DatasetDict): the one "
                                                          "to read")
    src.add_argument("--text-key", "--json-key", dest="text_key", default="text",
                     help="the field holding each document's text (JSONL files, --hf-dataset)")
    src.add_argument("--glob", nargs="+", default=list(DEFAULT_GLOBS), help="--input: file patterns inside "
                                                                             "directories")
    tok = parser.add_argument_group("tokenizer (one of --vocab-size, --tokenizer, --tokenizer-type)"
                                    ).add_mutually_exclusive_group()
    tok.add_argument("--vocab-size", type=int, help="train a byte-level BPE of this size on the inputs")
    tok.add_argument("--tokenizer", help="use this HF tokenizer.json, e.g. a model's own (the document separator "
                                         "is its <|endoftext|>, </s> or other end-of-text token)")
    out = parser.add_argument_group("output")
    out.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.tokenizer.json")
    out.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)),
                     help="tokenising processes (default: min(8, cpus))")
    out.add_argument("--no-progress", action="store_true",
                     help="no progress bar (it is only drawn when stderr is a terminal anyway)")
    add_megatron_arguments(parser)


def add_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    from moefold.training.data.megatron_tokenizer import TOKENIZER_TYPES

    m = parser.add_argument_group("Megatron-LM's format and tokenizer flags")
    m.add_argument("--format", choices=FORMATS, default="moefold",
                   help="moefold (default): MOEFIDX .idx, which records the vocabulary size pre-flight checks "
                        "against the model; megatron: Megatron's MMIDIDX pair, as tools/preprocess_data.py "
                        "--append-eod writes it (Megatron-LM reads it; so does moefold train)")
    m.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="Megatron's tokenizer choice, through HF tokenizers (instead of --tokenizer/--vocab-size)")
    m.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer: a directory with tokenizer.json "
                                                           "(or the file); nothing is downloaded")
    m.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: GPT-2's vocab.json")
    m.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: GPT-2's merges.txt")


def main(args: argparse.Namespace) -> int:
    try:
        documents = None
        if args.hf_dataset is not None:
            from moefold.training.data.hf_dataset import HFDocuments

            documents = HFDocuments(args.hf_dataset, text_key=args.text_key, split=args.hf_split)
        tokenizer = args.tokenizer
        if args.tokenizer_type is not None:
            if args.tokenizer or args.vocab_size:
                raise ValueError("--tokenizer-type replaces --tokenizer / --vocab-size; give one of them")
            from moefold.training.data.megatron_tokenizer import megatron_tokenizer

            tokenizer = megatron_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file)
        elif args.tokenizer is None and args.vocab_size is None:
            raise ValueError("give --vocab-size (train a BPE), --tokenizer (a tokenizer.json) or --tokenizer-type "
                             "(Megatron's flags)")
        stats = prepare(args.input or [], args.output_prefix, vocab_size=args.vocab_size, tokenizer=tokenizer,
                        json_key=args.text_key, workers=args.workers, globs=args.glob,
                        progress=False if args.no_progress else None, documents=documents, format=args.format)
    except (ValueError, OSError, ImportError) as exc:   # messages name the file (and line); a traceback adds nothing
        print(f"moefold prepare-data: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {stats.prefix}.bin/.idx: {stats.num_docs} documents, {stats.num_tokens} tokens, "
          f"vocab {stats.vocab_size}, tokenizer {stats.tokenizer}")
    if args.vocab_size is not None and stats.vocab_size < args.vocab_size:
        # BPE stops when the corpus has no pair left to merge; the model's vocabulary is the next command's flag
        print(f"note: the corpus gave {stats.vocab_size:,} tokens of the --vocab-size {args.vocab_size:,} asked for; "
              f"train with --vocab-size {stats.vocab_size} (--vocab-size {args.vocab_size} would build an embedding "
              f"and output layer {args.vocab_size / stats.vocab_size:.1f}x the size this tokenizer can use)")
    return 0
