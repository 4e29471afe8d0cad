"""Loading a checkpoint never runs code from it: a pickle payload in an RNG file or in DCP's ``.metadata`` (its
manifest recomputed, so the checkpoint looks intact) is refused in one line by ``train --load`` (before any rank
starts), ``convert`` and ``generate``, and the payload never runs; so is metadata declaring a pickled-bytes entry
(which DCP would hand to an unrestricted ``torch.load``). No ``weights_only=False`` anywhere in moefold."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from moefold.training.checkpoint.files import write_manifest
from moefold.training.checkpoint.safe_load import UnsafeCheckpointError, read_dcp_metadata
from moefold.training.cli import main as cli_main
from tests.training.launch.cli_runs import TINY, corpus

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[3]


class Payload:
    """Unpickling it writes ``path``: proof that the file's code ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({str(self.path)!r}, 'w').write('ran')",))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("safe")
    data = ["--data-path", str(corpus(root / "data"))]
    assert cli_main(["train", *TINY, *data, "--train-iters", "2", "--run-dir", str(root / "run"), "--save",
                     str(root / "ckpt")]) == 0
    return root / "ckpt", data


def _crafted(src: Path, dst: Path, where: str, marker: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    ckpt = dst / "iter_0000002"
    if where == "rng":
        state = torch.load(ckpt / "rng" / "rank00000.pt", weights_only=True)
        torch.save({**state, "extra": Payload(marker)}, ckpt / "rng" / "rank00000.pt")
    elif where == ".metadata":
        md = read_dcp_metadata(ckpt / ".metadata")
        md.planner_data = Payload(marker)
        (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    else:   # a "bytes" entry: DCP's planner would torch.load(weights_only=False) its payload
        md = read_dcp_metadata(ckpt / ".metadata")
        md.state_dict_metadata["model.norm.weight"] = BytesStorageMetadata()
        (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    (ckpt / "manifest.json").unlink()
    write_manifest(ckpt, None)   # an intact-looking checkpoint: sizes and crc32s match
    return ckpt


@pytest.mark.parametrize("where", ["rng", ".metadata", "bytes entry"])
def test_a_crafted_checkpoint_is_refused_and_its_payload_never_runs(trained, tmp_path, capsys, where):
    save, data = trained
    marker = tmp_path / "PWNED"
    ckpt = _crafted(save, tmp_path / "ckpt", where, marker)
    what = {"rng": r"rng/rank00000\.pt holds more than tensors \(it asks to load (builtins\.)?exec\)",
            ".metadata": r"\.metadata asks to load builtins\.exec",
            "bytes entry": r"\.metadata asks to load torch\.distributed\.checkpoint\.metadata\.BytesStorageMetadata",
            }[where]
    commands = {
        "train": ["train", *TINY, *data, "--train-iters", "3", "--run-dir", str(tmp_path / "run"), "--save",
                  str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")],
        "convert": ["convert", str(ckpt), str(tmp_path / "out")],
        "generate": ["generate", "--checkpoint", str(ckpt), "--prompt-ids", "1", "2", "--max-new-tokens", "2"],
    }
    for name, argv in commands.items():
        if where == "rng" and name == "convert":
            continue   # convert reads the weights only, never an RNG state
        assert cli_main(argv) == 2, name
        err = capsys.readouterr().err
        if name == "generate":   # it names the checkpoint it takes first, on a line of its own
            assert err.startswith(f"moefold generate: using {ckpt} (iteration 2 of run "), err
            err = err.split("\n", 1)[1]
        assert err.count("\n") == 1 and err.startswith(f"moefold {name}: error: "), (name, err)
        assert re.search(what, err) and "Traceback" not in err, (name, err)
        assert not marker.exists(), f"{name} ran the payload"


def test_no_unsafe_torch_load_in_moefold():
    sources = [p for d in ("parallel", "precision", "dense", "dispatch", "moe", "models", "pipeline", "training",
                           "planner", "tools")
               for p in (ROOT / d).rglob("*.py")]
    offenders = [str(p.relative_to(ROOT)) for p in sources if "weights_only=False" in p.read_text()]
    assert offenders == []


def test_truncated_metadata_is_damage_not_a_payload(trained, tmp_path):
    import shutil

    shutil.copytree(trained[0], tmp_path / "ckpt")
    md = tmp_path / "ckpt" / "iter_0000002" / ".metadata"
    md.write_bytes(md.read_bytes()[:100])
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata is not readable checkpoint metadata"):
        read_dcp_metadata(md)
