"""The launcher's pieces, in isolation: heartbeat files and the stalled-rank rule, the rank that fell behind in a
collective timeout, one-line messages (also for torch.distributed.checkpoint's wrapped failures)."""

from __future__ import annotations

import os
import time

from moefold.training.errors import Failure, append_error_log, one_line
from moefold.training.launch.ranks import _behind
from moefold.training.launch.watchdog import STARTUP_GRACE_S, Heartbeat, last_steps, read_heartbeat, stalled_rank


def test_heartbeats_and_the_stalled_rank(tmp_path):
    paths = [tmp_path / f"heartbeat.{r}" for r in range(3)]
    beats = [Heartbeat(p, interval=0.05) for p in paths[:2]]   # rank 2 has not started yet
    try:
        beats[0].beat(7)
        beats[1].beat(6)
        time.sleep(0.2)
        assert last_steps(paths) == [7, 6, None]
        assert read_heartbeat(paths[0])[0] < 1.0
        assert stalled_rank(paths, [True, True, True], timeout=5, since_launch=10) is None
        # rank 2 never beat: only after the start-up grace; rank 1 stopped (its file ages): named with its step
        assert stalled_rank(paths, [True, True, True], timeout=5, since_launch=STARTUP_GRACE_S + 1)[0] == 2
        beats[1].stop()
        old = time.time() - 60
        os.utime(paths[1], (old, old))
        rank, age, step = stalled_rank(paths, [True, True, True], timeout=5, since_launch=10)
        assert (rank, step) == (1, 6) and age >= 59
        assert stalled_rank(paths, [True, False, True], timeout=5, since_launch=10) is None   # finished ranks
    finally:
        for b in beats:
            b.stop()


def test_a_timed_out_collective_names_the_rank_behind():
    msg = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Timed out waiting 600000ms for recv operation"
    assert _behind(msg, [12, 11, 12, 12]) == " (rank 1 fell behind: last completed step 11, the others 12)"
    assert _behind(msg, [12, 12]) == "" and _behind("ValueError: x", [12, 11]) == ""


def test_one_line_messages(tmp_path):
    assert one_line(ValueError("--lr=inf must be finite\nmore")) == "--lr=inf must be finite"
    assert one_line(IndexError("index out of range in self")) == "IndexError: index out of range in self"
    assert one_line(RuntimeError()) == "RuntimeError"
    from torch.distributed.checkpoint.api import CheckpointException

    wrapped = CheckpointException("save", {1: (OSError(28, "No space left on device"), None)})
    assert one_line(wrapped) == ("OSError: [Errno 28] No space left on device (in torch.distributed.checkpoint on "
                                 "rank 1)")
    log = append_error_log(tmp_path, [Failure(1, "boom", "Traceback ...\nValueError: boom", 0.0),
                                      Failure(0, "peer closed", "", 1.0)], ["last completed step per rank: [3, 3]"])
    text = log.read_text()
    assert text.startswith("===== moefold train failed at ") and ": rank 1: boom\n" in text
    assert "----- rank 0: peer closed\n(no traceback" in text and "[3, 3]" in text
