"""The training loop: micro-batches -> gradient accumulation -> reduce-scattered gradients -> clipped
distributed AdamW step -> parameter all-gather -> expert-bias update -> metrics -> checkpoints.

One step (``Trainer.train_step``) on every rank::

    for each of the step's num_micro micro-batches [mb, S+1] (this dp rank's, see training.data.sampler):
        inputs/labels = batch[:, :-1] / batch[:, 1:], cut to this rank's CP slice
        out = model(...);  (out.loss / num_micro).backward()      # loss share, see models.decoder
        (pp > 1: the same through pipeline.run_schedule and pipeline.DecoderStage)
    GradSync.finish()        # this rank's shard of the sum over dp x cp / tp x cp x dp / edp, / dp:
                             # the world-1 gradient
    norm = global grad norm; non-finite loss or norm -> skip (count; stop after max_skipped_steps in a row)
    DistributedAdamW.step(lr(step), clip)   ;  expert biases += f(global tokens per expert)

What crosses ranks per step: the gradient reduce-scatters (overlapped with backward), the embedding
gradient shard between first and last stage (pp > 1 with MTP/tied embeddings), one world all-reduce of
the logged losses (+ a non-finite flag), one of the grad norm, the parameter all-gathers (overlapped
with the next forward under --overlap-param-gather), and one world all-reduce of the per-layer expert
loads (expert-bias update and load metrics).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from moefold.dense.context_parallel import split_for_context_parallel
from moefold.dense.documents import packed_documents
from moefold.dispatch.flex_backend import FlexBackend
from moefold.execution import apply_execution
from moefold.models.layer_factory import is_moe_block
from moefold.moe.expert_bias import update_expert_bias
from moefold.moe.layer import MoEOutputInfo
from moefold.moe.quantile_balancing import update_quantile_biases
from moefold.parallel.dims import ParallelDims
from moefold.pipeline import run_schedule
from moefold.pipeline.decoder_stage import DecoderStage
from moefold.pipeline.overlap import OverlapConfig
from moefold.training.build import (
    build_model,
    build_optimizer,
    build_pipeline,
    execution_plan,
    flex_backend,
    load_initial_weights,
    model_options,
    moe_routers,
)
from moefold.training.checkpoint.files import CheckpointSaveError
from moefold.training.checkpoint.save import AsyncCheckpointer
from moefold.training.config import RunConfig
from moefold.training.data.sampler import batch_to_device
from moefold.training.launch.signals import STOP_FLAGS, StopRequest, agreed_stop, write_stop_flags
from moefold.training.observe.expert_counts import ROUTER_SUMS, add_expert_counts, add_micro_loads, per_step_router
from moefold.training.observe.imbalance import LoadRatioWatch, micro_batch_load_ratio
from moefold.training.observe.log_window import LogWindow
from moefold.training.optim.qk_clip import clip_qk
from moefold.training.routing_replay import open_replay_file, replay_routing, trainer_rows
from moefold.training.step_result import FitSummary, NonFiniteError, StepResult
from moefold.training.trainer_checkpoints import TrainerCheckpoints

if TYPE_CHECKING:
    from moefold.training.data.sampler import Samples
    from moefold.training.evaluate import Evaluator
    from moefold.training.observe.metrics import MetricsLogger


class Trainer(TrainerCheckpoints):
    """Builds the model, gradient sync and optimizer for ``config`` over ``dims`` and runs steps.

    ``microbatches(step)`` data are int64 ``[micro_batch_size, seq_length + 1]`` tensors of this dp rank.
    ``loss_hook(step, micro, loss)`` (tests) may replace a micro-batch's loss before backward.
    """

    def __init__(self, config: RunConfig, dims: ParallelDims, *, device: torch.device | str = "cpu",
                 log: Callable[[str], None] = print, eod_token: int | None = None) -> None:
        _, self.num_micro = config.resolve(dims.world_size)
        if config.train.data.packs_documents and eod_token is None:
            raise ValueError("--reset-position-ids, --reset-attention-mask and --eod-mask-loss split samples at the "
                             "end-of-document token: give the Trainer its id (eod_token; `moefold train` reads it "
                             "from the run's tokenizer)")
        # the end-of-document token id where samples pack documents (--reset-*, --eod-mask-loss), else None
        self.eod = eod_token if config.train.data.packs_documents else None
        self.config, self.dims, self.device = config, dims, torch.device(device)
        self.log = log if dims.rank == 0 else (lambda _msg: None)
        t = config.train
        self.param_dtype = model_options(config).dtype
        torch.manual_seed(t.seed)
        self.embed_group = None
        overlap = t.overlap_moe_expert_parallel_comm
        self.layout, self.pipeline = build_pipeline(config, dims, self.num_micro, self.log)
        self.model = build_model(config, dims, self.device)
        self.model.init_weights(t.seed)
        load_initial_weights(self.model, t)   # --load-hf / --load-megatron, unless resuming
        # recompute, offload, FP8, split backward, fusion, compile, FSDP2: one pass, once the weights are in
        self.execution = apply_execution(self.model, execution_plan(config, dims), dims, log=self.log)
        self.weight_store = self.execution.weight_store   # split backward (zero-bubble, --delay-wgrad-compute)
        self.compiled = self.execution.compiled
        self.step_graph = self.execution.step_graph   # --cuda-graph-impl full_iteration (execution.step_graph)
        self.overlap = OverlapConfig(t.delay_wgrad_compute, self.weight_store) if overlap else None
        self.routers = moe_routers(self.model)
        # quantile balancing's routers: their biases are set once per global batch (update_quantile_biases)
        self.qb_routers = [r for r in self.routers.values() if r.qb_beta is not None]
        # every MoE layer of the model (all stages) in logging order; this stage fills its own rows
        m = config.model
        self.moe_layers = [i for i in range(m.num_layers + m.mtp_num_layers) if m.num_experts and is_moe_block(m, i)]
        # the flex dispatcher on DeepEP V2 counts each expert's received copies (MoEOutputInfo.received_E)
        self.counts_received = bool(self.moe_layers) and flex_backend(config, dims) is FlexBackend.DEEPEP
        self.embed_group, self.sync, self.optimizer = build_optimizer(self.model, config, dims, self.execution.fsdp)
        # the observed routing imbalance against the plan's assumption (--moe-max-load-ratio)
        self.load_watch = (LoadRatioWatch(t.moe_max_load_ratio, self.log)
                           if t.moe_max_load_ratio is not None and self.moe_layers else None)
        self._micro_loads: Tensor | None = None
        self.schedule = t.lr_schedule()
        self.iteration = 0            # completed steps
        self.consumed_samples = 0     # global samples consumed
        self.skipped_in_a_row = 0
        self.loss_scaler = t.loss_scaler()   # --fp16 only (training.optim.loss_scaler)
        self.loss_hook: Callable[[int, int, Tensor], Tensor] | None = None
        # stopping early (training.launch.signals): the handlers' flag, the time limit, the step interval
        self.stop_request: StopRequest | None = None
        self.deadline = None if t.exit_duration_in_mins is None else time.monotonic() + 60 * t.exit_duration_in_mins
        self.async_saver = AsyncCheckpointer(dims, self.log) if t.async_save and t.save else None
        # --moe-routing-replay-file: every step replays the file's ids for its samples (training.routing_replay)
        self.routing_file = open_replay_file(config)

    # ------------------------------------------------------------------------------- one step
    def _split(self, batch: Tensor) -> dict[str, Any]:
        """A micro-batch of ``[B, S + 1]`` token ids -> the model's inputs on this rank (a ``DecoderStage``
        micro-batch without its index): ``input_ids`` and ``labels`` ``[B, S]`` (its CP part) and, where samples
        pack documents, their ``documents`` (planned from the host's copy of the ids, no device sync) and
        ``loss_mask`` (``--eod-mask-loss``: 0 where the input is the end-of-document token, as Megatron masks)."""
        cp, cp_rank = self.dims.cp, self.dims.cp_rank
        extra: dict[str, Any] = {}
        if self.eod is not None:
            t, host_ids = self.config.train, batch[:, :-1]
            documents = packed_documents(host_ids, self.eod, reset_position_ids=t.reset_position_ids,
                                         reset_attention_mask=t.reset_attention_mask, cp_rank=cp_rank, cp=cp)
            if documents is not None and documents.positions is not None:
                documents = dataclasses.replace(documents, positions=batch_to_device(documents.positions, self.device))
            if documents is not None:
                extra["documents"] = documents
            if t.eod_mask_loss:
                mask = batch_to_device((host_ids != self.eod).float(), self.device)
                extra["loss_mask"] = split_for_context_parallel(mask, cp_rank, cp, seq_dim=1).contiguous()
        batch = batch_to_device(batch, self.device)
        ids, labels = batch[:, :-1], batch[:, 1:]
        if cp > 1:
            ids = split_for_context_parallel(ids, cp_rank, cp, seq_dim=1)
            labels = split_for_context_parallel(labels, cp_rank, cp, seq_dim=1)
        return {"input_ids": ids.contiguous(), "labels": labels.contiguous(), **extra}

    def _forward_backward(self, microbatches: list[Tensor], loads: Tensor, logged: Tensor) -> None:
        """pp = 1: every micro-batch through the whole model. Fills ``loads`` [moe layers, E + 1] (selections,
        dropped copies) and ``logged`` (lm / (tp cp), aux share, mtp / (tp cp), non-finite count), local sums."""
        E, tpcp = self.config.model.num_experts, self.dims.tp * self.dims.cp
        states = None
        for m, batch in enumerate(microbatches):
            mb = self._split(batch)
            out = self.model(mb["input_ids"], mb["labels"], mb.get("loss_mask"), global_states=states,
                             documents=mb.get("documents"))
            states = out.global_states or None
            loss = out.loss
            if self.loss_hook is not None:
                loss = self.loss_hook(self.iteration, m, loss)
            (loss * (self._scale / self.num_micro)).backward()
            self._record_micro_loads(m, out.moe.items())
            # accumulated on the device: one host sync per step (after the all-reduce), not per micro-batch
            zero = torch.zeros((), device=logged.device)
            logged += torch.stack([out.lm_loss.detach().to(zero) / tpcp, out.aux_loss.detach().to(zero),
                                   out.mtp_loss.detach().to(zero) / tpcp if out.mtp_loss is not None else zero,
                                   (~torch.isfinite(loss.detach())).to(zero)]).to(logged.dtype)
            add_expert_counts(loads, out.moe.items(), self.moe_layers, E, self.config.model.moe_topk)

    def _pipeline_forward_backward(self, microbatches: list[Tensor], loads: Tensor, logged: Tensor) -> None:
        """pp > 1 (or the batch-level overlap at pp = 1): the pipeline schedule over this rank's chunks (same outputs
        as ``_forward_backward``; each
        stage adds what it holds: the last stage the lm/mtp losses, every stage its own layers' aux losses and
        loads, so the world all-reduce of ``train_step`` sums them across stages)."""
        dims = self.dims
        mbs = []
        for m, batch in enumerate(microbatches):
            mbs.append({"index": m, **self._split(batch)})
        ids = mbs[-1]["input_ids"]
        stage = DecoderStage(self.model, self.layout, dims.pp_rank, self.overlap)
        loss_fn = stage.loss_fn
        if self.loss_hook is not None:
            hook, step = self.loss_hook, self.iteration
            loss_fn = lambda out, mb: hook(step, mb["index"], stage.loss_fn(out, mb))
        spec = stage.activation_spec(ids.shape[0], ids.shape[1], self.device)
        # fp16: the schedule's backward starts from the scaled losses, the aux losses' included
        result = run_schedule(stage, self.pipeline, mbs, loss_fn, dims.pp_group if dims.pp > 1 else None, spec,
                              weight_store=self.weight_store, loss_scale=self._scale)
        tpcp = dims.tp * dims.cp
        zero = torch.zeros((), dtype=logged.dtype, device=logged.device)

        def total(values: Iterable[Tensor]) -> Tensor:
            values = list(values)
            return torch.stack(values).to(zero).sum() if values else zero

        aux = stage.aux_loss_sum()
        checked = [*result.losses, *([] if result.extra_loss is None else [result.extra_loss])]
        nonfinite = total((~torch.isfinite(v)).to(zero) for v in checked)
        logged += torch.stack([total(stage.lm_losses.values()) / tpcp, zero if aux is None else aux.to(zero),
                               total(stage.mtp_losses.values()) / tpcp, nonfinite])
        add_expert_counts(loads, ((layer, info) for (_, layer), info in stage.moe_infos.items()), self.moe_layers,
                          self.config.model.num_experts, self.config.model.moe_topk)
        for (m, layer), info in stage.moe_infos.items():
            self._record_micro_loads(m, [(layer, info)])

    def _record_micro_loads(self, micro: int, infos: Iterable[tuple[int, MoEOutputInfo]]) -> None:
        """Micro-batch ``micro``'s routed copies per layer and expert, for the imbalance watch (when it is on)."""
        if self._micro_loads is not None:
            add_micro_loads(self._micro_loads[micro], infos, self.moe_layers)

    @property
    def _scale(self) -> float:
        """The loss scale of this step (1 without ``--fp16``)."""
        return 1.0 if self.loss_scaler is None else self.loss_scaler.scale

    def _step_routing(self, routing: list[dict[int, Tensor]] | None) -> list[dict[int, Tensor]] | None:
        """The step's replayed ids per micro-batch (``train_step``'s ``routing``, else the replay file's rows of this
        rank's samples), or None: the routers choose."""
        if routing is not None:
            if len(routing) != self.num_micro:
                raise ValueError(f"train_step got routing for {len(routing)} micro-batches, expected {self.num_micro}")
            return routing
        if self.routing_file is None:
            return None
        mb = self.config.train.micro_batch_size
        return [self.routing_file.read(rows.start, rows.stop)
                for rows in (trainer_rows(self.dims, m, mb, self.consumed_samples) for m in range(self.num_micro))]

    def train_step(self, microbatches: list[Tensor], routing: list[dict[int, Tensor]] | None = None) -> StepResult:
        """Forward/backward over this rank's ``num_micro`` micro-batches and one optimizer step. Collective.

        ``routing``: routing replay (``training.routing_replay``), per micro-batch ``{MoE layer: int64 [mb, S, K]}``
        global expert ids over the whole sequence (every MoE layer of the model; a stage uses its own); None: the
        ``--moe-routing-replay-file`` rows of the step's samples, or the routers choose."""
        if len(microbatches) != self.num_micro:
            raise ValueError(f"train_step got {len(microbatches)} micro-batches, expected {self.num_micro}")
        routing = self._step_routing(routing)
        if routing is None:
            return self._train_step(microbatches)
        with replay_routing(self.model, routing, self.dims) as replayers:
            result = self._train_step(microbatches)
        short = {i: r.used for i, r in replayers.items() if r.used != self.num_micro}
        if short:
            raise RuntimeError(f"routing replay: MoE layers {sorted(short)} ran {sorted(set(short.values()))} forward "
                               f"calls in the step, not one per micro-batch ({self.num_micro})")
        return result

    def _train_step(self, microbatches: list[Tensor]) -> StepResult:
        dims, step = self.dims, self.iteration
        self.model.train()
        self.sync.start_step(self.num_micro)
        n_moe, E = len(self.moe_layers), self.config.model.num_experts
        # float64 sums of counts stay exact; per layer: selections [E], dropped, router sums, received copies [E]
        # (all zero unless counted)
        loads = torch.zeros(n_moe, E + 1 + ROUTER_SUMS + E, dtype=torch.float64, device=self.device)
        # lm, aux, mtp, non-finite count; then the stop flags (training.launch.signals: no collective of their own)
        logged = torch.zeros(4 + STOP_FLAGS, dtype=torch.float64, device=self.device)
        if self.load_watch is not None:
            self._micro_loads = torch.zeros(self.num_micro, n_moe, E, dtype=torch.float64, device=self.device)
        if self.pipeline is None and self.step_graph is not None:   # static buffers in, accumulators out
            self.step_graph.run(lambda mbs, acc: self._forward_backward(mbs, *acc), microbatches, [loads, logged[:4]])
        elif self.pipeline is None:
            self._forward_backward(microbatches, loads, logged[:4])
        else:
            self._pipeline_forward_backward(microbatches, loads, logged[:4])
        if self.execution.cuda_graphs is not None:   # --cuda-graph-impl local: captured after the warm-up steps
            self.execution.cuda_graphs.end_step()
        write_stop_flags(logged[4:], self.stop_request, self.deadline)
        self.overlapped_buckets = self.sync.launched_early
        self.sync.finish()   # (the embedding's two pipeline copies get the summed gradient there)
        if dims.world_size > 1:
            dist.all_reduce(logged)
            if n_moe:   # over the world: other pipeline stages add zeros to the rows they do not own
                dist.all_reduce(loads)
        logged[:3] /= self.num_micro * dims.dp
        # the step's one device->host copy: the logged values, the norm that decides skip/clip, the expert counts
        # and router sums (the optimizer step below reads them on the device: the expert-bias update), and the
        # imbalance. A second copy after the optimizer step would be a second host wait per step on a GPU.
        host = [logged, self.optimizer.grad_norm().to(logged).reshape(1), loads.reshape(-1)]
        if self._micro_loads is not None:
            host.append(micro_batch_load_ratio(self._micro_loads, dims.etp_ep_group, dims.world_size > 1).reshape(1))
            self._micro_loads = None
        values = torch.cat(host).tolist()
        load_ratio = values.pop() if len(host) == 4 else None
        n_logged = logged.numel()
        host_loads = torch.tensor(values[n_logged + 1:], dtype=torch.float64).reshape(loads.shape)   # host data
        *logged, grad_norm = values[:n_logged + 1]
        if load_ratio is not None:
            self.load_watch.observe(step + 1, load_ratio)
        scale = self._scale
        grad_norm /= scale   # fp16: the main grads hold scale x the gradient until the update unscales them
        lr = self.schedule(step)
        skipped = logged[3] > 0 or not math.isfinite(grad_norm)
        # fp16: a non-finite gradient with a finite loss is an overflow of the scaled gradients; the norm's world
        # all-reduce made it every rank's verdict, so every rank skips this step and backs the scale off together
        # (not counted towards --max-skipped-steps while the scale can still back off)
        overflow = (self.loss_scaler is not None and logged[3] == 0 and not math.isfinite(grad_norm)
                    and not self.loss_scaler.at_minimum)
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf=skipped)
        if overflow:
            self.log(f"step {step + 1}: fp16 gradients overflowed at loss scale {scale:g}; skipping the optimizer "
                     f"step (loss scale now {self.loss_scaler.scale:g})")
        elif skipped:
            self.skipped_in_a_row += 1
            self.log(f"step {step + 1}: non-finite {'loss' if logged[3] > 0 else 'gradient norm'} "
                     f"(grad norm {grad_norm}); skipping the optimizer step "
                     f"({self.skipped_in_a_row} in a row, limit {self.config.train.max_skipped_steps})")
            if self.skipped_in_a_row >= self.config.train.max_skipped_steps:
                raise NonFiniteError(f"{self.skipped_in_a_row} steps in a row had a non-finite loss or gradient "
                                     f"norm (limit max_skipped_steps={self.config.train.max_skipped_steps}); "
                                     "stopping. Lower --lr, enable --clip-grad, or check the data.")
        else:
            self.skipped_in_a_row = 0
            clip = self.config.train.clip_grad
            coef = min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0
            self.optimizer.step(lr, coef / scale)   # unscale and clip in one multiply
            if self.config.train.qk_clip:   # MuonClip: on the updated, gathered q/k projections
                self.optimizer.finish_param_sync()
                clip_qk(self.model, dims, self.optimizer, self.config.train.qk_clip_threshold,
                        self.config.train.qk_clip_alpha)
            for j, layer in enumerate(self.moe_layers):
                router = self.routers.get(layer)
                if router is not None and getattr(router, "expert_bias", None) is not None:
                    update_expert_bias(router, loads[j, :E].to(torch.float32), group=None)
        # quantile balancing: once per global batch, skipped step or not (Megatron: finalize_model_grads)
        if self.qb_routers:
            update_quantile_biases(self.qb_routers, self.qb_routers[0].groups.tp_cp_dp)
        self.iteration += 1
        t = self.config.train
        self.consumed_samples += t.global_batch_size
        loads = host_loads   # the expert counts and router sums, copied with the logged values
        return StepResult(step=self.iteration, loss_lm=float(logged[0]), loss_aux=float(logged[1]),
                          loss_mtp=float(logged[2]) if self.config.model.mtp_num_layers else None,
                          grad_norm=grad_norm, lr=lr, skipped=bool(skipped),
                          tokens=t.global_batch_size * t.seq_length,
                          tokens_per_expert=loads[:, :E] if n_moe else None, dropped=loads[:, E] if n_moe else None,
                          router=per_step_router(loads[:, E + 1:E + 1 + ROUTER_SUMS], self.num_micro * dims.dp)
                          if n_moe else None,
                          received_per_expert=loads[:, E + 1 + ROUTER_SUMS:] if n_moe and self.counts_received
                          else None,
                          max_load_ratio=load_ratio, stop=agreed_stop(logged[4:], self.iteration, t))

    def close(self, graceful: bool = True) -> None:
        """Release what the run holds on the device and the host: the gradient hooks on the parameters (their
        closures reach the model and the optimizer's buffers through autograd's C++ side, a cycle Python's collector
        cannot free: every finished in-process run kept its model, gradients and optimizer states, 17 GB of a
        proxy run on the H200), the parameter all-gathers' forward hooks, and, when ``graceful`` (no rank failed:
        these may wait on collectives), a background save and the CPU optimizer's worker. The trainer cannot step
        afterwards. Idempotent."""
        if graceful:
            self.finish_saves()
            self.optimizer.close()
        if self.routing_file is not None:
            self.routing_file.close()
        for owner in (self.sync, getattr(self.optimizer, "param_sync", None)):
            remove = getattr(owner, "remove_hooks", None)
            if remove is not None:
                remove()

    # ------------------------------------------------------------------------------- the loop
    def microbatch_iter(self, dataset: Samples) -> Iterator[Tensor]:
        from moefold.training.data import MicroBatchLoader

        loader = MicroBatchLoader(dataset, self.config.train.micro_batch_size, self.dims.dp_rank, self.dims.dp,
                                  consumed_samples=self.consumed_samples)
        return iter(loader)

    def fit(self, dataset: Samples, logger: MetricsLogger | None = None,
            on_step: Callable[[StepResult], None] | None = None, stop_at: int | None = None,
            evaluator: Evaluator | None = None) -> FitSummary:
        """Train from ``self.iteration`` to ``train_iters`` (or ``stop_at``) on ``dataset`` (samples of
        seq_length + 1 ids); logs through ``logger`` (a MetricsLogger, rank 0), validates when ``evaluator``
        says so (every rank), saves every ``save_interval`` (in the background with ``--async-save``) and at the
        end. Stops early, saving, when the ranks agree to (``StepResult.stop``: a signal, ``--exit-*``). Each
        step's result goes to ``on_step``; nothing per step is kept (host memory stays flat over any run)."""
        t = self.config.train
        last = t.train_iters if stop_at is None else min(stop_at, t.train_iters)
        batches = self.microbatch_iter(dataset)
        first = r = stop = None
        steps = 0
        window = LogWindow(self.config.model, self.moe_layers, t.moe_max_load_ratio)   # summed between records
        while self.iteration < last:
            r = self.train_step([next(batches) for _ in range(self.num_micro)])
            steps += 1
            first = first or r
            stop = r.stop
            if on_step is not None:
                on_step(r)
            window.add(r)
            if logger is not None:
                logger.advance()
                if r.step % t.log_interval == 0 or r.step == last or stop is not None:
                    window.log(logger, r)
            if r.step % t.log_interval == 0 or stop is not None:
                window.clear()
            if stop is not None:
                break
            if evaluator is not None and evaluator.due(r.step, last):
                evaluator()
            if t.save and t.save_interval and r.step % t.save_interval == 0 and r.step < last:
                try:
                    self.save(t.save, background=True)
                except CheckpointSaveError as exc:   # state intact: the next save tries again; the last must succeed
                    self.log(f"{exc}; training continues, the next save tries again")
        if self.async_saver is not None:   # the final save waits for the one in flight; its failure is a note
            try:
                self.async_saver.wait()
            except CheckpointSaveError as exc:
                self.log(f"{exc}")
        checkpoint = self.save(t.save) if t.save else None
        self.optimizer.finish_param_sync()
        return FitSummary(steps=steps, first=first, last=r, stop=stop, checkpoint=checkpoint)
