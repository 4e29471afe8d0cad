"""A resume from a save directory whose files were mutated at random (issue 47's fuzz test): a fixed list of seeds,
each flipping, truncating or overwriting bytes at a random offset of one file (the newest checkpoint's
``.metadata``, shard, manifest or ``meta.json``, sometimes with its manifest recomputed so that it looks intact;
the tracker; ``run.json``). Each resume, decided as ``moefold train`` decides it (the claim and the pre-flight
checks, then the rank's ``Trainer.load``), either falls back with a named reason or stops with one line; it never
starts from scratch, never runs anything from a file and never opens a file outside its folder."""

from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path

import pytest

from moefold.parallel.dims import ParallelDims
from moefold.training.checkpoint.files import CheckpointError, write_manifest
from moefold.training.checkpoint.identity import RUN_FILE, TRACKER, read_tracker
from moefold.training.cli import main as cli_main
from moefold.training.cli.train import config_from_args, train_parser
from moefold.training.launch.claim import claim_run
from moefold.training.launch.preflight import preflight
from moefold.training.trainer import Trainer
from tests.training.launch.cli_runs import TINY, corpus

pytestmark = pytest.mark.usefixtures("one_thread")

SEEDS = range(16)
NEWEST = "iter_0000003"
TARGETS = (".metadata", "__0_0.distcp", "manifest.json", "meta.json", TRACKER, RUN_FILE)
_events: list[tuple[str, str]] | None = None   # what the audit hook records while a resume is decided


def _audit(event: str, args: tuple) -> None:
    if _events is not None and event in ("open", "os.system", "subprocess.Popen", "os.exec", "os.posix_spawn"):
        _events.append((event, str(args[0]) if args else ""))


sys.addaudithook(_audit)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("run")
    data = ["--data-path", str(corpus(root / "data" / "tiny"))]
    code = cli_main(["train", *TINY, *data, "--train-iters", "3", "--save-interval", "1", "--keep-last", "3",
                     "--run-dir", str(root / "run"), "--save", str(root / "save"), "--no-progress"])
    assert code == 0 and read_tracker(root / "save") == 3
    return root, data


def _mutate(path: Path, rng: random.Random) -> str:
    raw = bytearray(path.read_bytes())
    at = rng.randrange(max(len(raw), 1))
    how = rng.choice(["flip", "truncate", "overwrite"])
    if how == "flip" and raw:
        raw[at] ^= 1 << rng.randrange(8)
    elif how == "truncate":
        raw = raw[:at]
    else:
        raw[at:at + 8] = bytes(rng.randrange(256) for _ in range(8))
    path.write_bytes(bytes(raw))
    return f"{how} at byte {at}"


@pytest.mark.parametrize("seed", SEEDS)
def test_a_mutated_save_directory_falls_back_or_stops_in_one_line(saved, tmp_path, seed):
    global _events
    src, data = saved
    shutil.copytree(src / "save", tmp_path / "save")
    save, rng = tmp_path / "save", random.Random(seed)
    target = TARGETS[seed % len(TARGETS)]   # every file kind, each under several seeds
    path = save / target if target in (TRACKER, RUN_FILE) else save / NEWEST / target
    what = f"seed {seed}: {target} {_mutate(path, rng)}"
    if target not in (TRACKER, RUN_FILE, "manifest.json") and rng.random() < 0.5:
        write_manifest(save / NEWEST, None)   # crafted: it looks intact
        what += ", manifest recomputed"
    args = train_parser().parse_args([*TINY, *data, "--train-iters", "5", "--run-dir", str(tmp_path / "run"),
                                      "--save", str(save), "--load", str(save)])
    said: list[str] = []
    _events = []
    try:
        try:   # what moefold train decides before any rank starts
            config, claim = claim_run(config_from_args(args), default_save=False, say=said.append)
            try:
                preflight(config, say=said.append, resume_from=claim.resume_from)
            finally:
                claim.release()
        except (ValueError, RuntimeError) as exc:
            assert "\n" not in str(exc) and str(exc), (what, str(exc))
            return
        trainer = Trainer(config, ParallelDims.single(), log=said.append)   # the rank
        try:
            loaded = trainer.load(save)
        except (CheckpointError, ValueError) as exc:
            assert "\n" not in str(exc), (what, str(exc))
            return
        assert loaded, (what, said)   # never from scratch
        if trainer.iteration < 3:   # a fallback says why
            assert any(w in m for m in said for w in ("damaged", "missing", "does not hold")), (what, said)
    finally:
        events, _events = _events, None
        assert not [e for e in events if e[0] != "open"], (what, events)   # nothing from a file ran
        outside = [p for e, p in events if "pytest-of" in p and not p.startswith((str(tmp_path), str(src)))]
        assert not outside, (what, outside)   # nothing read outside the folders
