"""Every command that picks a checkpoint out of a directory says which one, and picks the one a resume would: the
newest its run completed (the tracker), never another run's later one left beside it (issue 27: ``inspect``,
``generate`` and ``convert --checkpoint runs/moefold/checkpoints`` used to take another run's, another recipe's,
model without a word)."""

from __future__ import annotations

import pytest

from moefold.training.checkpoint.identity import checkpoint_run_id, read_run, read_tracker
from moefold.training.cli import main as cli_main
from tests.training.launch.cli_runs import TINY, corpus

pytestmark = pytest.mark.usefixtures("one_thread")


def test_inspect_generate_and_convert_name_the_checkpoint_of_the_directorys_run(tmp_path, capsys):
    data = ["--data-path", str(corpus(tmp_path / "data"))]
    save = tmp_path / "ckpt"
    assert cli_main(["train", *TINY, *data, "--train-iters", "4", "--save-interval", "2", "--run-dir",
                     str(tmp_path / "old"), "--save", str(save)]) == 0
    old = read_run(save).run_id
    assert cli_main(["train", *TINY, *data, "--train-iters", "2", "--run-dir", str(tmp_path / "new"), "--save",
                     str(save), "--override-save"]) == 0
    mine = read_run(save).run_id
    assert mine != old and read_tracker(save) == 2 and checkpoint_run_id(save / "iter_0000004") == old
    capsys.readouterr()
    picked = f"{save / 'iter_0000002'} (iteration 2 of run {mine}, qwen3_moe_tiny)"

    assert cli_main(["inspect", "--checkpoint", str(save), "--no-layers"]) == 0
    assert f"training checkpoint {picked}" in capsys.readouterr().out
    assert cli_main(["generate", "--checkpoint", str(save), "--prompt-ids", "1", "2", "--max-new-tokens", "2"]) == 0
    assert f"moefold generate: using {picked}" in capsys.readouterr().err
    assert cli_main(["convert", str(save), str(tmp_path / "hf")]) == 0
    assert f"using {picked}" in capsys.readouterr().out

    # damaged: one plain line that neither names an exception class nor talks of resuming (generate trains nothing)
    (shard,) = (save / "iter_0000002").glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:10])
    for path, says in ((save / "iter_0000002", "is damaged: __0_0.distcp has 10 bytes"),
                       (save, "no intact checkpoint under")):
        assert cli_main(["generate", "--checkpoint", str(path), "--prompt-ids", "1", "--max-new-tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("moefold generate: error: ") and says in err and err.count("\n") == 1, err
        assert "Error" not in err and "resum" not in err and "scratch" not in err, err
