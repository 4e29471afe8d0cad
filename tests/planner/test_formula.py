"""The search's formulas against their oracles (``moefold plan``'s default mode against ``--exact``).

Static bytes: ``static.static_lower_bound`` (parameters counted per layer kind, times the bytes per element,
the optimizer states over their reduction group) against ``static.exact_static`` (the trainer's model, gradient
buffers and optimizer built on the meta device) for random small layouts of five model families (MLA + MoE +
dense layers + MTP, GQA MoE with qk-norm, Mixtral, GPT-OSS's biases and sliding windows, a dense model). What the
formula leaves out is the buffers' padding: each bucket is padded to a multiple of its group size x ``ALIGN``
elements, and a whole-layout bucket by at most 1/``WHOLE_SLACK`` of its elements; so exact - formula lies in
[0, buckets x size x ALIGN + elements / WHOLE_SLACK] per buffer.

Activations: ``planner.inflight``'s held pairs against the walk of the schedule's action lists
(``profile.schedule_peak(steady=False)``) for every schedule, pp up to 8, every rank, short and long steps,
random per-chunk bytes. The formula does not track which chunk's pair completes the fullest state (at most one
pair's kept bytes), which action's transient runs then (at most the largest transient beyond its own kept bytes)
nor how many point-to-point buffers are held (at most pp + 1 messages, ``MESSAGES`` counted).
"""

from __future__ import annotations

import random

import pytest

from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig
from moefold.planner.activations import Part
from moefold.planner.inflight import MESSAGES, fb_matrix, fb_peak, held_states, peak_bytes
from moefold.planner.profile import ChunkProfile, profile, schedule_peak
from moefold.planner.static import exact_static, static_lower_bound
from moefold.training.cli.train import validate_layout
from moefold.training.config import RunConfig, TrainConfig
from moefold.training.observe.memory import DTYPE_BYTES
from moefold.training.optim.buffers import ALIGN, WHOLE_SLACK

FAMILIES = {"mla-moe-mtp": ("deepseek_v3_tiny", {"num_layers": 4}), "gqa-moe": ("qwen3_moe_tiny", {}),
            "mixtral": ("mixtral_tiny", {}), "gpt-oss": ("gpt_oss_tiny", {}),
            "dense": ("qwen3_moe_tiny", {"num_experts": 0, "moe_topk": 0, "ffn_hidden_size": 96})}
WORLD = 8
BUCKET = 4096


def _random_layout(rng: random.Random, family: str) -> RunConfig:
    recipe, changes = FAMILIES[family]
    model = get_recipe(recipe).with_(**{"num_layers": 2, "vocab_size": 256, **changes})
    while True:
        tp, cp, pp = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([1, 2])
        ep = rng.choice([1, 2, 4]) if model.num_experts else 1
        etp = rng.choice([1, 2]) if model.num_experts else 1
        train = TrainConfig(bf16=rng.random() < 0.5, micro_batch_size=1, global_batch_size=16, seq_length=64,
                            lr_warmup_iters=0, bucket_numel=BUCKET, exp_avg_dtype=rng.choice(["fp32", "bf16"]))
        config = RunConfig(model=model, parallel=ParallelConfig(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp),
                           options=ModelOptions(dtype="bf16" if train.bf16 else "fp32"), train=train, recipe=recipe)
        try:
            validate_layout(config, WORLD)
        except ValueError:
            continue
        return config


@pytest.mark.parametrize("family", list(FAMILIES))
def test_static_formula_equals_the_meta_build_up_to_padding(family: str) -> None:
    rng = random.Random(family)
    for _ in range(3):
        config = _random_layout(rng, family)
        sizes = validate_layout(config, WORLD)
        exact, formula = exact_static(config, sizes), static_lower_bound(config, sizes)
        groups = {"dense": sizes.dp * sizes.cp, "sp": sizes.tp * sizes.cp * sizes.dp, "expert": sizes.edp}
        for r in range(sizes.pp):
            e, f = exact[r], formula[r]
            for part in ("params", "grads", "master", "exp_avg", "exp_avg_sq"):
                value, bound = getattr(e, part), getattr(f, part)
                # every buffer's padding: per bucket up to size x ALIGN elements, plus the whole-layout slack
                slack = (value // 2 // WHOLE_SLACK + sum(4 * (value // 2 // BUCKET + 2) * n * ALIGN
                                                         for n in set(groups.values())))
                assert bound <= value <= bound + slack, (family, config.parallel, r, part, value, bound)
            assert DTYPE_BYTES  # the byte table the formula multiplies by


SCHEDULES = [("1f1b", 1, False), ("zb-h1", 1, False), ("gpipe", 1, False), ("interleaved", 2, False),
             ("interleaved", 3, False), ("interleaved", 2, True), ("zbv", 2, False), ("dualpipev", 2, False),
             ("dualpipev", 2, True)]


@pytest.mark.parametrize("name,vpp,overlap", SCHEDULES)
def test_held_pairs_formula_equals_the_walk(name: str, vpp: int, overlap: bool) -> None:
    rng = random.Random(f"{name}{vpp}{overlap}")
    message = 7
    checked = 0
    for pp in (2, 4, 8):
        for m in sorted({pp, 2 * pp, 4 * pp, 12 * pp}):
            for rank in range(pp):
                kept = [rng.randint(50, 150) for _ in range(vpp)]
                profiles = [ChunkProfile((), k, k + rng.randint(0, 40), k + rng.randint(0, 40)) for k in kept]
                try:
                    walked, _ = schedule_peak((name, pp, m, vpp, overlap), profiles, rank, message, steady=False)
                except ValueError:   # a step this schedule refuses (DualPipeV below 2 pp micro-batches)
                    continue
                formula = peak_bytes(held_states(name, pp, vpp, m, rank), kept,
                                     [p.peak for p in profiles], message, True)
                tolerance = max(kept) + max(p.peak - p.kept for p in profiles) + (pp + 1 + MESSAGES) * message
                assert abs(formula - walked) <= tolerance, (pp, m, rank, formula, walked, tolerance)
                checked += 1
    assert checked >= 30


def _blocks(n: int, block: int, moe: bool = True, extra: int = 0) -> ChunkProfile:
    """A chunk of ``n`` blocks of ``block`` bytes (two parts each, an MoE FFN: two exchanges), a head of 5 bytes."""
    ffn = {"moe: expert input rows": block // 2} if moe else {"mlp: input": block // 2}
    parts = [p for i in range(n) for p in (Part("moe layer", {"attention": block - block // 2}, fwd_extra=extra,
                                                 layer=i),
                                            Part("moe layer", ffn, bwd_extra=extra, layer=i))]
    return profile([*parts, Part("head", {"logits": 5})])


def test_fb_step_holds_one_pair_and_a_block():
    """An FB step of two chunks of MoE blocks holds the larger pair and about a block (``inflight.fb_peak``): the
    backward's blocks end a turn before the forward's next start; without exchanges the backward runs whole first."""
    one, two = _blocks(6, 100), _blocks(6, 100, extra=7)
    # the forward's blocks 0..k while the backward still holds 0..n-1-k (its head, first, already freed)
    assert fb_peak(one, one) == 6 * 100 + 100
    assert 700 <= fb_peak(two, two) <= 700 + 7
    assert fb_peak(_blocks(3, 100), _blocks(9, 100)) <= 900 + 5 + 100
    dense = _blocks(6, 100, moe=False)
    assert fb_peak(dense, dense) == dense.kept   # no exchange: one turn each, the backward's first
    assert fb_peak(ChunkProfile((), 50, 60, 70), ChunkProfile((), 40, 45, 41)) == 50 + 40 + 20   # no parts: both


@pytest.mark.parametrize("name,vpp", [("interleaved", 2), ("dualpipev", 2)])
def test_fb_formula_equals_the_walk_with_blocks(name: str, vpp: int) -> None:
    """With the overlap and chunks of blocks, the formula's FB steps (any held pair as the forward, any chunk as
    the backward) against the walk's (each FB's own two chunks): within the formula's usual slack."""
    rng = random.Random(name)
    for pp in (2, 4):
        for m in (2 * pp, 4 * pp):
            for rank in range(pp):
                profiles = [_blocks(rng.randint(2, 6), rng.randint(20, 60), extra=rng.randint(0, 9))
                            for _ in range(vpp)]
                kept = [p.kept for p in profiles]
                walked, _ = schedule_peak((name, pp, m, vpp, True), profiles, rank, 7, steady=False)
                formula = peak_bytes(held_states(name, pp, vpp, m, rank), kept, [p.peak for p in profiles], 7,
                                     True, fb_matrix(profiles))
                tolerance = max(kept) + max(p.peak - p.kept for p in profiles) + (pp + 1 + MESSAGES) * 7
                assert abs(formula - walked) <= tolerance, (pp, m, rank, formula, walked)
                assert walked < sum(kept) * (m + 1)   # sanity: a finite walk
