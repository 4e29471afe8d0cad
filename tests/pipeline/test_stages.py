"""Stage split: Megatron's interleaved assignment, uneven first/last stages, clear errors, same names."""

import pytest
import torch

from moefold.pipeline.stages import StageLayout, vpp_from_layers_per_virtual_stage
from tests.pipeline import toy


def _layers(layout: StageLayout) -> dict[tuple[int, int], list[int]]:
    return {(r, c): list(layout.chunk_spec(r, c).layers) for r in range(layout.pp) for c in range(layout.vpp)}


def test_even_and_interleaved_split():
    assert _layers(StageLayout(8, 2)) == {(0, 0): [0, 1, 2, 3], (1, 0): [4, 5, 6, 7]}
    # chunk c of rank r holds model chunk c*pp + r
    assert _layers(StageLayout(8, 2, 2)) == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}
    layout = StageLayout(16, 4, 2)
    assert layout.rank_layers(1) == [2, 3, 10, 11]
    assert [layout.model_chunk(r, 1) for r in range(4)] == [4, 5, 6, 7]
    firsts = [(s.pp_rank, s.chunk) for r in range(4) for s in layout.rank_chunks(r) if s.has_embedding]
    lasts = [(s.pp_rank, s.chunk) for r in range(4) for s in layout.rank_chunks(r) if s.has_head]
    assert firsts == [(0, 0)] and lasts == [(3, 1)]
    assert "pp rank 3: chunk 0: layers 6-7; chunk 1: layers 14-15 +norm/head/loss/MTP" in layout.describe()


def test_uneven_first_last_like_megatron():
    # 14 layers, pp4: first 2, last 4, the middle 8 split over ranks 1 and 2
    assert [StageLayout(14, 4, 1, 2, 4).rank_layers(r) for r in range(4)] == [
        [0, 1], [2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13]]
    # with vpp 2 each rank's count is halved per chunk, rounds hold consecutive layers
    layout = StageLayout(14, 4, 2, 2, 4)
    assert _layers(layout)[(0, 0)] == [0] and _layers(layout)[(3, 0)] == [5, 6]
    assert _layers(layout)[(0, 1)] == [7] and _layers(layout)[(3, 1)] == [12, 13]
    # only --decoder-last: the remaining layers split over the other ranks; embedding-only first stage
    assert StageLayout(7, 4, last_stage_layers=1).per_round_counts == (2, 2, 2, 1)
    assert StageLayout(6, 4, first_stage_layers=0).rank_layers(0) == []
    for n, pp, vpp, first, last in [(8, 2, 1, None, None), (16, 4, 2, None, None), (14, 4, 2, 2, 4),
                                    (8, 3, 1, 0, 2)]:
        layout = StageLayout(n, pp, vpp, first, last)
        every = sorted(i for r in range(pp) for i in layout.rank_layers(r))
        assert every == list(range(n)), (pp, vpp, first, last)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_layers=10, pp=4), r"num_layers=10 is not divisible by pp\*vpp=4\*1=4"),
    (dict(num_layers=8, pp=2, vpp=8), r"num_layers=8 is too few for pp\*vpp=2\*8=16 model chunks"),
    (dict(num_layers=12, pp=2, vpp=4), r"num_layers=12 is not divisible by pp\*vpp=2\*4=8"),
    (dict(num_layers=8, pp=1, vpp=2), r"vpp=2 .* needs pp >= 2"),
    (dict(num_layers=8, pp=0), r"pp=0 must be a positive integer"),
    (dict(num_layers=14, pp=4, vpp=2, first_stage_layers=3), r"--decoder-first-pipeline-num-layers=3 is not "
                                                                r"divisible by vpp=2"),
    (dict(num_layers=10, pp=4, first_stage_layers=2, last_stage_layers=3), r"leaves 5 layers, which do not divide"),
    (dict(num_layers=4, pp=4, first_stage_layers=2, last_stage_layers=2), r"leaves 0 layers"),
    (dict(num_layers=9, pp=2, first_stage_layers=2, last_stage_layers=6), r"first\+last=8 must equal num_layers=9"),
    (dict(num_layers=4, pp=2, first_stage_layers=5), r"exceed num_layers=4"),
    (dict(num_layers=4, pp=1, first_stage_layers=1), r"need pp >= 2"),
])
def test_bad_layouts_fail_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StageLayout(**kwargs)


def test_layers_per_virtual_stage_flag():
    assert vpp_from_layers_per_virtual_stage(16, 4, 2) == 2
    assert vpp_from_layers_per_virtual_stage(16, 4, None) == 1
    with pytest.raises(ValueError, match=r"num_layers=16 is not divisible by .*=4\*3=12"):
        vpp_from_layers_per_virtual_stage(16, 4, 3)


def test_stage_names_are_the_unsplit_names_and_checkpoints_reshard():
    full = toy.ToyStage(StageLayout(toy.NUM_LAYERS), 0).state_dict()
    for pp, vpp in [(2, 1), (4, 1), (2, 2), (4, 2), (2, 4)]:
        layout = StageLayout(toy.NUM_LAYERS, pp, vpp)
        names: list[str] = []
        for r in range(pp):
            stage = toy.ToyStage(layout, r)
            sd = stage.state_dict()
            names += list(sd)
            for name, value in sd.items():  # layout-independent init: the same values as unsplit
                assert torch.equal(value, full[name]), (pp, vpp, name)
            stage.load_state_dict({n: full[n] for n in sd})  # a full checkpoint loads into any stage
        assert sorted(names) == sorted(full), (pp, vpp)
