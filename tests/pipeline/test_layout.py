"""``--pipeline-model-parallel-layout``: the same string gives the same assignment as Megatron-Core's
``PipelineParallelLayerLayout`` (imported lazily: the reference), its validity rules, the text round trip, the
shorthands as layouts, and the standard layouts the planner searches (NVIDIA's published ones among them)."""

from __future__ import annotations

import pytest

from moefold.pipeline.layout import check_layout, format_layout, parse_layout, standard_layouts
from moefold.pipeline.stages import StageLayout

# (layout, pp, num_layers, mtp_num_layers): Megatron's documented examples and NVIDIA's published layouts
EXAMPLES = [
    ("Et*3|(tt|)*29,m|L", 16, 61, 1),           # Megatron's docs: DeepSeek-V3 at PP16 x VPP2
    ("Et|(tt|)*30mL", 8, 61, 1),                # DeepSeek-V3, 1024 H100, TP2 x PP8 x VP4 x EP64
    ("Et*2|(tt|)*22t|(tt|)*7mL", 8, 61, 1),     # DeepSeek-V3, 256 H100 long context, PP8 x VP4
    ("Ett|(t*3|)*30ttL", 8, 94, 0),             # Qwen3-235B, 256 H100, TP2 x PP8 x VP4 x EP32
    ("Ettt|tttt|tt||ttL", 5, 11, 0),            # an empty stage
    ("Et|tt|ttm|L", 2, 5, 1),                   # MTP standalone, on rank 0's last chunk
    ("Ett||ttt|mL", 4, 5, 1),                   # a rank holding nothing
    ("Ett|(tt|)*4tL", 3, 11, 0),
]


def _megatron():
    try:
        from megatron.core.transformer.enums import LayerType
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    except Exception as exc:
        pytest.skip(f"megatron-core is not importable ({type(exc).__name__}: {exc})")
    return PipelineParallelLayerLayout, LayerType


@pytest.mark.parametrize("text,pp,layers,mtp", EXAMPLES)
def test_same_assignment_as_megatron(text, pp, layers, mtp, monkeypatch):
    Layout, LayerType = _megatron()
    from megatron.core import parallel_state

    ref = Layout(text, pp)
    vpp = ref.virtual_pipeline_model_parallel_size
    ref.validate_layer_layout(layers, mtp)
    # Megatron reads vpp from its global state when asked for a virtual stage's layer ids
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: vpp)
    ours = StageLayout(layers, pp, layout=text, mtp_num_layers=mtp)
    assert ours.vpp == vpp
    names = {"E": LayerType.embedding, "t": LayerType.decoder, "m": LayerType.mtp, "L": LayerType.loss}
    for r in range(pp):
        for c in range(vpp):
            spec = ours.chunk_spec(r, c)
            assert [names[ch] for ch in ours.stages[spec.model_chunk]] == ref.layout[r][c], (r, c)
            assert list(spec.layers) == ref.get_layer_id_list(LayerType.decoder, vp_stage=c, pp_rank=r), (r, c)
            assert spec.has_embedding == (LayerType.embedding in ref.layout[r][c])
            assert spec.has_mtp == (LayerType.mtp in ref.layout[r][c])
            assert spec.has_head == (LayerType.loss in ref.layout[r][c])
    assert parse_layout(format_layout(ours.stages)) == ours.stages


# layouts both refuse (Megatron by assertion), each with a phrase of our reason
REFUSED = [
    ("Et|tt|tL", 2, 4, 0, "not a multiple of pp=2"),
    ("tE|tt|tt|tL", 2, 6, 0, "the embedding must open"),
    ("Et|tt|tt|tt", 2, 7, 0, "exactly once"),
    ("Et|tt|tt|ttL", 2, 8, 0, "num_layers=8"),
    ("Et|tt|mt|tL", 2, 5, 1, "before the MTP layers"),
    ("Et|tt|ttm|mL", 2, 5, 2, "in one virtual stage"),
    ("Et|ttm|tt|L", 2, 5, 1, "before the MTP layers"),
    ("Et|tm|tt|L", 2, 4, 1, "before the MTP layers"),
    ("Et|tt|tt|L", 2, 5, 1, "mtp_num_layers=1"),
]


@pytest.mark.parametrize("text,pp,layers,mtp,reason", REFUSED)
def test_refused_like_megatron_with_a_reason(text, pp, layers, mtp, reason):
    Layout, _ = _megatron()
    with pytest.raises((AssertionError, ValueError)):
        Layout(text, pp).validate_layer_layout(layers, mtp)
    with pytest.raises(ValueError, match=reason.replace("(", r"\(")):
        check_layout(parse_layout(text), pp, layers, mtp)


def test_mtp_must_be_in_the_last_virtual_stage_of_its_rank():
    Layout, _ = _megatron()
    text = "Et|tttm||L"     # 4 stages at pp2: the MTP on rank 1's first virtual stage
    with pytest.raises((AssertionError, ValueError)):
        Layout(text, 2).validate_layer_layout(4, 1)
    with pytest.raises(ValueError, match="last virtual stage of their rank"):
        check_layout(parse_layout(text), 2, 4, 1)


def test_grammar_errors_name_the_character():
    with pytest.raises(ValueError, match="character 'x' in virtual stage 1"):
        parse_layout("Et|tx|L")
    with pytest.raises(ValueError, match="empty"):
        parse_layout("  ")
    assert parse_layout([["embedding", "decoder"], ["decoder", "loss"]]) == ("Et", "tL")


def test_shorthands_are_layouts():
    """The even split and --decoder-first/last-pipeline-num-layers give the layouts they stand for."""
    assert StageLayout(8, 2, 2, mtp_num_layers=1).text == "Ett|(tt|)*2ttmL"
    first_last = StageLayout(14, 4, 2, 2, 4, mtp_num_layers=0)
    explicit = StageLayout(14, 4, layout=first_last.text, mtp_num_layers=0)
    for r in range(4):
        assert first_last.rank_chunks(r) == explicit.rank_chunks(r)
    assert first_last.text == "Et|(tt|)*3t|(tt|)*2ttL"   # ranks 0, 3: 2 and 4 layers; 1, 2: 2 each


def test_standard_layouts_include_the_published_ones():
    assert format_layout(standard_layouts(61, 8, 4, 1)["balanced"]) == "Et|(tt|)*30mL"        # DeepSeek-V3
    assert format_layout(standard_layouts(94, 8, 4, 0)["balanced"]) == "Ett|(t*3|)*30ttL"     # Qwen3-235B
    for pp, vpp, n, mtp in ((8, 4, 61, 1), (8, 4, 94, 0), (4, 2, 27, 1), (2, 1, 3, 0), (16, 2, 61, 1)):
        layouts = standard_layouts(n, pp, vpp, mtp)
        assert layouts, (pp, vpp, n)
        for stages in layouts.values():
            assert check_layout(stages, pp, n, mtp) == vpp
    assert standard_layouts(8, 2, 2, 0)["even"] == ("Ett", "tt", "tt", "ttL")


def test_v_placement_maps_the_same_stages_to_the_v():
    layout = StageLayout(5, 2, layout="Et|tt|ttm|L", mtp_num_layers=1, placement="v")
    assert [(s.model_chunk, list(s.layers)) for s in layout.rank_chunks(0)] == [(0, [0]), (3, [])]
    assert layout.chunk_spec(1, 1).has_mtp and layout.chunk_spec(0, 1).has_head
    with pytest.raises(ValueError, match="2 chunks per rank"):
        StageLayout(4, 2, layout="Et|t|t|tL|", placement="v")
