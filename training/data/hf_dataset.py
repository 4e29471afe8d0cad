"""The documents of an HF ``datasets`` dataset on local disk: ``moefold prepare-data --hf-dataset PATH``.

PATH is one of

- a directory written by ``Dataset.save_to_disk`` (``state.json`` inside) or ``DatasetDict.save_to_disk``
  (``dataset_dict.json``; ``--hf-split`` picks the split, default ``train``): ``datasets.load_from_disk``,
  memory-mapped Arrow, its row count known;
- Parquet or JSON / JSON Lines files, or a directory holding them (searched recursively, sorted):
  ``datasets.load_dataset("parquet" | "json", data_files=..., streaming=True)``, read in one pass without an
  Arrow copy in the HF cache (the row count of Parquet files comes from their metadata).

Each row's ``--text-key`` field is one document; rows whose text is empty or null are skipped. Nothing is ever
downloaded: PATH must exist on this machine (a hub name is refused), and ``datasets`` runs offline
(``HF_DATASETS_OFFLINE``, ``HF_HUB_OFFLINE``). ``datasets`` is an optional dependency (``pip install
'moefold[datasets]'``), imported only here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATASETS_PIN = "datasets==5.2.0"
FORMATS = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}
_BATCH_ROWS = 1024


def import_datasets() -> Any:
    """The ``datasets`` module, offline; ImportError in one line naming the package otherwise."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(f"--hf-dataset needs the datasets package: pip install 'moefold[datasets]' (or "
                          f"{DATASETS_PIN}) ({exc})") from None
    datasets.config.HF_DATASETS_OFFLINE = datasets.config.HF_HUB_OFFLINE = True   # also when imported before
    return datasets


def _data_files(path: Path) -> tuple[str, list[Path]]:
    """(the builder, the files) of a Parquet / JSON path; ValueError when it is neither."""
    files = [path] if path.is_file() else sorted((f for f in path.rglob("*") if f.suffix in FORMATS and f.is_file()),
                                                 key=lambda f: f.relative_to(path).as_posix())
    kinds = {FORMATS.get(f.suffix) for f in files}
    if not files or None in kinds:
        raise ValueError(f"--hf-dataset {path}: neither a dataset saved with save_to_disk (state.json or "
                         f"dataset_dict.json inside) nor {', '.join(FORMATS)} files")
    if len(kinds) > 1:
        raise ValueError(f"--hf-dataset {path}: holds both Parquet and JSON files; give one format")
    return kinds.pop(), files


@dataclass
class HFDocuments:
    """The ``text_key`` texts of a dataset at ``path`` (the module docstring says which), in order; iterable
    more than once (a BPE trained on them reads them twice). ``total``: the rows, when known before reading."""

    path: Path
    text_key: str = "text"
    split: str = "train"
    total: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if not self.path.exists():
            raise FileNotFoundError(f"--hf-dataset {self.path}: no such file or directory (a local dataset: "
                                    "save_to_disk, Parquet or JSON; nothing is downloaded)")
        self._datasets = import_datasets()
        self._saved = (self.path / "state.json").is_file() or (self.path / "dataset_dict.json").is_file()
        if self._saved:
            self._table = self._load_saved()
            self.total = len(self._table)
        else:
            self._builder, self._files = _data_files(self.path)
            if self._builder == "parquet":
                import pyarrow.parquet as pq

                self.total = sum(pq.ParquetFile(f).metadata.num_rows for f in self._files)

    @property
    def where(self) -> str:
        return f"--hf-dataset {self.path}"

    def _load_saved(self) -> Any:
        ds = self._datasets.load_from_disk(str(self.path))
        if isinstance(ds, self._datasets.DatasetDict):
            if self.split not in ds:
                raise ValueError(f"--hf-dataset {self.path}: no split {self.split!r} (splits: {', '.join(ds)}); "
                                 "choose one with --hf-split")
            ds = ds[self.split]
        self._check_key(ds.column_names)
        return ds.select_columns([self.text_key])

    def _check_key(self, fields: list[str], where: str = "") -> None:
        if self.text_key not in fields:
            raise ValueError(f"--hf-dataset {self.path}{where}: no {self.text_key!r} field (fields: "
                             f"{', '.join(sorted(fields))}); choose it with --text-key")

    def _texts(self) -> Iterator[Any]:
        if self._saved:
            for batch in self._table.iter(batch_size=_BATCH_ROWS):
                yield from batch[self.text_key]
            return
        for f in self._files:   # one file at a time, so that an error names the file
            ds = self._datasets.load_dataset(self._builder, data_files=[str(f)], split="train", streaming=True)
            for i, row in enumerate(ds):
                if i == 0:
                    self._check_key(list(row), f" ({f.name})")
                yield row.get(self.text_key)

    def __iter__(self) -> Iterator[str]:
        for i, text in enumerate(self._texts()):
            if text is None or text == "":
                continue
            if not isinstance(text, str):
                raise ValueError(f"--hf-dataset {self.path}: row {i}: field {self.text_key!r} is a "
                                 f"{type(text).__name__}, expected a string")
            yield text
