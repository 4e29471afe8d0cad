"""A toy pipelined model: embedding Linear(8->16), 8 Linear(16)+tanh layers, head Linear(16->4), MSE.

The linears are moefold's ``ColumnParallelLinear`` (tp = 1: plain ``F.linear``), so the split-backward
schedules can defer their weight gradients (``dense.split_backward``).

Built per (layout, pp_rank) with layers keyed by global index, so every stage's parameter names
are those of the unsplit model, and initialised layout-independently (per parameter name).
Layers in ``AUX_LAYERS`` add a toy extra loss (like an MoE aux loss) on whichever stage holds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moefold.dense.linear import ColumnParallelLinear
from moefold.parallel import init_parameters, normal_init, set_init
from moefold.pipeline.stages import StageLayout

NUM_LAYERS, HIDDEN, IN, OUT, ROWS = 8, 16, 8, 4, 3
AUX_LAYERS = (3, 5)
SEED = 11


def _linear(n_in: int, n_out: int) -> ColumnParallelLinear:
    return ColumnParallelLinear(n_in, n_out, None, bias=True)


class ToyStage(nn.Module):
    def __init__(self, layout: StageLayout, pp_rank: int) -> None:
        super().__init__()
        self.specs = layout.rank_chunks(pp_rank)
        self.layers = nn.ModuleDict({str(i): _linear(HIDDEN, HIDDEN) for i in layout.rank_layers(pp_rank)})
        self.embed = _linear(IN, HIDDEN) if any(s.has_embedding for s in self.specs) else None
        self.head = _linear(HIDDEN, OUT) if any(s.has_head for s in self.specs) else None
        for p in self.parameters():
            set_init(p, normal_init(0.4))
        init_parameters(self, SEED)

    def forward_step(self, chunk: int, hidden: Tensor | None, microbatch: dict) -> tuple[Tensor, Tensor | None]:
        spec = self.specs[chunk]
        h = self.embed(microbatch["x"]) if spec.has_embedding else hidden
        extra = None
        for i in spec.layers:
            h = torch.tanh(self.layers[str(i)](h))
            if i in AUX_LAYERS:
                aux = 0.1 * h.pow(2).mean()
                extra = aux if extra is None else extra + aux
        if spec.has_head:
            h = self.head(h)
        return h, extra


def loss_fn(output: Tensor, microbatch: dict) -> Tensor:
    return F.mse_loss(output, microbatch["y"])


def microbatches(m: int) -> list[dict]:
    out = []
    for i in range(m):
        gen = torch.Generator().manual_seed(1000 + i)
        out.append({"x": torch.randn(ROWS, IN, generator=gen), "y": torch.randn(ROWS, OUT, generator=gen)})
    return out


def reference(m: int) -> tuple[list[Tensor], dict[str, Tensor]]:
    """Unsplit model, plain loop: per-micro-batch losses and the gradients of mean(loss + extra)."""
    model = ToyStage(StageLayout(NUM_LAYERS), 0)
    losses, total = [], 0.0
    for mb in microbatches(m):
        out, extra = model.forward_step(0, None, mb)
        loss = loss_fn(out, mb)
        losses.append(loss.detach())
        total = total + (loss + extra) / m
    total.backward()
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def reference_extra(m: int) -> Tensor:
    """Mean over micro-batches of the unsplit model's total extra loss."""
    model = ToyStage(StageLayout(NUM_LAYERS), 0)
    with torch.no_grad():
        return sum(model.forward_step(0, None, mb)[1] for mb in microbatches(m)) / m
