"""Names read from files never become paths outside their folder, and an HF config is sized before anything is
built (issue 47, rows 4, 5 and 7): an HF index entry ``../x/model.safetensors``, a broken safetensors header and a
config of 10^6 layers are each refused in one line, exit 2, without reading outside the model directory or
building a module; ``models.safe_names`` itself over a class of names."""

from __future__ import annotations

import json
import shutil

import pytest

from moefold.models.hf import bounds
from moefold.models.hf.importer import load_config
from moefold.models.safe_names import UnsafeNameError, inside, plain_name
from moefold.models.tensor_io import INDEX, TensorReader
from moefold.training.cli import main as cli_main
from tests.models.hf_tiny import FAMILIES, save_hf

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["iter_0000100", "20261201-101500-3f9a2c", "__0_0.distcp", "model.safetensors",
                                  "model-00001-of-00002.safetensors", "a+b"])
def test_plain_names_pass(tmp_path, name):
    assert plain_name(name, "x", "f") == name and inside(tmp_path, name, "x", "f") == tmp_path / name


@pytest.mark.parametrize("name", ["../x", "../../../X", "/tmp/elsewhere", "a/b", "..", ".", "", ".hidden", "a\\b",
                                  "x\n", 7, None, "a" * 300])
def test_names_that_are_not_plain_are_refused(tmp_path, name):
    with pytest.raises(UnsafeNameError, match=r"^f: x .* is not a plain name"):
        inside(tmp_path, name, "x", "f")


def test_a_link_out_of_the_folder_is_refused(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "link").symlink_to(tmp_path)
    with pytest.raises(UnsafeNameError, match=r"'link' resolves to .*, outside "):
        inside(tmp_path / "in", "link", "x", "f")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "qwen3_moe"
    save_hf("qwen3_moe", path)
    return path


def test_an_hf_index_entry_outside_the_model_directory_is_never_read(hf_dir, tmp_path, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(hf_dir, model)
    (tmp_path / "x").mkdir()
    shutil.move(model / "model.safetensors", tmp_path / "x" / "model.safetensors")   # the file it would read
    with TensorReader(tmp_path / "x") as reader:
        names = reader.names()
    (model / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(names,
                                                                                        "../x/model.safetensors")}))
    with pytest.raises(ValueError, match=rf"{model / INDEX}: file '\.\./x/model\.safetensors' is not a plain name"):
        TensorReader(model)
    monkeypatch.chdir(tmp_path)
    code = cli_main(["train", "--load-hf", str(model), "--data-path", str(tmp_path / "none"), "--device", "cpu"])
    assert code == 2


def test_a_broken_safetensors_header_is_one_line_exit_2(hf_dir, tmp_path, capsys, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(hf_dir, model)
    raw = bytearray((model / "model.safetensors").read_bytes())
    raw[8:12] = b"{{{{"   # the JSON header
    (model / "model.safetensors").write_bytes(bytes(raw))
    monkeypatch.chdir(tmp_path)
    code = cli_main(["train", "--load-hf", str(model), "--data-path", str(tmp_path / "none"), "--device", "cpu"])
    out = capsys.readouterr()
    assert code == 2, out
    (line,) = out.err.strip().splitlines()
    assert line.startswith(f"moefold train: error: {model / 'model.safetensors'}: not a readable safetensors file ("), \
        line


def test_a_config_of_a_million_layers_is_refused_without_building_anything(hf_dir, tmp_path, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(hf_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = 10**6
    (model / "config.json").write_text(json.dumps(config))

    def built(_config):   # counting work, not seconds: the meta build is what took 300 s
        raise AssertionError("the model was built to size a config whose numbers already refuse it")

    monkeypatch.setattr(bounds, "implied_numel", built)
    with TensorReader(model) as reader, pytest.raises(ValueError) as refused:
        bounds.check_weights_match_config(model, load_config(model, reader), reader, config)
    assert str(refused.value).startswith(f"{model / 'config.json'}: num_hidden_layers=1000000 but the safetensors "
                                         "hold ")
    assert "it describes a model of at least 3.1" in str(refused.value) and "refusing to allocate it" in str(
        refused.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_floor_never_exceeds_what_a_config_implies(tmp_path, family):
    """The lower bound refuses only what the exact count would: it is below it for every family."""
    save_hf(family, tmp_path)
    with TensorReader(tmp_path) as reader:
        config = load_config(tmp_path, reader)
        assert 0 < bounds.floor_numel(config) <= bounds.implied_numel(config)
