"""Starting the ranks and ending them cleanly: pre-flight checks before any rank starts, local ranks
(``--nproc``) or torchrun's, heartbeats and the watchdog that ends a job whose rank stopped.

Holds: preflight, ranks, watchdog.
May import: moefold.models, moefold.parallel, moefold.dispatch (the DeepEP buffers a rank releases);
training.config, training.checkpoint, training.data, training.observe, training.errors.
"""

from moefold.training.launch.preflight import preflight
from moefold.training.launch.ranks import run_ranks
from moefold.training.launch.watchdog import Heartbeat, die_with_parent, stalled_rank

__all__ = ["preflight", "run_ranks", "Heartbeat", "die_with_parent", "stalled_rank"]
