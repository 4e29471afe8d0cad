"""FSDP2 with expert parallelism (``--use-torch-fsdp2``, ``training.optim.fsdp``) against world 1 and the
distributed optimizer, through the trainer (DeepSeek-V3 tiny: MLA, dense + MoE layers, shared experts, expert
bias, MTP; fp32, 3 steps).

- Losses, every step's reduced gradients (each FSDP shard gathered, then the tp/ep shards), the gradient norm and
  the updated parameters (expert biases included) equal world 1 at dp2 and dp2 x ep2 (one 2-rank world) and at
  tp2 x dp2, pp2 x dp2 (1F1B), tp2 x ep2 x dp2 (experts sharded over edp 2), cp2 x dp2 and ep2 x etp2 x dp4
  (one 4-rank world).
- Memory, counted from the tensors: at dp2 each rank's sharded parameters, gradients and moments are half of the
  replicated ones (world 1's), to FSDP's padding, and the ranks' unpadded shards add up to them exactly; with
  tp2 x ep2 x dp2 the experts' weights are sharded over edp and the rest over dp x cp / tp x cp x dp.
- Resume is bit-identical to an uninterrupted run at the same layout after a round trip through the other
  optimizer and through world 1: FSDP -> distributed optimizer -> FSDP, distributed optimizer -> FSDP ->
  distributed optimizer, FSDP -> world 1 -> FSDP, world 1 -> FSDP -> world 1 (a checkpoint written at one and
  read at the other, DCP resharding between FSDP's boxes and the distributed optimizer's).
- What FSDP does not compose with is refused with one line.
"""

from __future__ import annotations

import pytest
import torch

from moefold.execution.fsdp import fsdp_units
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.config import TrainConfig
from moefold.training.observe.memory import static_bytes
from moefold.training.optim.fsdp import check_fsdp
from tests.distributed import run_distributed
from tests.training.trainer_common import observe, run, tiny_config

STEPS = 3
TOL = 1e-4          # absolute, losses and weights
GRAD_RTOL = 1e-4    # every reduced-gradient element, relative to its parameter's largest element
NORM_RTOL = 1e-5
FSDP = {"use_torch_fsdp2": True}
WORLD2 = {"dp2": ParallelConfig(), "dp2xep2": ParallelConfig(ep=2)}
WORLD4 = {"tp2.dp2": ParallelConfig(tp=2), "pp2.dp2": ParallelConfig(pp=2), "tp2xep2.dp2": ParallelConfig(tp=2, ep=2),
          "cp2.dp2": ParallelConfig(cp=2), "ep2xetp2.dp4": ParallelConfig(ep=2, etp=2)}


def _observed(config, dims=None) -> dict:
    record: dict = {}
    losses, params, trainer = run(config, dims, setup=lambda t: observe(t, record))
    return {**record, "losses": losses, "params": params, "trainer": trainer}


def _layouts(layouts: dict[str, ParallelConfig]) -> dict:
    out = {}
    for name, pc in layouts.items():
        dims = ParallelDims.build(pc)
        r = _observed(tiny_config(pc, steps=STEPS, **FSDP), dims)
        trainer = r.pop("trainer")
        r["units"] = len(list(fsdp_units(trainer.model)))
        r["static"] = static_bytes(trainer.sync, trainer.optimizer)
        r["unpadded"] = sum(p.to_local().numel() for p in trainer.sync.params.values())
        r["meshes"] = {n: p.device_mesh.size() for n, p in trainer.sync.params.items()}
        r["pp_rank"] = dims.pp_rank
        out[name] = r
    return out


@pytest.fixture(scope="module")
def reference() -> dict:
    r = _observed(tiny_config(steps=STEPS))
    trainer = r.pop("trainer")
    r["static"] = static_bytes(trainer.sync, trainer.optimizer)
    r["numel"] = sum(p.numel() for p in trainer.model.parameters())
    return r


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_distributed(_layouts, 2, WORLD2, timeout=400)


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return run_distributed(_layouts, 4, WORLD4, timeout=600)


def _compare(ranks: list[dict], name: str, ref: dict) -> None:
    steps = len(ref["grads"])
    for s in range(steps):
        got = {}
        for r in ranks:   # pipeline stages hold different parameters
            got.update(r[name]["grads"][s])
        assert got.keys() == ref["grads"][s].keys(), sorted(set(got) ^ set(ref["grads"][s]))
        for k, v in ref["grads"][s].items():
            err = (got[k] - v).abs().max().item() / v.abs().max().item()
            assert err <= GRAD_RTOL, f"{name} step {s + 1}: reduced gradient of {k} differs by {err:.2e}"
    norms = ranks[0][name]["norms"]
    assert all(r[name]["norms"] == norms for r in ranks)
    assert max(abs(a - b) / b for a, b in zip(norms, ref["norms"])) <= NORM_RTOL, (norms, ref["norms"])
    assert torch.allclose(torch.tensor(ranks[0][name]["losses"]), torch.tensor(ref["losses"]), atol=TOL, rtol=0)
    params = {}
    for r in ranks:
        params.update(r[name]["params"])
    assert params.keys() == ref["params"].keys()
    for k, v in ref["params"].items():
        assert (params[k] - v).abs().max().item() <= TOL, k


@pytest.mark.parametrize("name", list(WORLD2))
def test_world2_layouts_equal_world1(world2, reference, name) -> None:
    _compare(world2, name, reference)


@pytest.mark.parametrize("name", list(WORLD4))
def test_world4_layouts_equal_world1(world4, reference, name) -> None:
    _compare(world4, name, reference)


def test_sharded_bytes_are_a_dp_share(world2, world4, reference) -> None:
    replicated = reference["static"]
    per_param = replicated["params"] // reference["numel"]          # fp32: 4 bytes per element
    assert replicated["grads"] == replicated["params"] and replicated["optimizer"] == 2 * replicated["params"]
    ranks = [r["dp2"] for r in world2]
    padding = ranks[0]["units"] * 64 * per_param    # FSDP pads each shard to equal size: a few rows per parameter
    for r in ranks:
        s = r["static"]
        assert s["params"] <= replicated["params"] / 2 + padding, (s, replicated)
        assert s["grads"] <= replicated["grads"] / 2 + padding
        assert s["exp_avg"] + s["exp_avg_sq"] <= replicated["optimizer"] / 2 + 2 * padding
        assert s["master"] == 0 and s["host_optimizer"] == 0
    assert sum(r["unpadded"] for r in ranks) == reference["numel"]   # every element held once over dp
    assert sum(r["static"]["grads"] for r in ranks) == replicated["grads"]
    assert sum(r["static"]["exp_avg"] for r in ranks) == replicated["exp_avg"]
    # tp2 x ep2 x dp2: experts over edp (2 ranks), routers and sequence-parallel norms over tp x cp x dp (4), the
    # rest over dp x cp (2)
    meshes = world4[0]["tp2xep2.dp2"]["meshes"]
    assert {meshes[n] for n in meshes if ".experts." in n} == {2}
    assert {meshes[n] for n in meshes if n.endswith("router.weight")} == {4}
    assert {meshes[n] for n in meshes if n.endswith("input_layernorm.weight")} == {4}
    assert {meshes[n] for n in meshes if n.endswith("o_proj.weight")} == {2}


# ----------------------------------------------------------------------------------------------- resume
RESUME_STEPS = 4


def _config(fsdp: bool, save: str | None = None):
    return tiny_config(steps=RESUME_STEPS, save=save, **(FSDP if fsdp else {}))


def _chain(root: str, first: bool, second: bool) -> dict:
    """At dp2: ``first`` (FSDP?) 2 steps and save; ``second`` loads and saves again (no step); ``first`` loads that
    and finishes; and ``first`` uninterrupted."""
    dims = ParallelDims.build(ParallelConfig())
    run(_config(first, f"{root}/a"), dims, stop_at=2)
    run(_config(second, f"{root}/b"), dims, load=f"{root}/a", stop_at=2)
    losses, resumed, _ = run(_config(first), dims, load=f"{root}/b")
    full_losses, full, _ = run(_config(first), dims)
    return {"losses": losses, "resumed": resumed, "full_losses": full_losses[2:], "full": full}


def _leg(root: str, load: str | None, save: str | None, stop_at: int | None) -> dict:
    dims = ParallelDims.build(ParallelConfig())
    losses, params, _ = run(_config(True, save), dims, load=load, stop_at=stop_at)
    return {"losses": losses, "params": params}


def _identical(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert torch.equal(v, b[k]), f"{what}: {k}"


@pytest.mark.parametrize("chain", ["fsdp->distopt->fsdp", "distopt->fsdp->distopt"])
def test_resume_through_the_other_optimizer_is_bit_identical(tmp_path, chain) -> None:
    first = chain.startswith("fsdp")
    for r in run_distributed(_chain, 2, str(tmp_path), first, not first, timeout=400):
        assert r["losses"] == r["full_losses"]
        _identical(r["resumed"], r["full"], chain)


def test_resume_through_world1_is_bit_identical(tmp_path) -> None:
    root = str(tmp_path)
    # FSDP dp2 -> world 1 -> FSDP dp2
    run_distributed(_leg, 2, root, None, f"{root}/a", 2, timeout=300)
    run(_config(False, f"{root}/b"), load=f"{root}/a", stop_at=2)
    resumed = run_distributed(_leg, 2, root, f"{root}/b", None, None, timeout=300)
    full = run_distributed(_leg, 2, root, None, None, None, timeout=300)
    for r, f in zip(resumed, full):
        assert r["losses"] == f["losses"][2:]
        _identical(r["params"], f["params"], "fsdp->world1->fsdp")
    # world 1 -> FSDP dp2 -> world 1
    run(_config(False, f"{root}/c"), stop_at=2)
    run_distributed(_leg, 2, root, f"{root}/c", f"{root}/d", 2, timeout=300)
    losses, params, _ = run(_config(False), load=f"{root}/d")
    full_losses, full_params, _ = run(_config(False))
    assert losses == full_losses[2:]
    _identical(params, full_params, "world1->fsdp->world1")


def _bf16(root: str) -> dict:
    dims = ParallelDims.build(ParallelConfig())
    fsdp_losses, fsdp_params, _ = run(tiny_config(steps=STEPS, bf16=True, save=f"{root}/f", **FSDP), dims)
    losses, _, _ = run(tiny_config(steps=STEPS, bf16=True), dims)
    _, _, loaded = run(tiny_config(steps=STEPS, bf16=True), dims, load=f"{root}/f")
    masters = {}
    for s in loaded.optimizer.slices:   # the distributed optimizer's fp32 masters, read from FSDP's shards
        for p in s.pieces:
            masters[f"{p.name}@{p.lo}"] = (p.name, p.lo, p.hi, p.of(s.master).clone())
    return {"fsdp": fsdp_losses, "distopt": losses, "fsdp_params": fsdp_params, "masters": masters}


def test_bf16_fp32_masters_and_checkpoint(tmp_path) -> None:
    """bf16: FSDP's fp32 shards are the masters (gathered in bf16 for compute): the losses follow the distributed
    optimizer's bf16 run, and its checkpoint's ``optim.<p>.master`` fills the distributed optimizer's masters with
    FSDP's values exactly."""
    for r in run_distributed(_bf16, 2, str(tmp_path), timeout=400):
        assert torch.allclose(torch.tensor(r["fsdp"]), torch.tensor(r["distopt"]), atol=2e-3, rtol=0)
        assert r["masters"]
        for name, lo, hi, master in r["masters"].values():
            full = r["fsdp_params"][name].flatten()   # FSDP: the fp32 master, gathered
            assert torch.equal(master, full[lo:hi]), name


# ----------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("train", "world", "message"), [
    ({}, 1, "a world of one rank"),
    ({"optimizer_cpu_offload": True}, 2, "--optimizer-cpu-offload"),
    ({"overlap_param_gather": True}, 2, "--overlap-param-gather"),
    ({"overlap_grad_reduce": False}, 2, "--no-overlap-grad-reduce"),
    ({"exp_avg_dtype": "bf16"}, 2, "bf16 moments"),
    ({"compile": True}, 2, "--compile"),
])
def test_refused_with_one_line(train: dict, world: int, message: str) -> None:
    t = TrainConfig(use_torch_fsdp2=True, **train)
    with pytest.raises(ValueError, match=message) as info:
        check_fsdp(t, tiny_config().options, world)
    assert "\n" not in str(info.value) and str(info.value).startswith("--use-torch-fsdp2 with ")

