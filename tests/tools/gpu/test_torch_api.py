"""``moefold.tools.gpu.torch_api``: every torch name moefold uses, checked against a torch release.

The running torch must have them all (the check the GPU check runs first on a machine whose torch may be older);
the static check of another release's sources finds a name, a keyword or an ATen schema that release lacks
(shown on a small torch tree missing exactly those), and passes the same tree when it has them.
"""

from __future__ import annotations

from pathlib import Path

from moefold.tools.gpu.torch_api import check_running, check_source
from moefold.tools.gpu.torch_uses import Use, used_names

_FLASH = ("_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, Tensor? cum_seq_k, "
          "SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, bool return_debug_mask, *, float? scale=None"
          "{more}) -> (Tensor output, Tensor softmax_logsumexp, Tensor rng_state, Tensor unused, "
          "Tensor debug_attn_mask)")


def test_moefold_names_resolve_in_the_running_torch():
    names = used_names()
    assert {"offs"} <= names["torch.nn.functional.grouped_mm"].keywords
    flash = names["torch.ops.aten._flash_attention_forward"]
    assert flash.positional == {10} and {"scale", "window_size_left", "window_size_right"} <= flash.keywords
    assert "torch.distributed.all_to_all_single" in names and "torch.utils.checkpoint.checkpoint" in names
    assert check_running(names) == []


def _tree(root: Path, complete: bool) -> Path:
    (root / "torch" / "nn").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text("from torch import nn\n")
    (root / "torch" / "nn" / "__init__.py").write_text("from torch.nn import functional\n")
    offs = "offs=None, " if complete else ""
    silu = "def silu(input, inplace=False):\n    pass\n" if complete else ""
    (root / "torch" / "nn" / "functional.py").write_text(f"def grouped_mm(mat_a, mat_b, *, {offs}bias=None):\n"
                                                         f"    pass\n{silu}")
    native = root / "torchgen" / "packaged" / "ATen" / "native"
    native.mkdir(parents=True)
    more = ", SymInt? window_size_left=None, SymInt? window_size_right=None" if complete else ""
    (native / "native_functions.yaml").write_text(f"- func: {_FLASH.format(more=more)}\n  variants: function\n")
    return root


def test_static_check_finds_what_another_release_lacks(tmp_path):
    names = {"torch.nn.functional.grouped_mm": Use(keywords={"offs"}, positional={2}),
             "torch.nn.functional.silu": Use(positional={1}),
             "torch.ops.aten._flash_attention_forward": Use(keywords={"scale", "window_size_left"}, positional={10}),
             "torch.ops.aten._grouped_mm": Use(positional={3})}
    problems = [str(p) for p in check_source(names, _tree(tmp_path / "old", complete=False))]
    assert any("grouped_mm: takes no keyword offs" in p for p in problems), problems
    assert any("silu: silu is not defined in torch.nn.functional" in p for p in problems), problems
    assert any("_flash_attention_forward: no schema takes [10] positional" in p for p in problems), problems
    assert any("_grouped_mm: ATen operator _grouped_mm is not in" in p for p in problems), problems
    del names["torch.ops.aten._grouped_mm"]
    assert check_source(names, _tree(tmp_path / "new", complete=True)) == []
