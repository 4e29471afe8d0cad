"""Pipeline parallelism: stage splitting, point-to-point, schedules and their executor."""

from moefold.pipeline.actions import Action, ActionKind, Message
from moefold.pipeline.decoder_stage import DecoderStage, build_stage_model, decoder_microbatches, embedding_group
from moefold.pipeline.executor import PipelineResult, PipelineStage, SequentialStage, reduce_step_losses, run_schedule
from moefold.pipeline.p2p import (
    P2PHandle,
    TensorSpec,
    batch_send_recv,
    recv_backward,
    recv_forward,
    send_backward,
    send_forward,
)
from moefold.pipeline.schedules import SCHEDULES, Schedule, build_schedule, expected_bubble_fraction
from moefold.pipeline.simulator import DeadlockError, ScheduleError, SimResult, simulate, validate
from moefold.pipeline.stages import ChunkSpec, StageLayout, vpp_from_layers_per_virtual_stage
from moefold.pipeline.timeline import plot_png, render_text

__all__ = [
    "ChunkSpec", "StageLayout", "vpp_from_layers_per_virtual_stage",
    "TensorSpec", "P2PHandle", "batch_send_recv", "send_forward", "recv_forward", "send_backward", "recv_backward",
    "Action", "ActionKind", "Message", "SCHEDULES", "Schedule", "build_schedule", "expected_bubble_fraction",
    "DeadlockError", "ScheduleError", "SimResult", "simulate", "validate", "render_text", "plot_png",
    "PipelineStage", "PipelineResult", "SequentialStage", "run_schedule", "reduce_step_losses",
    "DecoderStage", "build_stage_model", "decoder_microbatches", "embedding_group",
]
