"""``moefold env`` runs on a machine without a GPU and reports the optional backends."""

from training.cli import main
from training.env_report import backend_status


def test_env_prints_torch_and_backends(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch: " in out
    for name in ("transformer_engine", "deep_ep", "grouped_gemm", "pynvml"):
        assert name in out


def test_missing_backend_says_what_to_install():
    assert backend_status("deep_ep").startswith(("available", "not installed (pip install deep-ep)"))
    assert backend_status("surely_not_a_module_xyz") == "not installed (pip install surely_not_a_module_xyz)"
