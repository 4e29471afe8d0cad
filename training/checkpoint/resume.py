"""What a resumed run must share with the checkpoint it continues.

The data order is a function of the corpus (``--data-path``, or the built-in corpus and its vocabulary),
``--seq-length`` and ``--seed`` (``training.data.gpt_dataset``); a checkpoint's ``consumed_samples`` is a
position in that order. Resuming with any of them changed would continue at the same position of a
different order, so it is refused, unless ``--reset-data-position`` says to start the new order from its
first sample. The run length (``--train-iters``) is free to change: a longer run continues the same order
(not with ``--data-order megatron``, whose order depends on ``--train-iters``, the batch size and the split, as
Megatron's does).

The checkpoint's ``meta.json`` holds the whole ``RunConfig``; a resume refuses another model (any field of
``ModelConfig``, or another recipe), naming the fields, and states the allowed changes (the loss weights,
``--global-batch-size``, the learning-rate schedule) in one line each. ``moefold train`` runs the same check
before any rank starts (``training.launch.preflight``) on the checkpoint the resume will take.
"""

from __future__ import annotations

import dataclasses
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


# ModelConfig fields that weigh the training objective rather than define the model: a resume may change them
# (as Megatron allows), and says so; any other field changed is another model, refused.
OBJECTIVE_FIELDS = ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_input_jitter_eps", "moe_bias_update_rate",
                    "mtp_loss_scaling_factor", "moe_load_balancing_type", "moe_aux_loss_counts")
LR_FIELDS = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_style", "lr_decay_iters", "lr_wsd_decay_iters",
             "lr_wsd_decay_style", "lr_warmup_init", "lr_warmup_skip_zero")


def _model_fields(config: dict[str, Any]) -> dict[str, Any]:
    from moefold.training.config import RunConfig

    model = RunConfig.from_dict(config).model   # normalised (tuples, nested dataclasses) as the run builds it
    compared = {f.name for f in dataclasses.fields(model) if not f.compare}   # extra: not the model
    return {k: v for k, v in model.flat_dict().items() if k not in compared}   # every section's value by its flat name


def model_changes(saved: dict[str, Any], config: RunConfig) -> tuple[list[str], list[str]]:
    """(refused, allowed) differences between the model a checkpoint was trained as (its ``RunConfig.to_dict()``)
    and ``config``'s, as ``field value (checkpoint: value)``; the recipe counts as a field."""
    before, now = _model_fields(saved), _model_fields(config.to_dict())
    diff = {k: f"{k} {now[k]!r} (checkpoint: {before.get(k)!r})" for k in now if now[k] != before.get(k)}
    if saved.get("recipe") and config.recipe and saved["recipe"] != config.recipe:
        diff = {"recipe": f"--recipe {config.recipe} (checkpoint: {saved['recipe']})", **diff}
    return ([v for k, v in diff.items() if k not in OBJECTIVE_FIELDS],
            [v for k, v in diff.items() if k in OBJECTIVE_FIELDS])


def check_resume(meta: dict[str, Any], config: RunConfig, where: str, log: Callable[[str], None]) -> bool:
    """Compare this run with the checkpoint ``meta`` (of ``where``); True when the data position restarts.

    Raises ValueError naming each changed model field (the checkpoint stores the whole model config: any field,
    e.g. ``moe_topk``, the recipe; the loss weights of ``OBJECTIVE_FIELDS`` may change) and each changed data-order
    flag (unless ``config.train.reset_data_position``). States in one line each a changed objective weight, a
    changed ``--global-batch-size`` and a changed learning-rate schedule, which are allowed (as in Megatron).
    """
    saved = meta.get("config")
    if not saved:
        return False
    refused, allowed = model_changes(saved, config)
    if refused:
        raise ValueError(f"cannot resume from {where}: the model differs from the checkpoint's: {', '.join(refused)}; "
                         "resume with the checkpoint's model (drop the flags that change it), or start a new run")
    if allowed:
        log(f"note: resuming with {', '.join(allowed)}")
    before, now = data_identity(saved), data_identity(config.to_dict())
    # .get: a flag only one side's order has (--train-iters under --data-order megatron) counts as changed
    changed = [f"{flag} {now[flag]} (checkpoint: {before.get(flag)})" for flag in now
               if now[flag] != before.get(flag)]
    if changed:
        if not config.train.reset_data_position:
            raise ValueError(f"cannot resume from {where} with {', '.join(changed)}: the data order depends on "
                             "them, so the saved data position means nothing in the new order; use the checkpoint's "
                             "values, or pass --reset-data-position to start the new order at its first sample")
        log(f"--reset-data-position: {', '.join(changed)}; the data position restarts at sample 0 of the new order")
        return True
    t, s = config.train, saved["train"]
    if s.get("global_batch_size") not in (None, t.global_batch_size):
        log(f"note: --global-batch-size {t.global_batch_size} (checkpoint: {s['global_batch_size']}): the run "
            f"continues at sample {meta.get('consumed_samples', '?')} of the same order, {t.global_batch_size} "
            "samples per step")
    now_lr = {k: getattr(t, k) for k in LR_FIELDS}
    now_lr["lr_decay_iters"] = t.lr_decay_iters or t.train_iters
    saved_lr = {k: s.get(k) for k in LR_FIELDS}
    saved_lr["lr_decay_iters"] = s.get("lr_decay_iters") or s.get("train_iters")
    lr_changed = [f"--{k.replace('_', '-')} {now_lr[k]} (checkpoint: {saved_lr[k]})" for k in LR_FIELDS
                  if saved_lr[k] is not None and now_lr[k] != saved_lr[k]]
    if lr_changed:
        keep = f"; --lr-decay-iters {saved_lr['lr_decay_iters']} keeps its decay length" \
            if now_lr["lr_decay_iters"] != saved_lr["lr_decay_iters"] else ""
        log(f"note: the learning-rate schedule differs from the checkpoint's run: {', '.join(lr_changed)}{keep}")
    return False
