"""The executor runs every schedule: loss and every gradient equal the unsplit model's (fp32, 1e-5).

One 4-rank gloo world hosts all layouts: a pp4 pipeline over all ranks, two pp2 pipelines
(the dp replicas of ParallelConfig(pp=2)) running different schedules at the same time, and a
pp3 pipeline on ranks 0-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moefold.parallel import ParallelConfig, ParallelDims
from moefold.parallel.groups import group_rank
from moefold.pipeline.executor import SequentialStage, reduce_step_losses, run_schedule
from moefold.pipeline.p2p import TensorSpec, batch_send_recv, next_rank, prev_rank, recv_forward, send_forward
from moefold.pipeline.schedules import build_schedule
from moefold.pipeline.stages import StageLayout
from tests.distributed import run_distributed
from tests.pipeline import toy

SPEC = TensorSpec((toy.ROWS, toy.HIDDEN))

# name -> (pp, schedule, vpp, microbatches, first_stage_layers, last_stage_layers)
PP4 = {
    "pp4-gpipe": (4, "gpipe", 1, 8, None, None),
    "pp4-1f1b": (4, "1f1b", 1, 8, None, None),
    "pp4-1f1b-m2": (4, "1f1b", 1, 2, None, None),
    "pp4-interleaved-v2": (4, "interleaved", 2, 8, None, None),
    "pp4-1f1b-uneven-1-1": (4, "1f1b", 1, 5, 1, 1),
}
# Two pp2 pipelines run at once; the dp index picks which config each runs.
PP2 = [
    {"pp2-gpipe": (2, "gpipe", 1, 4, None, None), "pp2-1f1b": (2, "1f1b", 1, 4, None, None),
     "pp2-interleaved-v2": (2, "interleaved", 2, 4, None, None)},
    {"pp2-interleaved-v4": (2, "interleaved", 4, 6, None, None), "pp2-1f1b-m3": (2, "1f1b", 1, 3, None, None),
     "pp2-1f1b-uneven-2-6": (2, "1f1b", 1, 4, 2, 6)},
]
# A pp3 pipeline on ranks 0-2 (rank 3 idles): odd pp, wrap-around of interleaved chunks, uneven split.
PP3 = {"pp3-interleaved-v2-uneven-2-2": (3, "interleaved", 2, 6, 2, 2),
       "pp3-gpipe-uneven-2-2": (3, "gpipe", 1, 2, 2, 2)}
CONFIGS = {**PP4, **PP2[0], **PP2[1], **PP3}


def _run(config: tuple, group) -> dict:
    pp, name, vpp, m, first, last = config
    rank = group_rank(group)
    model = toy.ToyStage(StageLayout(toy.NUM_LAYERS, pp, vpp, first, last), rank)
    result = run_schedule(model, build_schedule(name, pp, m, vpp), toy.microbatches(m), toy.loss_fn, group, SPEC)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    evaluation = run_schedule(model, build_schedule(name, pp, m, vpp, forward_only=True), toy.microbatches(m),
                              toy.loss_fn, group, SPEC)
    assert all(p.grad is None for p in model.parameters()) and evaluation.peak_in_flight == 0
    return {"pp_rank": rank, "grads": grads, "losses": result.losses, "extra": result.extra_loss,
            "peak": result.peak_in_flight, "eval_losses": evaluation.losses,
            "logged": reduce_step_losses(result, group)}


def _p2p_checks(group) -> dict:
    rank = group_rank(group)
    mine = torch.full((2, 3), float(rank))
    buf, h_recv = recv_forward(TensorSpec((2, 3)), group)
    h_send = send_forward(mine, group)
    h_recv.wait()
    h_send.wait()
    h_recv.wait()  # idempotent (a second gloo wait on a receive would hang)
    released = h_recv.works == () == h_send.works  # a waited handle no longer holds the batch's tensors
    # Both directions at once in one batch (the NCCL-deadlock-prone pattern).
    from_next, from_prev = torch.empty(4), torch.empty(4)
    batch_send_recv([(torch.full((4,), 10.0 + rank), next_rank(group)), (torch.full((4,), 20.0 + rank),
                     prev_rank(group))], [(from_next, next_rank(group)), (from_prev, prev_rank(group))], group).wait()
    return {"ring": buf, "from_next": from_next, "from_prev": from_prev, "released": released}


def _world() -> dict:
    dims4 = ParallelDims.build(ParallelConfig(pp=4))
    dims2 = ParallelDims.build(ParallelConfig(pp=2))
    out = {"p2p": _p2p_checks(dims4.pp_group)}
    for key, config in PP4.items():
        out[key] = _run(config, dims4.pp_group)
    dp_index = dist.get_rank() % 2  # ParallelConfig(pp=2) on 4 ranks: pipelines {0, 2} and {1, 3}
    for key, config in PP2[dp_index].items():
        out[key] = _run(config, dims2.pp_group)
    pp3 = dist.new_group([0, 1, 2])
    if dist.get_rank() < 3:
        for key, config in PP3.items():
            out[key] = _run(config, pp3)
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_distributed(_world, 4, timeout=240)


def test_p2p_ring_and_bidirectional(world):
    for rank, res in enumerate(world):
        p2p = res["p2p"]
        assert torch.equal(p2p["ring"], torch.full((2, 3), float((rank - 1) % 4)))
        assert torch.equal(p2p["from_next"], torch.full((4,), 20.0 + (rank + 1) % 4))
        assert torch.equal(p2p["from_prev"], torch.full((4,), 10.0 + (rank - 1) % 4))
        assert p2p["released"]


def _pipeline_ranks(world: list[dict], key: str) -> list[dict]:
    return [res[key] for res in world if key in res]


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_loss_and_grads_equal_world1(world, key):
    pp, _, _, m, _, _ = CONFIGS[key]
    ref_losses, ref_grads = toy.reference(m)
    ranks = _pipeline_ranks(world, key)
    assert len(ranks) == pp and sorted({r["pp_rank"] for r in ranks}) == list(range(pp))
    grads: dict[str, torch.Tensor] = {}
    for r in ranks:
        for name, g in r["grads"].items():
            assert name not in grads, f"{name} is held by two stages"
            grads[name] = g
    assert sorted(grads) == sorted(ref_grads), "stage parameter names must be the unsplit model's"
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-5, msg=f"{key}: grad of {name}")
    last = [r for r in ranks if r["pp_rank"] == pp - 1]
    for r in last:
        torch.testing.assert_close(torch.stack(r["losses"]), torch.stack(ref_losses), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.stack(r["eval_losses"]), torch.stack(ref_losses), rtol=0, atol=1e-5)
    assert all(r["losses"] == [] == r["eval_losses"] for r in ranks if r["pp_rank"] != pp - 1)
    # The metrics line: the same [mean loss, total extra loss] on every stage.
    ref_extra = toy.reference_extra(m)
    for r in ranks:
        torch.testing.assert_close(r["logged"], torch.stack([torch.stack(ref_losses).mean(), ref_extra]),
                                   rtol=0, atol=1e-5)
    # The extra losses stay where their layers live (no cross-stage reduction).
    holders = {r["pp_rank"] for r in ranks if r["extra"] is not None}
    layout = StageLayout(toy.NUM_LAYERS, pp, CONFIGS[key][2], *CONFIGS[key][4:])
    assert holders == {r for r in range(pp) if set(layout.rank_layers(r)) & set(toy.AUX_LAYERS)}


def test_1f1b_first_stage_holds_at_most_pp_microbatches(world):
    for key, (pp, name, _, m, _, _) in CONFIGS.items():
        peaks = {r["pp_rank"]: r["peak"] for r in _pipeline_ranks(world, key)}
        if name == "1f1b":
            assert peaks[0] == min(pp, m), (key, peaks)
            assert all(peaks[r] <= pp - r for r in peaks), (key, peaks)
        elif name == "gpipe":
            assert peaks[0] == m, (key, peaks)


def test_world1_executor_matches_plain_loop():
    ref_losses, ref_grads = toy.reference(4)
    for name in ("gpipe", "1f1b"):
        model = toy.ToyStage(StageLayout(toy.NUM_LAYERS), 0)
        res = run_schedule(model, build_schedule(name, 1, 4), toy.microbatches(4), toy.loss_fn, None, SPEC)
        torch.testing.assert_close(torch.stack(res.losses), torch.stack(ref_losses), rtol=0, atol=1e-6)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=0, atol=1e-6)


def test_loss_scale_scales_every_gradient_extra_losses_included():
    """fp16 loss scaling through the schedule: every gradient, those of the stage's extra (aux) losses too, is
    ``loss_scale`` times the unscaled one (a power of 2: exactly); the losses stay unscaled."""
    ref_losses, ref_grads = toy.reference(4)
    model = toy.ToyStage(StageLayout(toy.NUM_LAYERS), 0)
    res = run_schedule(model, build_schedule("1f1b", 1, 4), toy.microbatches(4), toy.loss_fn, None, SPEC,
                       loss_scale=1024.0)
    torch.testing.assert_close(torch.stack(res.losses), torch.stack(ref_losses), rtol=0, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad / 1024.0, ref_grads[n], rtol=0, atol=1e-6)


def test_sequential_stage_and_bad_calls():
    chunk = torch.nn.Linear(2, 1)
    stage = SequentialStage([chunk], input_of=lambda mb: mb[0])
    mbs = [(torch.ones(1, 2), torch.zeros(1, 1))] * 2
    loss_fn = lambda out, mb: (out - mb[1]).pow(2).sum()
    res = run_schedule(stage, build_schedule("1f1b", 1, 2), mbs, loss_fn, None, TensorSpec((1, 1)))
    assert len(res.losses) == 2 and res.extra_loss is None and res.peak_in_flight == 1
    with pytest.raises(ValueError, match="schedule is for pp=2 but the pipeline group has 1 ranks"):
        run_schedule(stage, build_schedule("1f1b", 2, 2), mbs, loss_fn, None, TensorSpec((1, 1)))
    with pytest.raises(ValueError, match="got 2 micro-batches for a schedule of num_microbatches=3"):
        run_schedule(stage, build_schedule("1f1b", 1, 3), mbs, loss_fn, None, TensorSpec((1, 1)))
    with pytest.raises(ValueError, match=r"shape \(1, 2\).*shape \(1, 1\)"):
        TensorSpec((1, 1)).check(torch.zeros(1, 2), "output")
