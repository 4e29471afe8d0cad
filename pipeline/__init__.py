"""Pipeline parallelism: stage splitting, point-to-point, schedules (GPipe, 1F1B, interleaved, ZB-H1, ZB-V, DualPipeV)
and their executor, the batch-level overlap engine."""

from moefold.pipeline.actions import Action, ActionKind, Message, Placement
from moefold.pipeline.compute_orders import compute_order
from moefold.pipeline.decoder_stage import DecoderStage, build_stage_model, decoder_microbatches, embedding_group
from moefold.pipeline.executor import (
    BackwardStep,
    OverlappedStage,
    PipelineResult,
    PipelineStage,
    SequentialStage,
    reduce_step_losses,
    run_schedule,
)
from moefold.pipeline.overlap import ChunkRun, OverlapConfig, Trace, run_overlapped
from moefold.pipeline.p2p import (
    P2PHandle,
    TensorSpec,
    batch_send_recv,
    recv_backward,
    recv_forward,
    send_backward,
    send_forward,
)
from moefold.pipeline.schedules import (
    SCHEDULES,
    Schedule,
    build_schedule,
    dualpipev_idle,
    expected_bubble_fraction,
    one_f_one_b_idle,
    zb_h1_idle,
)
from moefold.pipeline.simulator import DeadlockError, ScheduleError, SimResult, simulate, validate
from moefold.pipeline.stages import ChunkSpec, StageLayout, chunk_costs, vpp_from_layers_per_virtual_stage
from moefold.pipeline.timeline import plot_png, render_text

__all__ = [
    "ChunkSpec", "StageLayout", "vpp_from_layers_per_virtual_stage", "chunk_costs",
    "TensorSpec", "P2PHandle", "batch_send_recv", "send_forward", "recv_forward", "send_backward", "recv_backward",
    "Action", "ActionKind", "Message", "Placement", "SCHEDULES", "Schedule", "build_schedule", "compute_order",
    "expected_bubble_fraction", "zb_h1_idle", "one_f_one_b_idle", "dualpipev_idle",
    "DeadlockError", "ScheduleError", "SimResult", "simulate", "validate", "render_text", "plot_png",
    "PipelineStage", "PipelineResult", "SequentialStage", "run_schedule", "reduce_step_losses", "BackwardStep",
    "OverlappedStage", "ChunkRun", "OverlapConfig", "Trace", "run_overlapped",
    "DecoderStage", "build_stage_model", "decoder_microbatches", "embedding_group",
]
