"""``moefold env`` runs on a machine without a GPU and reports the optional backends."""

import pytest

from moefold.training.cli import SUBCOMMANDS, main
from moefold.training.cli.env import backend_status


def test_env_prints_torch_and_backends(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch: " in out
    for name in ("transformer_engine", "deep_ep", "grouped_gemm", "pynvml"):
        assert name in out


def test_missing_backend_says_what_to_install():
    assert backend_status("deep_ep").startswith(("available", "not installed (build DeepEP V2 (with NCCL >= 2.30.4"))
    assert backend_status("surely_not_a_module_xyz") == "not installed (pip install surely_not_a_module_xyz)"


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_builds_its_parser(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    assert "usage: moefold " + name in capsys.readouterr().out
