"""``moefold train`` checks the file system, the data and the numbers before any rank starts: an unwritable or
full --save, a missing --load, unreadable data or data whose vocabulary does not fit, non-finite rates. A
failure inside the run is one line at world 1 too."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

from moefold.training.cli import build_parser
from moefold.training.cli import main as cli_main
from moefold.training.cli.train import config_from_args
from moefold.training.data.indexed import IndexedDatasetWriter
from moefold.training.launch.preflight import estimate_checkpoint_bytes
from tests.training.trainer_common import tiny_data

# the module, not the function of the same name that moefold.training.launch exports
preflight_module = importlib.import_module("moefold.training.launch.preflight")

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = ["train", "--recipe", "qwen3_moe_tiny", "--num-layers", "2", "--vocab-size", "256", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1", "--device", "cpu",
        "--no-balance-report"]


@pytest.fixture
def no_ranks(monkeypatch) -> list:
    """Replaces the launcher: records a start instead of training."""
    started = []
    monkeypatch.setattr("moefold.training.cli.train.run_ranks", lambda *a, **k: started.append(k))
    return started


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("data") / "tiny"
    with IndexedDatasetWriter(prefix, 256) as writer:
        for row in tiny_data(8):
            writer.add_document(row)
    return str(prefix)


def _fails(capsys, args: list[str], message: str) -> str:
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moefold train: error: ") and message in err, err
    return err


def _read_only_dir(tmp_path: Path) -> Path:
    """A directory this process cannot write to (chmod; root ignores modes, so then a read-only system one)."""
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    for candidate in (d, Path("/sys"), Path("/proc")):
        try:
            (candidate / ".moefold-probe").mkdir()
        except OSError:
            return candidate
        (candidate / ".moefold-probe").rmdir()
    pytest.skip("no read-only directory available")


def test_an_unwritable_or_full_save_directory_fails_before_training(capsys, no_ranks, tmp_path, corpus, monkeypatch):
    base = [*BASE, "--data-path", corpus, "--run-dir", str(tmp_path / "run")]
    ro = _read_only_dir(tmp_path)
    save = ro / "ckpt"
    _fails(capsys, [*base, "--save", str(save)], f"--save {save} cannot be created: ")
    _fails(capsys, [*base, "--run-dir", str(ro / "run"), "--no-save"], f"--run-dir {ro / 'run'} cannot be created")
    _fails(capsys, [*base, "--save", str(ro)], f"--save {ro} is not writable: ")
    monkeypatch.setattr(preflight_module, "free_bytes", lambda _path: 100 * 1024)
    one = estimate_checkpoint_bytes(config_from_args(build_parser("train").parse_args(base)))
    _fails(capsys, [*base, "--save", str(tmp_path / "ckpt")],
           f"--save {tmp_path / 'ckpt'}: 100.0 KiB free, but --keep-last 2 + 1 checkpoints of this model need about "
           f"3 x {one / 2**20:.1f} MiB = {3 * one / 2**20:.1f} MiB; free some space, lower --keep-last or choose "
           "another --save")
    # room for keep-last checkpoints but not keep-last + 1: refused before training, not after the Nth save
    monkeypatch.setattr(preflight_module, "free_bytes", lambda _path: int(2.5 * one))
    _fails(capsys, [*base, "--save", str(tmp_path / "ckpt")], "--keep-last 2 + 1 checkpoints of this model need")
    monkeypatch.setattr(preflight_module, "free_bytes", lambda _path: 3 * one)
    assert no_ranks == []
    assert cli_main([*base, "--save", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / "run3")]) == 0
    assert len(no_ranks) == 1
    monkeypatch.undo()


def test_the_checkpoint_estimate_is_printed_and_close_to_a_real_checkpoint(capsys, tmp_path, corpus):
    save = tmp_path / "ckpt"
    args = [*BASE, "--data-path", corpus, "--run-dir", str(tmp_path / "run"), "--save", str(save)]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    need = estimate_checkpoint_bytes(config_from_args(build_parser("train").parse_args(args)))
    assert f"pre-flight: checkpoints about {need / 2**20:.1f} MiB each" in out, out
    ckpt = save / "iter_0000001"
    actual = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    # every file of the checkpoint (DCP's framing and metadata, RNG state, meta.json, manifest): never less, and
    # within 2% (the estimate before made from the tensors alone was 5% low)
    assert 1.0 <= need / actual < 1.02, (need, actual)


def test_load_must_exist_unless_it_is_the_save_directory(capsys, no_ranks, tmp_path, corpus):
    base = [*BASE, "--data-path", corpus, "--run-dir", str(tmp_path / "run")]
    missing = tmp_path / "typo"
    _fails(capsys, [*base, "--load", str(missing)], f"--load {missing}: no such directory")
    (tmp_path / "empty").mkdir()
    _fails(capsys, [*base, "--load", str(tmp_path / "empty")], "holds no checkpoint (iter_NNNNNNN directories")
    assert no_ranks == []
    # the auto-resume pattern: --save D --load D, D not there yet
    assert cli_main([*base, "--save", str(tmp_path / "new"), "--load", str(tmp_path / "new")]) == 0
    assert len(no_ranks) == 1


def test_bad_data_fails_before_training(capsys, no_ranks, tmp_path, corpus):
    base = [*BASE, "--run-dir", str(tmp_path / "run"), "--no-save"]
    _fails(capsys, [*base, "--data-path", str(tmp_path / "nothing")], f"--data-path {tmp_path / 'nothing'}: ")
    with IndexedDatasetWriter(tmp_path / "big", 1000) as writer:
        writer.add_document(list(range(999)))
    _fails(capsys, [*base, "--data-path", str(tmp_path / "big")],
           f"--data-path {tmp_path / 'big'} was tokenised with a vocabulary of 1000 ids ({tmp_path / 'big'}.idx) "
           "but the model has vocab_size=256: pass --vocab-size 1000")
    truncated = tmp_path / "cut"
    for ext in (".bin", ".idx"):
        Path(f"{truncated}{ext}").write_bytes(Path(f"{corpus}{ext}").read_bytes())
    os.truncate(f"{truncated}.bin", 100)
    _fails(capsys, [*base, "--data-path", str(truncated)], "cut.bin: 100 bytes, but cut.idx says")
    _fails(capsys, [*base, "--data-path", corpus, "--seq-length", "1000"], "one sample needs --seq-length + 1 = 1001")
    assert no_ranks == []


@pytest.mark.parametrize("flag,value", [("--lr", "inf"), ("--lr", "nan"), ("--lr", "-1e-3"), ("--min-lr", "nan"),
                                        ("--weight-decay", "inf"), ("--clip-grad", "nan"), ("--adam-eps", "0"),
                                        ("--adam-beta2", "1.0"), ("--seed", "-1"),
                                        ("--distributed-timeout-minutes", "0"), ("--heartbeat-timeout", "inf")])
def test_non_finite_or_negative_numbers_are_refused(capsys, no_ranks, tmp_path, flag, value):
    _fails(capsys, [*BASE, "--run-dir", str(tmp_path), "--no-save", f"{flag}={value}"], f"{flag}=")
    assert no_ranks == []


def test_a_failure_inside_a_world_1_run_is_one_line_with_the_traceback_in_the_run_directory(capsys, tmp_path):
    bad = tmp_path / "bad"
    with IndexedDatasetWriter(bad, 512) as writer:
        for _ in range(4):
            writer.add_document([300] * 40)
    raw = bytearray(Path(f"{bad}.idx").read_bytes())
    raw[40:48] = (256).to_bytes(8, "little")   # the header says 256 and its largest id 255: pre-flight passes, the
    raw[48:56] = (255).to_bytes(8, "little")   # first sample fails
    Path(f"{bad}.idx").write_bytes(bytes(raw))
    run = tmp_path / "run"
    assert cli_main([*BASE, "--data-path", str(bad), "--run-dir", str(run), "--no-save"]) == 1
    err = capsys.readouterr().err.splitlines()
    line = [x for x in err if x.startswith("moefold train:")]
    assert line == [f"moefold train: {bad}.bin: token id 300 in sample 0 is outside the vocabulary of 256 that "
                    f"{bad}.idx declares (corrupt data, or a .bin from another tokenizer); re-run `moefold "
                    f"prepare-data` (full traceback: {run / 'error.log'})"], err
    assert "Traceback (most recent call last)" in (run / "error.log").read_text()


def _v1(prefix: Path) -> None:
    """Rewrite ``prefix.idx`` in format version 1 (no largest-id field): what older prepare-data wrote."""
    raw = Path(f"{prefix}.idx").read_bytes()
    Path(f"{prefix}.idx").write_bytes(raw[:8] + (1).to_bytes(8, "little") + raw[16:48] + raw[56:])


def test_token_ids_outside_the_vocabulary_fail_before_training(capsys, no_ranks, tmp_path, monkeypatch):
    """An id >= the model's vocabulary (a .bin from another tokenizer under a header claiming a smaller vocabulary)
    is found before any rank starts: from the .idx field prepare-data now records, or, for an older .idx without
    it, by a chunked scan of the .bin (it used to surface when the sample was drawn, 196 steps in)."""
    from moefold.training.data import indexed

    prefix = tmp_path / "wide"
    with IndexedDatasetWriter(prefix, 512) as writer:   # ids up to 299 ...
        for row in tiny_data(16):
            writer.add_document(row)
        writer.add_document([299] * 40)
    raw = bytearray(Path(f"{prefix}.idx").read_bytes())
    raw[40:48] = (256).to_bytes(8, "little")   # ... under a header that claims a vocabulary of 256
    Path(f"{prefix}.idx").write_bytes(bytes(raw))
    assert indexed.IndexedDataset(prefix).max_token_id == 299   # recorded by the writer
    base = [*BASE, "--data-path", str(prefix), "--run-dir", str(tmp_path / "run"), "--no-save"]
    message = (f"--data-path {prefix} holds token id 299 ({prefix}.bin), outside the model's vocab_size=256: pass "
               "--vocab-size 300")
    _fails(capsys, base, message)
    _v1(prefix)
    old = indexed.IndexedDataset(prefix)
    assert old.max_token_id is None and old.num_tokens == 16 * 33 + 40
    monkeypatch.setattr(indexed, "_SCAN_CHUNK", 64)   # several chunks of the memmap
    assert old.largest_token_id(progress=False) == 299
    _fails(capsys, base, message)
    assert no_ranks == []


def test_blends_of_different_tokenizers_and_missing_packages_fail_before_training(capsys, no_ranks, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from moefold.training.data.tokenizer import tokenizer_path

    prefixes = []
    for name, vocab in (("a", {"x": 0, "y": 1}), ("b", {"y": 0, "x": 1})):   # same size, other ids
        prefix = tmp_path / name
        with IndexedDatasetWriter(prefix, 256) as writer:
            for row in tiny_data(8):
                writer.add_document(row)
        tok = Tokenizer(models.WordLevel(vocab, unk_token="x"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(tokenizer_path(prefix)))
        prefixes.append(str(prefix))
    base = [*BASE, "--run-dir", str(tmp_path / "run"), "--no-save"]
    _fails(capsys, [*base, "--data-path", "0.5", prefixes[0], "0.5", prefixes[1]],
           f"--data-path {prefixes[1]} was tokenised with {tokenizer_path(prefixes[1])} (sha256 ")
    # the same tokenizer written twice (identical bytes): fine
    tokenizer_path(prefixes[1]).write_bytes(tokenizer_path(prefixes[0]).read_bytes())
    assert cli_main([*base, "--data-path", "0.5", prefixes[0], "0.5", prefixes[1]]) == 0
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        _fails(capsys, [*base, "--data-path", prefixes[0], "--wandb-project", "p", "--run-dir",
                        str(tmp_path / "run2")], "--wandb-project p needs the wandb package: pip install wandb")


def test_megatron_corpora_are_bounded_by_their_largest_id(capsys, no_ranks, tmp_path):
    """Megatron's index records no vocabulary: each corpus's largest id (a cached scan) must fit the model, and a
    blend of Megatron corpora whose largest ids differ (one tokenizer, other texts) is not taken for two
    tokenizers."""
    from moefold.training.data.megatron_indexed import MegatronIndexedDatasetWriter

    prefixes = []
    for name, top in (("a", 200), ("b", 255)):
        prefix = tmp_path / name
        with MegatronIndexedDatasetWriter(prefix, 256) as writer:
            for row in tiny_data(8, vocab=200):
                writer.add_document(row)
            writer.add_document([top] * 40)
        prefixes.append(str(prefix))
    base = [*BASE, "--run-dir", str(tmp_path / "run"), "--no-save"]
    assert cli_main([*base, "--data-path", "0.5", prefixes[0], "0.5", prefixes[1]]) == 0
    assert len(no_ranks) == 1
    message = (f"--data-path {prefixes[1]} holds token id 255 ({prefixes[1]}.bin, a Megatron corpus), outside the "
               "model's vocab_size=200: pass --vocab-size 256")
    _fails(capsys, [*base, "--vocab-size", "200", "--data-path", prefixes[1], "--run-dir", str(tmp_path / "r2")],
           message)
    assert len(no_ranks) == 1
