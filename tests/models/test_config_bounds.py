"""An HF ``config.json`` that does not belong to its weights (10^7 experts, a hidden size of 10^9) is refused in one
line naming the field before anything is allocated: by ``convert``, ``generate``, ``train --load-hf`` and
``import_hf``. The commands run in a child limited to 3 GiB of address space, so a regression fails with an
allocation error instead of taking the machine (10^7 experts of this model are ~60 GB)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from moefold.models.hf.bounds import check_weights_match_config, held_numel, implied_numel
from moefold.models.hf.importer import load_config
from moefold.models.tensor_io import TensorReader
from tests.load import communicate
from tests.models.hf_tiny import FAMILIES, save_hf

transformers = pytest.importorskip("transformers")
LIMIT = 3 * 2**30


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def _moefold(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moefold.training.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_limited)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_config_implies_exactly_its_tensors(tmp_path, family):
    save_hf(family, tmp_path)
    with TensorReader(tmp_path) as reader:
        config = load_config(tmp_path, reader)
        assert implied_numel(config) == held_numel(reader, config)   # exactly: the bound is not loose by design
        check_weights_match_config(tmp_path, config, reader)


@pytest.mark.parametrize("field,value,named", [
    ("num_experts", 10**7, "num_experts=10000000 but layer 0 of the safetensors holds 8 experts"),
    ("hidden_size", 10**9, "hidden_size=1000000000 but model.embed_tokens.weight has shape (96, 32)"),
])
def test_a_config_that_does_not_fit_its_weights_is_refused_before_allocating(tmp_path, field, value, named):
    hf = tmp_path / "hf"
    save_hf("qwen3_moe", hf)
    config = json.loads((hf / "config.json").read_text())
    config[field] = value
    (hf / "config.json").write_text(json.dumps(config))
    # the three commands run at once (each child's start-up, importing torch, is most of its time)
    runs = [(argv[0], _moefold(*argv)) for argv in (
        ["convert", str(hf), str(tmp_path / "out")],
        ["generate", "--hf", str(hf), "--prompt-ids", "1", "2"],
        ["train", "--load-hf", str(hf), "--data-path", str(tmp_path / "none"), "--device", "cpu"])]
    for command, proc in runs:
        _, stderr = communicate(proc, 300)
        assert proc.returncode == 2, (command, stderr[-2000:])
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and f"{hf / 'config.json'}: {named}" in lines[0], (command, stderr[-2000:])
        assert "refusing to allocate it" in lines[0]
    assert not (tmp_path / "out").exists()
    from moefold.models.hf.importer import import_hf

    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        import_hf(hf)
    with TensorReader(hf) as reader:   # the counts themselves: the config's, and the headers' (unchanged)
        assert implied_numel(load_config(hf, reader)) > 10**9 > held_numel(reader, load_config(hf, reader))


def test_inspect_reports_the_mismatch_instead_of_failing(tmp_path, capsys):
    from moefold.training.cli import main

    save_hf("qwen3_moe", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_experts"] = 16
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["inspect", "--hf", str(tmp_path), "--no-layers"]) == 0
    assert "but the safetensors hold 45,328: they do not belong together" in capsys.readouterr().out
