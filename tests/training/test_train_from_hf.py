"""Continued pretraining from HF checkpoints, end to end, in ONE 4-rank world:

- each family's tiny HF checkpoint (issue 33's too: GPT-OSS, GLM-4.5, Kimi-K2, OLMoE, MiniMax-M2 and Qwen3-Next's
  hybrid stack) -> ``train --load-hf`` at tp2 x ep2 (3 steps, ``--split``, validation every 2 steps; the five
  attention / MoE feature families 1 step) -> ``convert iter_3 --to hf`` -> transformers' logits equal moefold's
  (fp32, 1e-5) and differ from the original's (training changed the weights); the step-0 LM loss equals HF's
  loss on the same global batch; config.json keeps every field, generation_config.json and the tokenizer are
  copied;
- checkpoints saved at pp2 x ep2 (Mixtral) and tp2 (DeepSeek-V3) export to directories transformers loads with
  moefold's logits;
- ``--moe-use-upcycling`` of a dense Qwen3 at tp2 x ep2 x etp2 (granular: 4 experts of half the FFN, top-2): the
  step-0 loss equals the dense HF model's;
- the validation loss is the same at world 1, tp2, ep2 and pp2 and equals HF's loss on the validation samples;
- per-layer router metrics are in metrics.jsonl and TensorBoard;
- greedy generation at tp2 x ep2 equals world 1's.
"""

from __future__ import annotations

import json
import math
import tempfile

import numpy as np
import pytest
import torch

from moefold.models.generate import generate
from moefold.models.hf.importer import import_hf
from moefold.models.options import ModelOptions
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.checkpoint.load_model import load_model
from moefold.training.cli import build_parser
from moefold.training.cli import main as cli
from moefold.training.cli.train import config_from_args, validate
from moefold.training.config import RunConfig
from moefold.training.data.indexed import IndexedDatasetWriter
from moefold.training.evaluate import evaluate
from moefold.training.observe.metrics import METRICS_FILE, read_metrics
from moefold.training.run import build_dataset
from moefold.training.trainer import Trainer
from tests.distributed import own_groups, run_distributed
from tests.models.hf_tiny import (
    FAMILIES,
    FEATURE_FAMILIES,
    VOCAB,
    hf_dense_model,
    hf_lm_loss,
    hf_logits,
    save_hf,
    save_tokenizer,
    tokens,
)

transformers = pytest.importorskip("transformers")

TOL = 1e-5
# training steps of each family's run (the feature families: one, to keep this world's time)
ITERS = {family: 1 if family in FEATURE_FAMILIES else 3 for family in FAMILIES}
# no warmup: Megatron's warmup runs step 0 at lr 0, and the feature families train a single step
COMMON = ["--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-2",
          "--lr-warmup-iters", "0", "--log-interval", "1", "--device", "cpu", "--no-balance-report",
          "--split", "90,10,0", "--eval-iters", "2"]


def _config(world: int, *flags: str) -> RunConfig:
    run_dir = [] if "--run-dir" in flags else ["--run-dir", tempfile.mkdtemp(prefix="moefold-from-hf-")]
    config = config_from_args(build_parser("train").parse_args(["train", *COMMON, *run_dir, *flags]))
    validate(config, world)   # what `moefold train` checks before any rank starts
    return config


def _rank(train_configs: dict[str, dict], eval_configs: dict[str, dict], qwen_dir: str, ids: torch.Tensor):
    from moefold.training.run import train

    out = {}
    for name, config in train_configs.items():
        losses: list[float] = []
        with own_groups():
            train(RunConfig.from_dict(config), "cpu", on_step=lambda r: losses.append(r.loss_lm))
        out[name] = losses
    for name, d in eval_configs.items():   # validation before any training step, at each layout
        config = RunConfig.from_dict(d)
        with own_groups():
            dims = ParallelDims.build(config.parallel)
            trainer = Trainer(config, dims, log=lambda _m: None)
            out[name] = evaluate(trainer, build_dataset(config, dims, part="valid"), config.train.eval_iters).loss_lm
    dims = ParallelDims.build(ParallelConfig(tp=2, ep=2))
    model = import_hf(qwen_dir, dims, ModelOptions(sequence_parallel=False))
    out["generated"] = generate(model, ids, 10)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("from_hf")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(root / "data", VOCAB) as writer:
        for _ in range(40):
            writer.add_document(rng.integers(1, VOCAB, size=int(rng.integers(10, 40))))
    hf = {}
    for family in FAMILIES:
        hf[family] = save_hf(family, root / family)
        save_tokenizer(root / family)
    dense = hf_dense_model("qwen3")
    dense.save_pretrained(root / "qwen3_dense")
    data = ["--data-path", str(root / "data")]

    def run(name: str, source: str, *flags: str) -> RunConfig:
        return _config(4, "--load-hf", str(root / source), *data, "--nproc", "4", "--run-dir", str(root / name / "run"),
                       "--save", str(root / name / "ckpt"), *flags)

    tp2ep2 = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
    train_configs = {f: run(f, f, *tp2ep2, "--train-iters", str(ITERS[f]), "--eval-interval", str(min(2, ITERS[f])))
                     for f in FAMILIES}
    train_configs["mixtral_pp2xep2"] = run("mixtral_pp2xep2", "mixtral", "--pipeline-model-parallel-size", "2",
                                           "--expert-model-parallel-size", "2", "--train-iters", "2")
    train_configs["deepseek_v3_tp2"] = run("deepseek_v3_tp2", "deepseek_v3", "--tensor-model-parallel-size", "2",
                                           "--train-iters", "2")
    train_configs["upcycled"] = run("upcycled", "qwen3_dense", *tp2ep2, "--expert-tensor-parallel-size", "2",
                                    "--train-iters", "1", "--moe-use-upcycling", "--num-experts", "4",
                                    "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24")
    layouts = {"tp2": ["--tensor-model-parallel-size", "2"], "ep2": ["--expert-model-parallel-size", "2"],
               "pp2": ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"]}
    eval_configs = {f"valid {k}": run("eval", "qwen3_moe", *v, "--train-iters", "1") for k, v in layouts.items()}
    ids = tokens(batch=2, seq=6, seed=5)
    out = run_distributed(_rank, 4, {k: c.to_dict() for k, c in train_configs.items()},
                          {k: c.to_dict() for k, c in eval_configs.items()}, str(root / "qwen3_moe"), ids,
                          timeout=600)[0]
    return root, hf, dense, train_configs, eval_configs, out, ids


def _export(root, name: str, iteration: int):
    """``moefold convert`` the training checkpoint; (transformers model of the export, moefold world-1 model)."""
    ckpt = root / name / "ckpt" / f"iter_{iteration:07d}"
    out = root / name / "hf_export"
    assert cli(["convert", str(ckpt), str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    return hf, load_model(ckpt)[0], out


@pytest.mark.parametrize("family", FAMILIES)
def test_train_load_hf_export_round_trip(world, family):
    root, hf, _, configs, _, out, _ = world
    exported, model, out_dir = _export(root, family, ITERS[family])
    ids = tokens(seed=3)
    diff = (hf_logits(exported, ids) - model.logits(ids)).abs().max().item()
    changed = (hf_logits(exported, ids) - hf_logits(hf[family], ids)).abs().max().item()
    print(f"{family}: export vs moefold max |diff| {diff:.3g}; trained vs original {changed:.3g}")
    assert diff <= TOL and changed > 1e-3
    # step 0: the loss of the HF weights on the run's first global batch, as HF computes it
    config = configs[family]
    samples = build_dataset(config, ParallelDims.single())
    batch = torch.as_tensor(np.stack([samples[i] for i in range(config.train.global_batch_size)]))
    assert out[family][0] == pytest.approx(hf_lm_loss(hf[family], batch), abs=TOL, rel=0)
    # config.json keeps every field it was read with; generation config and tokenizer travel along
    original = json.loads((root / family / "config.json").read_text())
    written = json.loads((out_dir / "config.json").read_text())
    assert {k: v for k, v in original.items() if written.get(k) != v} == {}
    for name in ("generation_config.json", "tokenizer.json"):
        assert (out_dir / name).read_bytes() == (root / family / name).read_bytes(), name


def test_inspect_a_training_checkpoint(world, capsys):
    root = world[0]
    assert cli(["inspect", "--checkpoint", str(root / "qwen3_moe" / "ckpt"), "--no-layers"]) == 0
    out = capsys.readouterr().out
    assert "training checkpoint" in out and "iter_0000003" in out and "total 0.045M" in out


@pytest.mark.parametrize("name", ["mixtral_pp2xep2", "deepseek_v3_tp2"])
def test_export_from_other_layouts(world, name):
    root = world[0]
    exported, model, _ = _export(root, name, 2)
    ids = tokens(seed=4)
    assert (hf_logits(exported, ids) - model.logits(ids)).abs().max().item() <= TOL


def test_upcycled_step0_loss_equals_dense(world):
    _, _, dense, configs, _, out, _ = world
    config = configs["upcycled"]
    assert config.model.num_experts == 4 and config.model.moe_ffn_hidden_size == 24
    samples = build_dataset(config, ParallelDims.single())
    batch = torch.as_tensor(np.stack([samples[i] for i in range(config.train.global_batch_size)]))
    assert out["upcycled"][0] == pytest.approx(hf_lm_loss(dense, batch), abs=TOL, rel=0)


def test_validation_equal_across_layouts(world):
    root, hf, _, _, eval_configs, out, _ = world
    config = eval_configs["valid tp2"]
    config = RunConfig(model=config.model, parallel=ParallelConfig(), options=config.options, train=config.train)
    trainer = Trainer(config, ParallelDims.single(), log=lambda _m: None)
    valid = build_dataset(config, ParallelDims.single(), part="valid")
    world1 = evaluate(trainer, valid, config.train.eval_iters).loss_lm
    samples = torch.as_tensor(np.stack([valid[i] for i in range(2 * config.train.global_batch_size)]))
    assert world1 == pytest.approx(hf_lm_loss(hf["qwen3_moe"], samples), abs=TOL, rel=0)
    for layout in ("tp2", "ep2", "pp2"):
        assert out[f"valid {layout}"] == pytest.approx(world1, abs=TOL, rel=0), layout
    # the tp2 x ep2 training run validated the same samples before its first step
    first = read_metrics(root / "qwen3_moe" / "run" / METRICS_FILE, kind="valid")[0]
    assert first["step"] == 0 and first["loss_lm"] == pytest.approx(world1, abs=TOL, rel=0)


def test_metrics_have_validation_and_per_layer_router_metrics(world):
    root = world[0]
    for family, losses in (("qwen3_moe", ("global_aux_loss",)), ("deepseek_v3", ("seq_aux_loss",))):
        run_dir = root / family / "run"
        valid = read_metrics(run_dir / METRICS_FILE, kind="valid")
        assert [r["step"] for r in valid] == [0, 2, 3]   # the starting weights, every 2 steps, the end
        assert all(r["ppl"] == pytest.approx(math.exp(r["loss_lm"])) for r in valid)
        for rec in read_metrics(run_dir / METRICS_FILE):
            moe = rec["moe"]
            router = moe["router"]
            assert sorted(router) == sorted([*losses, "entropy"])
            for name, values in router.items():
                assert len(values) == len(moe["layers"]) and all(v > 0 for v in values), (family, name)
            assert all(v < math.log(8) for v in router["entropy"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "qwen3_moe" / "run" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"moe_entropy/layer00", "moe_global_aux_loss/layer02", "moe_max_over_mean/layer02", "valid/loss_lm",
            "valid/ppl"} <= tags, sorted(tags)


def test_generation_at_tp2_ep2_equals_world_1(world):
    root, *_, out, ids = world
    assert torch.equal(out["generated"], generate(import_hf(root / "qwen3_moe"), ids, 10))
