"""The checks ``moefold train`` runs on the flags before any rank starts that need the world size: the layout
(sizes, batch arithmetic, pipeline split, model divisibility: ``validate_layout``, which ``moefold plan`` applies
to every layout it considers), the optional GPU backends the flags choose (``check_backends``), and the flex
dispatcher's DeepEP backend resolved once for every rank (``resolve_flex``)."""

from __future__ import annotations

import dataclasses

import torch

from moefold.dense.gated_delta_rule import require_fla
from moefold.dispatch.config import DispatcherKind
from moefold.parallel.dims import ParallelSizes
from moefold.training.config import RunConfig


def validate(config: RunConfig, world_size: int, source: str | None = None) -> None:
    """Everything checkable without starting ranks: layout sizes, batch arithmetic, model divisibility, and that
    the chosen GPU backends are installed. ``source``: how the world was chosen (``layout_errors.world_source``)."""
    sizes = validate_layout(config, world_size, source)
    check_backends(config, sizes.ep, sizes.etp)
    if config.train.moe_routing_replay_file is not None:   # the file against the model and the run, then closed
        from moefold.training.routing_replay import open_replay_file

        open_replay_file(config).close()
    if config.train.compile and config.options.offload_modules:
        raise ValueError("--compile with --fine-grained-activation-offloading: the compiled blocks would not run the "
                         "saved-tensor hooks that offload their activations; drop one of them")


def validate_layout(config: RunConfig, world_size: int, source: str | None = None) -> ParallelSizes:
    """The layout checks of ``validate`` (sizes, batch arithmetic, pipeline split, model divisibility), without the
    installed-backend checks: what ``moefold plan`` applies to every layout it considers. With ``source`` (how
    the world was chosen: ``--nproc 1, the default``), a bad size is explained by ``layout_errors.explain``: the
    valid sizes for the model and the world the flags need."""
    from moefold.models.layer_factory import check_layout
    from moefold.parallel.dims import ParallelDims
    from moefold.training.cli.layout_errors import explain

    if source is not None and (message := explain(config, world_size, source)):
        raise ValueError(message)

    try:
        sizes, _ = config.resolve(world_size)
    except ValueError as exc:
        t = config.train
        if config.parallel.pp > 1 and any(word in str(exc) for word in ("schedule", "num_layers", "pipeline")):
            uneven = "".join(f", --decoder-{k}-pipeline-num-layers={v}" for k, v in
                             (("first", t.decoder_first_pipeline_num_layers),
                              ("last", t.decoder_last_pipeline_num_layers)) if v is not None)
            if t.pipeline_model_parallel_layout is not None:
                uneven += f", --pipeline-model-parallel-layout={t.pipeline_model_parallel_layout!r}"
            raise ValueError(f"{exc} (--num-layers={config.model.num_layers}, --pipeline-model-parallel-size="
                             f"{config.parallel.pp}, --num-layers-per-virtual-pipeline-stage="
                             f"{t.num_layers_per_virtual_pipeline_stage}{uneven}, --global-batch-size="
                             f"{t.global_batch_size}, --micro-batch-size={t.micro_batch_size})") from exc
        raise
    from moefold.training.optim.fsdp import check_fsdp

    check_fsdp(config.train, config.options, world_size)
    # check_layout reads the model, the options and tp, cp, ep, etp: once per those (``moefold plan`` validates
    # tens of thousands of layouts that share one model and options object and a few hundred such sizes)
    key = (id(config.model), id(config.options), sizes.tp, sizes.cp, sizes.ep, sizes.etp)
    entry = _CHECKED.get(key)
    if entry is None or entry[0] is not config.model or entry[1] is not config.options:
        error = None
        try:
            check_layout(config.model, ParallelDims(sizes=sizes), config.options)
        except ValueError as exc:
            error = exc
        if len(_CHECKED) > 4096:
            _CHECKED.clear()
        entry = _CHECKED[key] = (config.model, config.options, error)   # (the objects kept: their ids stay theirs)
    if entry[2] is not None:
        exc = entry[2]
        raise ValueError(f"{exc} (--tensor-model-parallel-size={sizes.tp}, --context-parallel-size={sizes.cp}, "
                         f"--expert-model-parallel-size={sizes.ep}, --expert-tensor-parallel-size={sizes.etp})"
                         ) from exc
    return sizes


_CHECKED: dict[tuple, tuple] = {}   # validate_layout's check_layout outcomes: (model, options, its ValueError or None)


def check_backends(config: RunConfig, ep: int, etp: int) -> None:
    """The optional GPU backends the flags choose are installed and can run here (ImportError /
    ValueError / RuntimeError naming what to install or use instead), before any rank starts."""
    from moefold.moe.gemm import check_gemm_backend

    if config.train.compile:
        from moefold.execution.compile import compile_unavailable

        reason = compile_unavailable("cuda" if torch.cuda.is_available() else "cpu")
        if reason is not None:
            raise RuntimeError(reason)
    o = config.options
    if config.model.num_experts:
        check_gemm_backend(o.gemm_backend, o.torch_dtype)
        if o.resolved_dispatcher(ep, etp) is DispatcherKind.FLEX:
            from moefold.dispatch.flex_backend import resolve_flex_backend

            resolve_flex_backend(o.moe_flex_dispatcher_backend)
    if o.linear_attention_backend == "fla" and "linear_attention" in (config.model.layer_types or ()):
        require_fla()
    if o.mamba_backend == "mamba_ssm" and "mamba" in (config.model.layer_types or ()):
        from moefold.dense.mamba2_kernels import require_mamba_ssm

        require_mamba_ssm()
    o.fp8.check_available()


def resolve_flex(config: RunConfig, world_size: int) -> tuple[RunConfig, str | None]:
    """With the flex dispatcher: ``config`` with ``--moe-flex-dispatcher-backend auto`` replaced by the installed
    DeepEP's backend (so every rank runs the same one) and the start-up line that states it; else (config, None)."""
    from moefold.dispatch.flex_backend import FlexBackend, describe_flex_backend, resolve_flex_backend

    sizes, _ = config.resolve(world_size)
    o = config.options
    if not config.model.num_experts or o.resolved_dispatcher(sizes.ep, sizes.etp) is not DispatcherKind.FLEX:
        return config, None
    backend = resolve_flex_backend(o.moe_flex_dispatcher_backend)
    if backend is FlexBackend.DEEPEP:
        from moefold.dispatch.deepep_elastic import check_elastic_layout

        check_elastic_layout(config.model.hidden_size, config.model.num_experts, sizes.ep, sizes.etp, o.fp8.dispatch)
    config = dataclasses.replace(config, options=dataclasses.replace(o, moe_flex_dispatcher_backend=backend))
    cpu_sync = o.flex.cpu_sync_for(o.gemm_backend.needs_host_counts or o.fp8.enabled)
    return config, describe_flex_backend(backend, hybrid=o.flex.hybrid, cpu_sync=cpu_sync, num_sms=o.flex.num_sms)
