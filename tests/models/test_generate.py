"""Generation with a KV cache: greedy output equals transformers' ``generate`` for the tiny families (Mixtral's
sliding window, GPT-OSS's sinks with alternating windows, partial RoPE and projection qk-norm included; Qwen3-Next's
DeltaNet layers through their recurrent state; DeepSeek-V3.2's and GLM-5's sparse attention through their latent
caches), sampling is seeded and top-p behaves, and ``moefold generate``
works from an HF directory and a moefold checkpoint with the model's tokenizer. tp2 x ep2:
tests/training/test_train_from_hf.py."""

from __future__ import annotations

import pytest
import torch

from moefold.models.generate import generate, next_token
from moefold.models.hf.importer import import_hf
from moefold.training.cli import main as cli
from tests.models.hf_tiny import FAMILIES, save_hf, save_tokenizer, tokens

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", (*FAMILIES, "deepseek_v32", "glm_moe_dsa"))   # + DeepSeek sparse attention
def test_greedy_equals_transformers_generate(family, tmp_path):
    hf = save_hf(family, tmp_path)
    hf.generation_config.eos_token_id = None   # random weights: compare the full length
    ids = tokens(batch=2, seq=5, seed=11)
    ref = hf.generate(ids, max_new_tokens=14, do_sample=False, pad_token_id=0)
    out = generate(import_hf(tmp_path), ids, 14)
    assert torch.equal(out, ref), (out.tolist(), ref.tolist())


def test_sampling_and_stopping(tmp_path):
    save_hf("qwen3_moe", tmp_path)
    model = import_hf(tmp_path)
    ids = tokens(batch=1, seq=4, seed=2)
    greedy = generate(model, ids, 12)
    # the nucleus of a tiny p is the most likely token: greedy again, at any temperature
    assert torch.equal(generate(model, ids, 12, temperature=5.0, top_p=1e-6, seed=3), greedy)
    assert torch.equal(generate(model, ids, 12, temperature=5.0, top_k=1, seed=3), greedy)
    a, b = (generate(model, ids, 12, temperature=1.5, top_p=0.9, seed=s) for s in (0, 0))
    assert torch.equal(a, b) and not torch.equal(a, generate(model, ids, 12, temperature=1.5, top_p=0.9, seed=1))
    # stops at an eos token: the greedy continuation's 3rd new token
    eos = int(greedy[0, 6])
    stopped = generate(model, ids, 12, eos_token_id=[eos])
    assert stopped.shape[1] <= 7 and int(stopped[0, -1]) == eos
    # top-p keeps the smallest set of most likely tokens reaching p
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = {int(next_token(logits, 1.0, top_p=0.75, generator=torch.Generator().manual_seed(s))) for s in range(200)}
    assert draws == {0, 1}


def test_generate_cli(tmp_path, capsys):
    save_hf("mixtral", tmp_path / "hf")    # generation_config.json: eos_token_id 2
    save_tokenizer(tmp_path / "hf")
    prompt = "w5 w17 w40"
    assert cli(["generate", "--hf", str(tmp_path / "hf"), "--prompt", prompt, "--max-new-tokens", "6"]) == 0
    text = capsys.readouterr().out.split("\n---")[0]
    out = generate(import_hf(tmp_path / "hf"), torch.tensor([[5, 17, 40]]), 6, eos_token_id=2)[0].tolist()
    assert text == " ".join("<|endoftext|>" if i == 0 else f"w{i}" for i in out) and text.startswith(prompt)
    # a moefold checkpoint converted from it carries the tokenizer and generation config
    assert cli(["convert", str(tmp_path / "hf"), str(tmp_path / "mf")]) == 0
    capsys.readouterr()
    assert cli(["generate", "--checkpoint", str(tmp_path / "mf"), "--prompt", prompt, "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.split("\n---")[0] == text
    assert cli(["generate", "--hf", str(tmp_path / "hf"), "--prompt-ids", "5", "17", "40", "--max-new-tokens", "6",
                "--temperature", "0.7", "--top-p", "0.9", "--ignore-eos"]) == 0
    assert len(capsys.readouterr().out.split("\n---")[0].split()) == 9


def test_generate_errors_are_one_line(tmp_path, capsys):
    save_hf("qwen3_moe", tmp_path / "hf")
    capsys.readouterr()
    for args, message in [(["--hf", str(tmp_path / "hf"), "--prompt", "hi"], "no tokenizer.json with the model"),
                          (["--hf", str(tmp_path / "nope"), "--prompt", "hi"], "no config.json"),
                          (["--hf", str(tmp_path / "hf"), "--prompt-ids", "500"], "in [0, vocab_size=96)"),
                          (["--hf", str(tmp_path / "hf"), "--prompt-ids", "5", "--top-p", "0"], "top_p=0.0")]:
        assert cli(["generate", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and err.startswith("moefold generate: error:"), err
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        cli(["generate", "--hf", str(tmp_path / "hf"), "--prompt", "hi", "--debug"])
