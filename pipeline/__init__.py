"""Pipeline parallelism: layouts (Megatron's ``--pipeline-model-parallel-layout``), stage splitting,
point-to-point, schedules (GPipe, 1F1B, interleaved, ZB-H1, ZB-V, DualPipeV) and their executor, the batch-level
overlap engine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moefold.pipeline.actions import Action, ActionKind, Message, Placement
    from moefold.pipeline.compute_orders import compute_order
    from moefold.pipeline.decoder_stage import (
        DecoderStage,
        build_stage_model,
        check_model_layout,
        decoder_microbatches,
        embedding_group,
        shared_weight_groups,
        shared_weight_holders,
    )
    from moefold.pipeline.executor import (
        BackwardStep,
        OverlappedStage,
        PipelineResult,
        PipelineStage,
        SequentialStage,
        reduce_step_losses,
        run_schedule,
    )
    from moefold.pipeline.layout import check_layout, format_layout, parse_layout, standard_layouts
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

# name -> the module that defines it: loaded on first use, so that reading a config or parsing flags imports
# no more than it needs (torch only where a module computes)
_LAZY = {
    **dict.fromkeys(["Action", "ActionKind", "Message", "Placement"], "moefold.pipeline.actions"),
    "compute_order": "moefold.pipeline.compute_orders",
    **dict.fromkeys(["DecoderStage", "build_stage_model", "check_model_layout", "decoder_microbatches",
                     "embedding_group", "shared_weight_groups", "shared_weight_holders"],
                    "moefold.pipeline.decoder_stage"),
    **dict.fromkeys(["BackwardStep", "OverlappedStage", "PipelineResult", "PipelineStage", "SequentialStage",
                     "reduce_step_losses", "run_schedule"], "moefold.pipeline.executor"),
    **dict.fromkeys(["check_layout", "format_layout", "parse_layout", "standard_layouts"], "moefold.pipeline.layout"),
    **dict.fromkeys(["ChunkRun", "OverlapConfig", "Trace", "run_overlapped"], "moefold.pipeline.overlap"),
    **dict.fromkeys(["P2PHandle", "TensorSpec", "batch_send_recv", "recv_backward", "recv_forward", "send_backward",
                     "send_forward"], "moefold.pipeline.p2p"),
    **dict.fromkeys(["SCHEDULES", "Schedule", "build_schedule", "dualpipev_idle", "expected_bubble_fraction",
                     "one_f_one_b_idle", "zb_h1_idle"], "moefold.pipeline.schedules"),
    **dict.fromkeys(["DeadlockError", "ScheduleError", "SimResult", "simulate", "validate"],
                    "moefold.pipeline.simulator"),
    **dict.fromkeys(["ChunkSpec", "StageLayout", "chunk_costs", "vpp_from_layers_per_virtual_stage"],
                    "moefold.pipeline.stages"),
    **dict.fromkeys(["plot_png", "render_text"], "moefold.pipeline.timeline"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ChunkSpec", "StageLayout", "vpp_from_layers_per_virtual_stage", "chunk_costs",
    "TensorSpec", "P2PHandle", "batch_send_recv", "send_forward", "recv_forward", "send_backward", "recv_backward",
    "Action", "ActionKind", "Message", "Placement", "SCHEDULES", "Schedule", "build_schedule", "compute_order",
    "expected_bubble_fraction", "zb_h1_idle", "one_f_one_b_idle", "dualpipev_idle",
    "DeadlockError", "ScheduleError", "SimResult", "simulate", "validate", "render_text", "plot_png",
    "PipelineStage", "PipelineResult", "SequentialStage", "run_schedule", "reduce_step_losses", "BackwardStep",
    "OverlappedStage", "ChunkRun", "OverlapConfig", "Trace", "run_overlapped",
    "DecoderStage", "build_stage_model", "decoder_microbatches", "embedding_group", "shared_weight_groups",
    "shared_weight_holders", "check_model_layout", "parse_layout", "check_layout", "format_layout", "standard_layouts",
]
