"""Rank grid: group membership against explicit rank lists, and layout validation."""

import pytest

from moefold.parallel import ParallelConfig, ParallelDims, group_ranks
from tests.distributed import run_distributed

GROUPS = ("tp", "cp", "dp", "pp", "ep", "etp", "edp", "tp_cp", "dp_cp", "tp_cp_dp", "etp_ep")


def _all_memberships(configs: list[ParallelConfig]) -> list[dict]:
    """On each rank, for each layout: {group name: global ranks of this rank's group}, coordinates."""
    out = []
    for config in configs:
        dims = ParallelDims.build(config)
        row = {g: group_ranks(getattr(dims, f"{g}_group")) for g in GROUPS}
        row["coords"] = {d: getattr(dims, f"{d}_rank") for d in ("tp", "cp", "dp", "pp", "ep", "etp", "edp")}
        out.append(row)
    return out


def _groups_of(results: list[list[dict]], layout: int, name: str) -> list[list[int]]:
    """The distinct groups of ``name`` over all ranks, sorted."""
    return [list(g) for g in sorted({tuple(r[layout][name]) for r in results})]


WORLD8 = [
    ParallelConfig(tp=2, pp=2, ep=2, etp=1),          # tp2/dp2/pp2, experts etp1/ep2/edp2
    ParallelConfig(tp=2, pp=2, ep=2, etp=2),          # tp2/dp2/pp2, experts etp2/ep2/edp1
    ParallelConfig(tp=2, cp=2, ep=4, etp=1),          # tp2/cp2/dp2, experts etp1/ep4/edp2
]


@pytest.fixture(scope="module")
def world8():
    return run_distributed(_all_memberships, 8, WORLD8)


def test_tp2_dp2_pp2_dense_groups(world8):
    assert _groups_of(world8, 0, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _groups_of(world8, 0, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _groups_of(world8, 0, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _groups_of(world8, 0, "cp") == [[r] for r in range(8)]
    assert _groups_of(world8, 0, "dp_cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _groups_of(world8, 0, "tp_cp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _groups_of(world8, 0, "tp_cp_dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_tp2_dp2_pp2_experts_etp1_ep2(world8):
    assert _groups_of(world8, 0, "etp") == [[r] for r in range(8)]
    assert _groups_of(world8, 0, "ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _groups_of(world8, 0, "edp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _groups_of(world8, 0, "etp_ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _groups_of(world8, 0, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_tp2_dp2_pp2_experts_etp2_ep2(world8):
    assert _groups_of(world8, 1, "etp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _groups_of(world8, 1, "ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _groups_of(world8, 1, "edp") == [[r] for r in range(8)]
    assert _groups_of(world8, 1, "etp_ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _groups_of(world8, 1, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_tp2_cp2_dp2_experts_etp1_ep4(world8):
    assert _groups_of(world8, 2, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _groups_of(world8, 2, "cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _groups_of(world8, 2, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _groups_of(world8, 2, "pp") == [[r] for r in range(8)]
    assert _groups_of(world8, 2, "tp_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _groups_of(world8, 2, "dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert _groups_of(world8, 2, "tp_cp_dp") == [list(range(8))]
    assert _groups_of(world8, 2, "ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _groups_of(world8, 2, "edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _groups_of(world8, 2, "etp_ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_coordinates_follow_rank_order(world8):
    # rank 5 in tp2/cp2/dp2: tp 1, cp 0, dp 1; experts etp1/ep4: ep 1, edp 1
    assert world8[5][2]["coords"] == {"tp": 1, "cp": 0, "dp": 1, "pp": 0, "ep": 1, "etp": 0, "edp": 1}
    # rank 6 in tp2/dp2/pp2 with etp2/ep2: tp 0, dp 1, pp 1; etp 0, ep 1
    assert world8[6][1]["coords"] == {"tp": 0, "cp": 0, "dp": 1, "pp": 1, "ep": 1, "etp": 0, "edp": 0}


def test_world4_tp4_folded_into_ep4():
    results = run_distributed(_all_memberships, 4, [ParallelConfig(tp=4, ep=4)])
    assert _groups_of(results, 0, "tp") == [[0, 1, 2, 3]]
    assert _groups_of(results, 0, "dp") == [[0], [1], [2], [3]]
    assert _groups_of(results, 0, "ep") == [[0, 1, 2, 3]]
    assert _groups_of(results, 0, "etp") == [[0], [1], [2], [3]]
    assert _groups_of(results, 0, "edp") == [[0], [1], [2], [3]]
    assert [r[0]["coords"]["ep"] for r in results] == [0, 1, 2, 3]


def test_single_process_has_no_groups():
    dims = ParallelDims.build(ParallelConfig())
    assert dims.world_size == 1 and dims.tp_group is None and dims.etp_ep_group is None
    assert (dims.tp_rank, dims.ep_rank, dims.is_first_stage, dims.is_last_stage) == (0, 0, True, True)


@pytest.mark.parametrize(
    "config, world, message",
    [
        (ParallelConfig(tp=3), 8, "world_size=8 is not divisible by tp*cp*pp=3*1*1=3"),
        (ParallelConfig(tp=2, cp=2, pp=4), 8, "not divisible by tp*cp*pp=2*2*4=16"),
        (ParallelConfig(tp=2, dp=3), 8, "tp*cp*dp*pp=2*1*3*1=6 does not equal world_size=8"),
        (ParallelConfig(tp=2, pp=2, ep=8), 8, "etp*ep=1*8=8 does not divide tp*cp*dp=2*1*2=4"),
        (ParallelConfig(ep=3, etp=2), 8, "etp*ep=2*3=6 does not divide tp*cp*dp=1*1*8=8"),
        (ParallelConfig(tp=0), 8, "tp=0 must be a positive integer"),
        (ParallelConfig(ep=-2), 8, "ep=-2 must be a positive integer"),
        (ParallelConfig(dp=0), 8, "dp=0 must be a positive integer"),
        (ParallelConfig(), 0, "world_size=0 must be a positive integer"),
    ],
)
def test_invalid_layouts_name_the_numbers(config, world, message):
    with pytest.raises(ValueError) as err:
        config.resolve(world)
    assert message in str(err.value)


def test_resolve_infers_dp_and_edp():
    s = ParallelConfig(tp=2, cp=2, ep=4).resolve(16)
    assert (s.dp, s.edp) == (4, 4)
    s = ParallelConfig(tp=4, pp=2, ep=2, etp=2).resolve(16)
    assert (s.dp, s.edp) == (2, 2)


def _init_under_launcher() -> tuple[int, int, str]:
    from moefold.parallel import init_distributed

    dims = init_distributed(ParallelConfig(tp=2, ep=2))
    return dims.tp, dims.dp, dims.device_type


def test_init_distributed_joins_the_launched_world():
    assert run_distributed(_init_under_launcher, 4) == [(2, 2, "cpu")] * 4


def test_init_distributed_alone_is_world_one(monkeypatch):
    from moefold.parallel import init_distributed

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dims = init_distributed(ParallelConfig())
    assert dims.world_size == 1 and dims.tp_group is None
    with pytest.raises(ValueError, match="world_size=1 is not divisible by tp\\*cp\\*pp=2\\*1\\*1=2"):
        init_distributed(ParallelConfig(tp=2))
