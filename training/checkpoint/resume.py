"""What a resumed run must share with the checkpoint it continues.

The data order is a function of the corpus (``--data-path``, or the built-in corpus and its vocabulary),
``--seq-length`` and ``--seed`` (``training.data.gpt_dataset``); a checkpoint's ``consumed_samples`` is a
position in that order. Resuming with any of them changed would continue at the same position of a
different order, so it is refused, unless ``--reset-data-position`` says to start the new order from its
first sample. The run length (``--train-iters``) is free to change: a longer run continues the same order
(not with ``--data-order megatron``, whose order depends on ``--train-iters``, the batch size and the split, as
Megatron's does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moefold.training.config import RunConfig


def data_identity(config: dict[str, Any]) -> dict[str, Any]:
    """{flag: value} of what decides the data order, from a ``RunConfig.to_dict()``."""
    t = config["train"]
    builtin = f"built-in corpus, vocab {t.get('vocab_size') or config['model']['vocab_size']}"
    data = list(t.get("data_path") or ()) or builtin
    out = {"--data-path": data, "--seq-length": t["seq_length"], "--seed": t["seed"],
           "--data-order": t.get("data_order", "moefold")}
    if out["--data-order"] == "megatron":   # Megatron's order depends on the run's sizes and split too
        out.update({"--train-iters": t["train_iters"], "--global-batch-size": t["global_batch_size"],
                    "--split": t.get("split")})
    return out


def check_resume(meta: dict[str, Any], config: RunConfig, where: str, log: Callable[[str], None]) -> bool:
    """Compare this run with the checkpoint ``meta`` (of ``where``); True when the data position restarts.

    Raises ValueError naming each changed flag (unless ``config.train.reset_data_position``); notes a changed
    learning-rate schedule length, which is allowed.
    """
    saved = meta.get("config")
    if not saved:
        return False
    before, now = data_identity(saved), data_identity(config.to_dict())
    changed = [f"{flag} {now[flag]} (checkpoint: {before[flag]})" for flag in now if now[flag] != before[flag]]
    if changed:
        if not config.train.reset_data_position:
            raise ValueError(f"cannot resume from {where} with {', '.join(changed)}: the data order depends on "
                             "them, so the saved data position means nothing in the new order; use the checkpoint's "
                             "values, or pass --reset-data-position to start the new order at its first sample")
        log(f"--reset-data-position: {', '.join(changed)}; the data position restarts at sample 0 of the new order")
        return True
    t, s = config.train, saved["train"]
    decay, saved_decay = t.lr_decay_iters or t.train_iters, s.get("lr_decay_iters") or s.get("train_iters")
    if saved_decay is not None and decay != saved_decay:
        log(f"note: the learning rate now decays over {decay} iterations, the checkpoint's run over {saved_decay}; "
            f"--lr-decay-iters {saved_decay} keeps its schedule")
    return False
