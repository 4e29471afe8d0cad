"""Every new mode gives the losses, reduced gradients and updated parameters (expert biases included) of the plain
order, through the real trainer, fp32: batch-level overlap (--overlap-moe-expert-parallel-comm, with and without
--delay-wgrad-compute) against plain gradient accumulation / 1F1B, the zero-bubble and DualPipeV schedules against
1F1B. DeepSeek-V3 tiny (MLA, a dense first layer, shared experts, expert bias, seq aux loss, MTP), 4 layers.

Layouts in one 4-rank world: ep2 (dp4, 3 micro-batches per rank), ep2 x tp2 (dp2), ep2 x cp2 (dp2), pp2 x ep2
(zb-h1, zbv, dualpipev with and without its FB pairs overlapped), pp2 x vpp2 x ep2 (interleaved + overlap); with
selective and full recompute; with torchao FP8 GEMMs and FP8 dispatch. The flex dispatcher (DeepEP's CPU
stand-in, bf16 tokens) in a 2-rank world. Bitwise where the summation order is unchanged: zb-h1 (its W accumulates
each weight's gradient as the plain backward does).
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.pipeline.overlap import Trace
from moefold.precision.fp8 import FP8Config
from tests.distributed import own_groups, run_distributed
from tests.training.test_trainer_layouts import _merged_grads, _run_observed
from tests.training.trainer_common import run, tiny_config

STEPS = 2
GRAD_RTOL = 1e-5   # on every reduced gradient element, relative to its parameter's largest gradient element
TOL = 1e-5         # absolute, on losses and updated weights

OVERLAP = {"overlap_moe_expert_parallel_comm": True}
DELAY = {**OVERLAP, "delay_wgrad_compute": True}
SELECTIVE = {"recompute": "selective", "recompute_modules": ("core_attn", "layernorm", "moe_act", "shared_experts",
                                                             "mla_up_proj")}
FULL = {"recompute": "full", "recompute_method": "block", "recompute_num_layers": 2}
V = {"num_layers_per_virtual_pipeline_stage": 1}     # 4 layers over pp2 x 2 chunks
# torchao FP8 GEMMs (linears and experts, their weight GEMMs deferred with the casts) and FP8 token dispatch
FP8 = {"fp8": FP8Config("hybrid", "tensorwise", dispatch=True)}

# name -> (layout, tiny_config kwargs, ModelOptions overrides, reference name, bitwise)
RUNS = {
    "ep2": (ParallelConfig(ep=2), {"global_batch_size": 12}, {}, None, False),
    "ep2.overlap": (ParallelConfig(ep=2), {"global_batch_size": 12, **OVERLAP}, {}, "ep2", False),
    "ep2.overlap.delay": (ParallelConfig(ep=2), {"global_batch_size": 12, **DELAY}, {}, "ep2", False),
    "ep2.selective": (ParallelConfig(ep=2), {"global_batch_size": 12}, SELECTIVE, None, False),
    "ep2.selective.overlap.delay": (ParallelConfig(ep=2), {"global_batch_size": 12, **DELAY}, SELECTIVE,
                                    "ep2.selective", False),
    "ep2.full": (ParallelConfig(ep=2), {"global_batch_size": 12}, FULL, None, False),
    "ep2.full.overlap": (ParallelConfig(ep=2), {"global_batch_size": 12, **OVERLAP}, FULL, "ep2.full", False),
    "ep2.fp8": (ParallelConfig(ep=2), {"global_batch_size": 8}, FP8, None, False),
    "ep2.fp8.overlap.delay": (ParallelConfig(ep=2), {"global_batch_size": 8, **DELAY}, FP8, "ep2.fp8", False),
    "tp2xep2": (ParallelConfig(tp=2, ep=2), {"global_batch_size": 6}, {}, None, False),
    "tp2xep2.overlap.delay": (ParallelConfig(tp=2, ep=2), {"global_batch_size": 6, **DELAY}, {}, "tp2xep2", False),
    "cp2xep2": (ParallelConfig(cp=2, ep=2), {"global_batch_size": 6}, {}, None, False),
    "cp2xep2.overlap.delay": (ParallelConfig(cp=2, ep=2), {"global_batch_size": 6, **DELAY}, {}, "cp2xep2", False),
    "pp2xep2.1f1b": (ParallelConfig(pp=2, ep=2), {"global_batch_size": 8}, {}, None, False),
    # split backward accumulates weight gradients autograd's way (no gradient-accumulation fusion): bitwise against
    # 1F1B without the fusion (the fused 1F1B sums the micro-batches inside the GEMMs: equal to rounding)
    "pp2xep2.1f1b.unfused": (ParallelConfig(pp=2, ep=2), {"global_batch_size": 8,
                                                          "gradient_accumulation_fusion": False}, {}, None, False),
    "pp2xep2.zb-h1": (ParallelConfig(pp=2, ep=2), {"global_batch_size": 8, "pipeline_schedule": "zb-h1"}, {},
                      "pp2xep2.1f1b.unfused", True),
    "pp2xep2.zbv": (ParallelConfig(pp=2, ep=2), {"global_batch_size": 8, "pipeline_schedule": "zbv", **V}, {},
                    "pp2xep2.1f1b", False),
    "pp2xep2.dualpipev": (ParallelConfig(pp=2, ep=2), {"global_batch_size": 8, "pipeline_schedule": "dualpipev",
                                                       **V}, {}, "pp2xep2.1f1b", False),
    "pp2xep2.dualpipev.overlap.delay": (ParallelConfig(pp=2, ep=2), {"global_batch_size": 8, "pipeline_schedule":
                                                                     "dualpipev", **V, **DELAY}, {}, "pp2xep2.1f1b",
                                        False),
    "pp2xvpp2xep2": (ParallelConfig(pp=2, ep=2), {"global_batch_size": 8, **V}, {}, None, False),
    "pp2xvpp2xep2.overlap": (ParallelConfig(pp=2, ep=2), {"global_batch_size": 8, **V, **OVERLAP}, {},
                             "pp2xvpp2xep2", False),
    "pp2xvpp2xep2.selective": (ParallelConfig(pp=2, ep=2), {"global_batch_size": 8, **V}, SELECTIVE, None, False),
    "pp2xvpp2xep2.overlap.delay.selective": (ParallelConfig(pp=2, ep=2), {"global_batch_size": 8, **V, **DELAY},
                                             SELECTIVE, "pp2xvpp2xep2.selective", False),
}


def _config(pc: ParallelConfig, kwargs: dict, options: dict, bf16: bool = False):
    config = tiny_config(pc, steps=STEPS, model={"num_layers": 4}, **kwargs)
    return dataclasses.replace(config, options=dataclasses.replace(config.options, **options,
                                                                   **({"dtype": "bf16"} if bf16 else {})))


def _summary(record: dict, dims: ParallelDims) -> dict:
    trainer = record.pop("trainer")
    return {"losses": record["losses"], "grads": record["grads"], "params": record["params"],
            "norms": record["norms"], "pp_rank": dims.pp_rank, "overlap": trainer.overlap is not None}


def _world() -> dict:
    out = {}
    for name, (pc, kwargs, options, _, _) in RUNS.items():
        with own_groups():
            dims = ParallelDims.build(pc)
            out[name] = _summary(_run_observed(_config(pc, kwargs, options), dims), dims)
    # the executed order of one step at ep2 with the overlap (gloo's asynchronous all-to-all)
    pc, kwargs, options, _, _ = RUNS["ep2.overlap"]
    trace = Trace()

    def record(trainer):
        trainer.overlap = dataclasses.replace(trainer.overlap, trace=trace)

    run(_config(pc, {**kwargs, "train_iters": 1}, options), ParallelDims.build(pc), setup=record)
    out["trace"] = trace.events
    # what is refused, before a step runs
    for kwargs, message in (({**OVERLAP, "pipeline_schedule": "1f1b"}, "needs virtual pipeline stages"),
                            ({**OVERLAP, "pipeline_schedule": "zb-h1"}, "has no forward/backward pairs")):
        pc = ParallelConfig(pp=2, ep=2)
        try:
            _config(pc, {"global_batch_size": 8, **kwargs}, {}).resolve(4)
            out[f"refused {kwargs}"] = None
        except ValueError as exc:
            out[f"refused {kwargs}"] = message if message in str(exc) else str(exc)
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_distributed(_world, 4, timeout=900)


def _merged_params(ranks: list[dict], name: str) -> dict:
    out = {}
    for r in ranks:
        out.update(r[name]["params"])
    return out


def _compare(ranks: list[dict], name: str, ref_name: str, bitwise: bool, grad_rtol: float, tol: float) -> None:
    got, ref = _merged_grads(ranks, name), _merged_grads(ranks, ref_name)
    assert len(got) == len(ref) == STEPS
    for step, (g, r) in enumerate(zip(got, ref)):
        assert sorted(g) == sorted(r)
        for n in r:
            scale = max(float(r[n].abs().max()), 1e-30)
            if bitwise:
                assert torch.equal(g[n], r[n]), f"{name} step {step}: {n} not bitwise"
            err = float((g[n] - r[n]).abs().max()) / scale
            assert err <= grad_rtol, f"{name} step {step}: reduced gradient of {n} off by {err:.2e} (relative)"
    for r in ranks:
        if r[name]["losses"]:
            torch.testing.assert_close(torch.tensor(r[name]["losses"]), torch.tensor(r[ref_name]["losses"]),
                                       rtol=0, atol=tol)
    p, q = _merged_params(ranks, name), _merged_params(ranks, ref_name)
    for n in q:   # updated weights and buffers (expert biases)
        torch.testing.assert_close(p[n], q[n], rtol=0, atol=tol, msg=f"{name}: {n} after {STEPS} steps")


@pytest.mark.parametrize("name", [n for n, spec in RUNS.items() if spec[3] is not None])
def test_mode_equals_plain_order(world, name):
    _, _, _, ref_name, bitwise = RUNS[name]
    assert any(r[name]["overlap"] for r in world) == ("overlap" in name)
    _compare(world, name, ref_name, bitwise, GRAD_RTOL, TOL)


def test_expert_bias_moved_and_is_compared(world):
    """The expert-bias update ran (the biases changed from zero) in every mode, so the comparison above covers it."""
    for name in RUNS:
        biases = {n: v for n, v in _merged_params(world, name).items() if "expert_bias" in n}
        assert biases and all(float(v.abs().sum()) > 0 for v in biases.values()), name


def test_overlap_interleaves_the_exchanges(world):
    """ep2, 3 micro-batches: F0, FB(1, 0), FB(2, 1), B2. In each FB step every all-to-all of one micro-batch (the
    dispatch and combine of its 3 MoE layers, forward or backward) starts before a computation of the other
    micro-batch (attention, experts) and is waited on after it."""
    for f_mb, b_mb in ((1, 0), (2, 1)):
        hidden, exposed = hidden_exchanges(world[0]["trace"], f_mb, b_mb)
        assert len(hidden) == 12 and not exposed, (f_mb, b_mb, hidden, exposed)
    # micro-batch 0's forward runs alone (F0): its 6 exchanges have nothing of another micro-batch to hide behind
    hidden, exposed = hidden_exchanges(world[0]["trace"], f_mb=0, b_mb=-1)
    assert hidden == [] and len(exposed) == 6


def test_refused_combinations_name_the_fix(world):
    for key, value in world[0].items():
        if key.startswith("refused"):
            assert value is not None and value in ("needs virtual pipeline stages", "has no forward/backward pairs"), \
                (key, value)


# --------------------------------------------------------------------------------------------- flex (stand-in)
def _flex_world() -> dict:
    from tests.dispatch import deepep_standin

    sys.modules["deep_ep"] = deepep_standin.module()
    pc = ParallelConfig(ep=2)
    dims = ParallelDims.build(pc)
    out = {}
    for name, kwargs in (("flex", {}), ("flex.overlap.delay", DELAY)):
        config = _config(pc, {"global_batch_size": 6, **kwargs}, {"dispatcher": "flex"}, bf16=True)
        out[name] = _summary(_run_observed(config, dims), dims)
    # the executed order, recorded, for one step of the overlapped run
    config = _config(pc, {"global_batch_size": 6, "train_iters": 1, **OVERLAP}, {"dispatcher": "flex"}, bf16=True)
    trace = Trace()

    def record(trainer):
        trainer.overlap = dataclasses.replace(trainer.overlap, trace=trace)

    run(config, dims, setup=record)
    out["trace"] = trace.events
    # DeepEP V2 (the ElasticBuffer stand-in): its dispatch and combine run as the same staged exchanges
    from tests.dispatch import deepep_elastic_standin

    sys.modules["deep_ep"] = deepep_elastic_standin.module()
    v2 = {"dispatcher": "flex", "moe_flex_dispatcher_backend": "deepep"}
    for name, kwargs in (("v2", {}), ("v2.overlap.delay", DELAY)):
        out[name] = _summary(_run_observed(_config(pc, {"global_batch_size": 6, **kwargs}, v2, bf16=True), dims), dims)
    return out


@pytest.fixture(scope="module")
def flex_world() -> list[dict]:
    return run_distributed(_flex_world, 2, timeout=600)


def test_flex_overlap_equals_plain(flex_world):
    # bf16 parameters and activations: the same kernels, summed in another order at the cuts
    _compare(flex_world, "flex.overlap.delay", "flex", False, grad_rtol=2e-2, tol=2e-2)
    assert flex_world[0]["flex.overlap.delay"]["overlap"]


def test_flex_on_deepep_v2_overlap_equals_plain(flex_world):
    _compare(flex_world, "v2.overlap.delay", "v2", False, grad_rtol=2e-2, tol=2e-2)
    assert flex_world[0]["v2.overlap.delay"]["overlap"]


def hidden_exchanges(events: list, f_mb: int, b_mb: int) -> tuple[list[str], list[str]]:
    """In the FB step of forward ``f_mb`` and backward ``b_mb``: (the exchanges of either that had a compute of the
    other start after they started and end before they ended, those that did not)."""
    spans: dict[tuple[str, str], list[int]] = {}
    for i, (_, tag, phase, _) in enumerate(events):
        direction = "backward" if "backward" in phase else "forward"
        spans.setdefault((tag, direction), []).append(i)
    mine = {f"mb{f_mb}.": "forward", f"mb{b_mb}.": "backward"}
    hidden, exposed = [], []
    for (tag, direction), (start, end) in spans.items():
        prefix = tag.split("chunk")[0]
        if events[start][0] != "exchange" or mine.get(prefix) != direction:
            continue
        other = f"mb{b_mb}." if prefix == f"mb{f_mb}." else f"mb{f_mb}."
        inside = [t for (t, d), (s, e) in spans.items() if t.startswith(other) and events[s][0] == "compute"
                  and d == mine[other] and start < s and e < end]
        (hidden if inside else exposed).append(f"{tag} {direction}")
    return hidden, exposed


def test_flex_overlap_interleaves_the_exchanges(flex_world):
    """FB(1, 0): every dispatch/combine of micro-batch 1's forward and of micro-batch 0's backward (the DeepEP
    stand-in's exchanges) starts before a computation of the other micro-batch and is waited on after it."""
    hidden, exposed = hidden_exchanges(flex_world[0]["trace"], f_mb=1, b_mb=0)
    assert len(hidden) == 12 and not exposed, (hidden, exposed)   # 3 MoE layers x (dispatch, combine) x 2 sides
