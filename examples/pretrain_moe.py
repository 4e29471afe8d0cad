"""Pretrain a tiny MoE on the built-in corpus from Python, at world 1 or as N local ranks, or under torchrun.

    python examples/pretrain_moe.py                                   # world 1, CPU, a few minutes
    python examples/pretrain_moe.py --nproc 4 --ep 2 --tp 2           # 4 local gloo ranks: tp2 x ep2
    torchrun --nproc-per-node 8 examples/pretrain_moe.py --ep 8       # the launcher's ranks (one node)
    sbatch examples/slurm.sh                                          # several nodes (torchrun per node)

It builds the same ``RunConfig`` as ``moefold train`` and hands it to ``training.launch.ranks.run_ranks``,
which picks torchrun's world when launched by it and spawns ``--nproc`` ranks otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys

from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig
from moefold.parallel.init import launched_by_torchrun, launched_world_size
from moefold.training.cli.train import train_worker, validate
from moefold.training.config import RunConfig, TrainConfig
from moefold.training.errors import JobFailed
from moefold.training.launch.claim import claim_run
from moefold.training.launch.preflight import preflight
from moefold.training.launch.ranks import run_ranks


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="qwen3_moe_tiny")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=1)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--run-dir", default="runs/pretrain_moe")
    p.add_argument("--save", default="runs/pretrain_moe/checkpoints")
    args = p.parse_args()
    train = dataclasses.replace(TrainConfig(), train_iters=args.iters, run_dir=args.run_dir, save=args.save,
                                save_interval=100, load=args.save)   # resumes if a checkpoint exists
    config = RunConfig(model=get_recipe(args.recipe), train=train, recipe=args.recipe,
                       parallel=ParallelConfig(tp=args.tp, cp=args.cp, ep=args.ep, etp=args.etp))
    # fails here, before any rank starts: the layout, the run's directories (its run id, the save directory's
    # lock, another run's files), the disk, the data
    validate(config, launched_world_size() if launched_by_torchrun() else args.nproc)
    # (under torchrun rank 0 claims; the others write no run records and use rank 0's choices through it)
    claim = None
    if int(os.environ.get("RANK", "0")) == 0:
        config, claim = claim_run(config, default_save=False)
    try:
        preflight(config, world_size=args.nproc, resume_from=claim.resume_from if claim else None)
    except ValueError:
        if claim is not None:
            claim.abandon()
        raise
    if claim is not None:
        claim.record()
    with claim or contextlib.nullcontext():
        try:
            run_ranks(train_worker, args.nproc, "auto", args=(json.dumps(config.to_dict()),), run_dir=args.run_dir)
        except JobFailed as exc:   # one line; the tracebacks are in RUN_DIR/error.log
            print(f"pretrain_moe: {exc} (tracebacks: {exc.log})", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
