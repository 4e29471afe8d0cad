"""Configs drawn at random against the transformers classes: each family's logits at world 1 and at parallel layouts.

For every family of ``tests/models/random_hf_configs`` and every seed, a random valid config (head counts and dims,
kv heads, eps, RoPE / YaRN parameters, biases, tying, experts, routing, groups, shared experts, dense layers, windows,
sinks and the clamp, DeltaNet's sizes) builds a tiny transformers model with perturbed weights; ``import_hf`` of its
``save_pretrained`` directory must give its logits within fp32's own error (the same HF model in float64:
``tests/tolerance.bound``), at world 1 and at tp2, ep2 and tp2 x ep2 (all in ONE 4-rank world).

CI draws ``CI_CONFIGS`` configs per family (seeds 0, 1, ...: fixed, so a failure reproduces); more on demand:
``MOEFOLD_RANDOM_CONFIGS=20`` (seeds 0-19) or ``MOEFOLD_RANDOM_CONFIGS=100:140`` (seeds 100-139). A failure names
the family, the seed and the drawn fields.
"""

from __future__ import annotations

import os
import time

import pytest

from moefold.models.hf.importer import import_hf
from moefold.parallel.dims import ParallelConfig, ParallelDims
from tests.distributed import run_distributed
from tests.models.hf_tiny import hf_logits_and_bound, save_hf, tokens
from tests.models.random_hf_configs import FAMILIES, draw

pytest.importorskip("transformers")

CI_CONFIGS = 4
LAYOUTS = {"tp2": dict(tp=2), "ep2": dict(ep=2), "tp2xep2": dict(tp=2, ep=2)}


def seeds() -> list[int]:
    text = os.environ.get("MOEFOLD_RANDOM_CONFIGS", str(CI_CONFIGS))
    first, _, last = text.partition(":")
    return list(range(int(first), int(last))) if last else list(range(int(first)))


CASES = [(family, seed) for family in FAMILIES for seed in seeds()]


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """{(family, seed): (HF directory, fields, HF logits, fp32 bound)}."""
    out, ids = {}, tokens()
    start = time.perf_counter()
    for family, seed in CASES:
        fields = draw(family, seed)
        path = tmp_path_factory.mktemp(f"{family}-{seed}")
        hf = save_hf(family, path, seed=seed, changes=fields)
        out[family, seed] = (str(path), fields, *hf_logits_and_bound(hf, ids))
    print(f"{len(CASES)} HF models drawn in {time.perf_counter() - start:.1f}s")
    return out


@pytest.mark.parametrize("family,seed", CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_world_1(family, seed, drawn):
    path, fields, ref, limit = drawn[family, seed]
    model = import_hf(path)
    diff = (model.logits(tokens()) - ref).abs().max().item()
    assert diff <= limit, f"{family} seed {seed}: |logits diff| {diff:.3g} > {limit:.3g}; fields {fields}"


def _rank(cases: dict) -> dict:
    ids, report = tokens(), {}
    for label, layout in LAYOUTS.items():
        dims = ParallelDims.build(ParallelConfig(**layout))
        for key, (path, _, ref, _) in cases.items():
            report[key, label] = (import_hf(path, dims).logits(ids) - ref).abs().max().item()
    return report


def test_parallel_layouts(drawn):
    start = time.perf_counter()
    reports = run_distributed(_rank, 4, drawn, timeout=900)
    print(f"{len(drawn)} configs x {len(LAYOUTS)} layouts in {time.perf_counter() - start:.1f}s")
    assert len(reports[0]) == len(drawn) * len(LAYOUTS)
    bad, worst = [], dict.fromkeys(LAYOUTS, 0.0)
    for key, label in reports[0]:
        diff = max(r[key, label] for r in reports)   # the largest over the ranks
        worst[label] = max(worst[label], diff)
        _, fields, _, limit = drawn[key]
        if not diff <= limit:
            bad.append(f"{key[0]} seed {key[1]} at {label}: |logits diff| {diff:.3g} > {limit:.3g}; fields {fields}")
    print("largest |logits diff| per layout:", {k: f"{v:.3g}" for k, v in worst.items()})
    assert not bad, "\n".join(bad)
