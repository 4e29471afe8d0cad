"""Stopping a run cleanly: on SIGTERM (what SLURM and Kubernetes send before preemption), SIGINT (Ctrl-C),
SIGUSR1, after ``--exit-duration-in-mins`` or at an ``--exit-interval`` step, every rank finishes its current
step, the run saves a checkpoint (``--save`` set, even with ``--save-interval 0``), prints one line and exits.

The handler only records the signal (``StopRequest.received``); the trainer puts each rank's flag into the
step's existing all-reduce of the logged losses (``Trainer.train_step``), so every rank learns after the
same step that some rank was told to stop, and they save together: no rank saves alone and no collective
is added. A signal that arrives after a rank's contribution to step N stops the run after step N + 1.

Where the signal goes: ``moefold train --nproc N`` forwards it to its ranks (which ignore a repeat of it:
the terminal also sends Ctrl-C to them); under torchrun the agent forwards SIGTERM/SIGINT to the workers and
SIGKILLs them after its ``--shutdown-timeout`` (default 30 s), the time the save has. A second Ctrl-C in the
launching process stops at once, without a checkpoint.

Exit codes (``moefold train``): 0 done, or stopped by ``--exit-duration-in-mins`` / ``--exit-interval``
(planned stops, as in Megatron-LM); 128 + the signal number after a signal's stop (143 SIGTERM, 130 SIGINT,
138 SIGUSR1: schedulers and requeue scripts read these as "terminated by a signal").
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from moefold.training.config import TrainConfig

# the step's stop flags, summed by its all-reduce of the logged losses: ranks told to stop by a signal, the sum of
# their signal numbers, ranks past --exit-duration-in-mins
STOP_FLAGS = 3


def signal_numbers(names: Sequence[str]) -> tuple[int, ...]:
    """The numbers of signal ``names`` (``TrainConfig.exit_signals``, validated there)."""
    return tuple(int(signal.Signals[name]) for name in names)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopRequest:
    """Handlers for ``signals`` in this (main) thread's process; ``received`` is the first one's number (0:
    none). ``interactive`` (the process the user started): a second SIGINT raises ``KeyboardInterrupt`` and
    the first one prints a note; a rank ignores repeats. ``restore()`` puts the previous handlers back."""

    def __init__(self, signals: Sequence[int], interactive: bool = False, note: bool = False) -> None:
        self.received = 0
        self.interactive, self.note = interactive, note
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received:
            if self.interactive and signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.received = signum
        if self.note:   # os.write: a print here could re-enter one the signal interrupted
            again = "; Ctrl-C again to stop at once, without saving" if self.interactive else ""
            os.write(2, f"\nmoefold train: {signal_name(signum)}: stopping after the current step and saving"
                        f"{again}\n".encode())

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


@dataclass(frozen=True)
class Stop:
    """Why a run stopped before ``--train-iters``: ``signum`` (a signal, 0 for a planned stop) and ``reason``
    ("SIGTERM", "--exit-duration-in-mins 30", "--exit-interval 1000")."""

    reason: str
    signum: int = 0

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum else 0


def write_stop_flags(flags: Tensor, request: StopRequest | None, deadline: float | None) -> None:
    """This rank's stop flags into ``flags`` [STOP_FLAGS] (zeros, the step's all-reduced values): 1 and the signal
    number when ``request`` has received one, 1 past ``deadline`` (``time.monotonic``). Written only when set: a
    device fill, no host synchronisation."""
    signum = request.received if request is not None else 0
    if signum:
        flags[0].fill_(1)
        flags[1].fill_(signum)
    if deadline is not None and time.monotonic() > deadline:
        flags[2].fill_(1)


def agreed_stop(flags: Sequence[float], iteration: int, train: TrainConfig) -> Stop | None:
    """Why the ranks stop after step ``iteration`` (just completed), from the all-reduced ``flags`` [STOP_FLAGS]
    every rank holds (so every rank decides the same), or None. Ranks signalled with different signals stop as
    with SIGTERM."""
    signalled, signums, late = flags[:STOP_FLAGS]
    if signalled:
        signum = int(signums) // int(signalled) if int(signums) % int(signalled) == 0 else 0
        return Stop(signal_name(signum) if signum else "a signal", signum or 15)
    if late:
        return Stop(f"--exit-duration-in-mins {train.exit_duration_in_mins:g}")
    if train.exit_interval and iteration % train.exit_interval == 0 and iteration < train.train_iters:
        return Stop(f"--exit-interval {train.exit_interval}")
    return None


def stop_line(stop: Stop, step: int, checkpoint: str | None, save: str | None) -> str:
    """``moefold train: SIGTERM at step 1234: saved ckpt/iter_0001234; resume with --load ckpt``."""
    if checkpoint:
        return f"moefold train: {stop.reason} at step {step}: saved {checkpoint}; resume with --load {save}"
    return f"moefold train: {stop.reason} at step {step}: no --save, nothing saved"
