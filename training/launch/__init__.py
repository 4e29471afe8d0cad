"""Starting the ranks and ending them cleanly: which run this is and where it writes (claim: run ids, run
directories, the save directory's lock), pre-flight checks before any rank starts, local ranks (``--nproc``)
or torchrun's (joined before the run starts: torchrun), stopping after a step on a signal or a time limit
(signals), heartbeats and the watchdog that ends a job whose rank stopped.

Holds: claim, preflight, ranks, signals, torchrun, watchdog.
May import: moefold.models, moefold.parallel, moefold.dispatch (the DeepEP buffers a rank releases);
training.config, training.checkpoint, training.data, training.observe, training.errors.
"""

from moefold.training.launch.claim import Claim, claim_run
from moefold.training.launch.preflight import preflight
from moefold.training.launch.ranks import run_ranks
from moefold.training.launch.signals import Stop, StopRequest
from moefold.training.launch.watchdog import Heartbeat, die_with_parent, stalled_rank

__all__ = ["preflight", "run_ranks", "Heartbeat", "die_with_parent", "stalled_rank", "Claim", "claim_run", "Stop",
           "StopRequest"]
