"""``--cuda-graph-impl full_iteration``: each training step's forward and backward, every micro-batch, one graph.

    step = StepGraph(warmup_steps=3, device=device)
    step.run(forward_backward, inputs=[micro-batches...], accumulators=[loads, logged])

``forward_backward(inputs, accumulators)`` is the trainer's pp = 1 step without the optimizer (Megatron's
``FullCudaGraphWrapper`` also leaves it out): it reads ``inputs`` and adds into ``accumulators``, and the model's
gradients land in the main-grad buffers, whose addresses never change. Every tensor the step reads or writes must
live at a fixed address across steps, so ``run`` copies ``inputs`` and ``accumulators`` into static buffers (on the
device) before the step and the accumulators back out after it.

On CUDA: the first ``warmup_steps`` steps run eagerly on a side stream (lazy initialisation, cuBLAS workspaces,
NCCL communicators); the next is captured with ``torch.cuda.graph`` (``capture_error_mode="thread_local"``: the
autograd engine's device threads may allocate) into a pool of its own, after the generators in ``generators`` are
registered with the graph (``CUDAGraph.register_generator_state``; the default CUDA generator is registered by
torch itself), so replays draw fresh random numbers; that step and every later one replay it. Off CUDA every step
runs the capture-equivalent path: the same static buffers, the step run eagerly on them.

What the capture freezes, and so what ``training.build`` refuses beforehand (one line each): host values read in
the step (a host sync: dropless all-to-all, allgather), host state that hooks keep between micro-batches (the fused
gradient-accumulation flags, the overlapped gradient reduction's bucket counts at dp > 1, the parameter all-gather's
waits), a loss scale that changes (``--fp16``), a pipeline schedule's exchanges. Nothing here crosses ranks (the
captured step's own collectives aside).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


class StepGraph:
    """One training step's forward and backward as a graph (module docstring). ``steps``: how many ran;
    ``captured``: whether a graph replays them now (CUDA only)."""

    def __init__(self, warmup_steps: int, device: torch.device,
                 generators: Sequence[torch.Generator] = ()) -> None:
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"--cuda-graph-warmup-steps={warmup_steps!r} must be an integer >= 1")
        self.warmup_steps, self.device, self.generators = warmup_steps, torch.device(device), tuple(generators)
        self.on_cuda = self.device.type == "cuda"
        self.steps = 0
        self.graph = None
        self.inputs: list[Tensor] = []
        self.accumulators: list[Tensor] = []

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _load(self, inputs: Sequence[Tensor], accumulators: Sequence[Tensor]) -> None:
        """Copy this step's tensors into the static buffers (allocated at the first step, on the device)."""
        if not self.inputs:
            self.inputs = [torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in inputs]
            self.accumulators = [torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in accumulators]
        for bufs, ts, what in ((self.inputs, inputs, "input"), (self.accumulators, accumulators, "accumulator")):
            if len(bufs) != len(ts) or any(b.shape != t.shape or b.dtype != t.dtype for b, t in zip(bufs, ts)):
                raise RuntimeError(f"--cuda-graph-impl full_iteration: step {self.steps + 1}'s {what}s "
                                   f"{[(tuple(t.shape), t.dtype) for t in ts]} differ from the captured "
                                   f"{[(tuple(b.shape), b.dtype) for b in bufs]} (a dynamic shape)")
            for b, t in zip(bufs, ts):
                b.copy_(t, non_blocking=True)

    def run(self, forward_backward: Callable[[list[Tensor], list[Tensor]], None], inputs: Sequence[Tensor],
            accumulators: Sequence[Tensor]) -> None:
        """One step: ``forward_backward`` on the static buffers (eager, captured or replayed); ``accumulators``
        receive what it added."""
        self._load(inputs, accumulators)
        if not self.on_cuda:
            forward_backward(self.inputs, self.accumulators)
        elif self.graph is not None:
            self.graph.replay()
        elif self.steps < self.warmup_steps:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                forward_backward(self.inputs, self.accumulators)
            torch.cuda.current_stream(self.device).wait_stream(side)
        else:
            self._capture(forward_backward)
        for out, buf in zip(accumulators, self.accumulators):
            out.copy_(buf)
        self.steps += 1

    def _capture(self, forward_backward: Callable[[list[Tensor], list[Tensor]], None]) -> None:
        graph = torch.cuda.CUDAGraph()
        for gen in self.generators:
            graph.register_generator_state(gen)
        torch.cuda.synchronize(self.device)
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), capture_error_mode="thread_local"):
            forward_backward(self.inputs, self.accumulators)
        torch.cuda.synchronize(self.device)
        graph.replay()   # capturing ran nothing: this step is the first replay
        self.graph = graph


__all__ = ["StepGraph"]
