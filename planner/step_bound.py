"""A lower bound on a layout's step time from its blocks' compute alone, so that the search times only the layouts that
can still rank among those it prints (branch and bound: ``planner.search``). Why it is a bound on
``step_time.estimate_step_time``'s total: the step's terms are the critical rank's (the rank busiest in the pipeline
clock) plus the bubble, the data-parallel sync, the optimizer and offload terms, all >= 0. The critical rank's terms
less the expert exchange the batch-level overlap hides are its busy time (the overlap hides ``min(exchange,
compute)`` of the exchange, never compute), and its busy time is at least any other rank's. So the total is at least
every rank's busy time, which is at least that rank's compute: ``m`` micro-batches through its chunks' blocks, each
block's forward, backward and at least its selective recompute (full recompute runs the whole forward again, which
is more); the bound is the busiest rank's. Every action's compute is scaled by the calibration's ``compute``
(``step_terms.Calibration``; the flat model of ``--efficiency`` is not calibrated), and the routing kernels'
traffic, the head, the embedding and every communication term only add to it.
"""

from __future__ import annotations

from moefold.dense.recompute import recomputed_modules
from moefold.models.layer_factory import is_moe_block
from moefold.parallel.dims import ParallelSizes
from moefold.planner.cluster import Cluster
from moefold.planner.compute_time import block_compute
from moefold.planner.step_terms import CALIBRATION
from moefold.training.config import RunConfig


def step_lower_bound(config: RunConfig, sizes: ParallelSizes, cluster: Cluster, micro_batches: int,
                     efficiency: float | None = None) -> float:
    """Seconds: at most ``estimate_step_time(config, sizes, cluster, ..., efficiency)``'s total (module docstring),
    for the default ``exchange_overlap``, ``compute_share`` and ``calibration``; ``micro_batches``: per step and
    pipeline (``RunConfig.resolve``)."""
    from moefold.planner.step_time import _actions_key, _score_macs, rank_chunks

    m, seq = config.model, config.train.seq_length
    shared = _actions_key(config)
    o = shared.options
    chosen = recomputed_modules(o.recompute, o.recompute_modules)
    flop_s = None if efficiency is None else cluster.bf16_tflops * 1e12 * efficiency
    costs: dict[tuple, float] = {}

    def block(index: int) -> float:
        key = (is_moe_block(m, index), index >= m.num_layers, _score_macs(m, seq, index))
        if key not in costs:
            cost = block_compute(shared, sizes, index, cluster, key[2], chosen, flop_s)
            costs[key] = cost.forward + cost.backward + cost.recompute
        return costs[key]

    busiest = 0.0
    for rank in range(sizes.pp):
        seconds = 0.0
        for chunk in rank_chunks(config, sizes, rank):
            seconds += sum(block(i) for i in chunk.layers)
            if chunk.has_mtp:
                seconds += sum(block(m.num_layers + d) for d in range(m.mtp_num_layers))
        busiest = max(busiest, seconds)
    scale = 1.0 if efficiency is not None else CALIBRATION.compute
    return scale * micro_batches * busiest


__all__ = ["step_lower_bound"]
