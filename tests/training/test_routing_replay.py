"""Routing replay through the model API and the trainer (training.routing_replay, training.routing_file).

- A trainer step replaying its own recording equals the recorded step bit for bit (losses, reduced gradients);
  replaying another model's recording changes the step; ``train_step(routing=...)`` and
  ``--moe-routing-replay-file`` are the same replay; under full recompute the replayed step is unchanged.
- The file round-trips (ids, metadata, lazy reads of a range), and every malformed file or mismatch with the run is
  a ValueError of one line naming the file, also from ``moefold train``'s checks before any rank starts.
- One 4-rank world: tp2, ep2, etp2, cp2, dp4, pp2 x tp2 (1F1B), pp2 x ep2 (GPipe) and tp2 x ep2 with the batch-level
  overlap and full recompute (recomputes between other micro-batches' forwards), with DeepSeek-V3
  tiny (MLA, MTP, expert bias, shared experts, seq aux loss). Each records a step (gathered to the global order) and
  replays a world-1 recording made with other weights through ``--moe-routing-replay-file``; the recordings equal
  world 1's and the replayed step's losses and reduced gradients equal world 1's replaying the same file.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.routing_file import FORMAT, RoutingFile, RoutingRecording, load_routing
from moefold.training.routing_replay import micro_batch_rows, record_routing, trainer_rows
from moefold.training.trainer import Trainer
from tests.distributed import own_groups, run_distributed
from tests.training.trainer_common import observe, tiny_config, tiny_data

SOURCE_SEED = 99   # the recording's weights: not the trained model's, so the replayed ids are not its live ones
TOL, GRAD_RTOL = 1e-4, 1e-4   # as tests/training/test_trainer_layouts.py (fp32)


def _trainer(config, dims=None) -> tuple[Trainer, dict]:
    trainer = Trainer(config, dims or ParallelDims.single(), log=lambda _m: None)
    record: dict = {}
    observe(trainer, record)
    return trainer, record


def _steps(trainer: Trainer, n: int):
    """The first ``n`` steps' micro-batches of this rank, in the trainer's order."""
    batches = trainer.microbatch_iter(tiny_data())
    return [[next(batches) for _ in range(trainer.num_micro)] for _ in range(n)]


def _record(config, dims=None, steps: int = 1) -> RoutingRecording:
    """The routing of ``steps`` training steps of ``config`` at ``dims``, gathered to the global order."""
    trainer, _ = _trainer(config, dims)
    with record_routing(trainer.model, trainer.dims) as recorder:
        for mbs in _steps(trainer, steps):
            trainer.train_step(mbs)
    trainer.close()
    return recorder.gather()


def _source_file(tmp_path, config) -> str:
    """World 1's recording of the run's samples by a model of other weights, as a file."""
    recording = _record(dataclasses.replace(config, train=dataclasses.replace(config.train, seed=SOURCE_SEED)),
                        steps=config.train.train_iters)
    return str(recording.save(tmp_path / "rollout.routing.safetensors"))


def _replayed(config, file: str, dims=None) -> dict:
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, moe_routing_replay_file=file))
    trainer, record = _trainer(config, dims)
    losses = [trainer.train_step(mbs).loss_lm for mbs in _steps(trainer, config.train.train_iters)]
    trainer.close()
    return {"losses": losses, "grads": record["grads"]}


def test_replaying_a_recorded_step_equals_it_bit_for_bit(tmp_path):
    config = tiny_config(steps=1)
    trainer, recorded = _trainer(config)
    mbs = _steps(trainer, 1)[0]
    with record_routing(trainer.model) as recorder:
        loss = trainer.train_step(mbs).loss_lm
    recording = recorder.gather()
    assert recording.layers == [1, 2] and recording.shape == (4, 32, 2)   # layer 1 and the MTP layer (layer 0 dense)
    file = str(recording.save(tmp_path / "own.safetensors"))
    replayed = _replayed(config, file)
    assert replayed["losses"] == [loss]
    for name, grad in recorded["grads"][0].items():
        assert torch.equal(grad, replayed["grads"][0][name]), name
    # train_step(routing=...) is the file's replay; another model's recording changes the step
    other = _source_file(tmp_path, config)
    by_file = _replayed(config, other)
    trainer, by_api = _trainer(config)
    source = load_routing(other)
    routing = [micro_batch_rows(source, trainer_rows(trainer.dims, m, 1)) for m in range(trainer.num_micro)]
    assert trainer.train_step(_steps(trainer, 1)[0], routing=routing).loss_lm == by_file["losses"][0]
    assert all(torch.equal(g, by_api["grads"][0][n]) for n, g in by_file["grads"][0].items())
    assert by_file["losses"][0] != loss


def test_recomputed_layers_replay_their_forward_ids(tmp_path):
    """Full recompute: each layer routes again in backward, with its forward's ids (the selective ``moe`` checkpoint
    and 1F1B's order: tests/moe/test_routing_replay.py)."""
    config = tiny_config(steps=1)
    file = _source_file(tmp_path, config)
    plain = _replayed(config, file)
    again = _replayed(dataclasses.replace(config, options=dataclasses.replace(config.options, recompute="full")), file)
    assert again["losses"] == plain["losses"]
    for name, grad in plain["grads"][0].items():
        assert torch.equal(grad, again["grads"][0][name]), name


def _recording(n: int = 3, layers=(1, 2), E: int = 8, seq: int = 5) -> RoutingRecording:
    g = torch.Generator().manual_seed(0)
    return RoutingRecording(E, {i: torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(n * seq)])
                                .view(n, seq, 2) for i in layers})


def test_the_file_round_trips(tmp_path):
    rec = _recording()
    path = rec.save(tmp_path / "r.safetensors")
    back = load_routing(path)
    assert back.num_experts == 8 and back.layers == [1, 2]
    assert all(torch.equal(back.ids[i], rec.ids[i]) and back.ids[i].dtype == torch.int64 for i in rec.layers)
    with RoutingFile(path, num_experts=8, topk=2, layers=[2, 1], seq_length=5) as f:
        assert (f.num_samples, f.seq_length, f.topk) == (3, 5, 2)
        assert torch.equal(f.read(1, 3)[2], rec.ids[2][1:3])
    assert not list(tmp_path.glob(".*tmp*"))   # the temporary file was renamed
    with safe_open(str(path), "pt") as f:         # one byte per id up to 256 experts
        assert f.get_slice("layers.1.expert_ids").get_dtype() == "U8"
    wide = RoutingRecording(300, {0: torch.tensor([[[299, 0]]])})
    assert load_routing(wide.save(tmp_path / "wide.safetensors")).ids[0].tolist() == [[[299, 0]]]


def _write(path, tensors, **meta) -> str:
    save_file(tensors, str(path), metadata={"format": FORMAT, "version": "1", "num_experts": "8", "topk": "2", **meta})
    return str(path)


def _ids(*shape, fill=None) -> torch.Tensor:
    t = torch.arange(shape[-1], dtype=torch.int32).repeat(*shape[:-1], 1)
    return t if fill is None else t.fill_(fill)


BAD_FILES = {   # name: (tensors, metadata overrides, the message's words)
    "garbage": (None, {}, "not a readable safetensors file"),
    "format": ({"layers.1.expert_ids": _ids(2, 4, 2)}, {"format": "other"}, "metadata format='other'"),
    "experts": ({"layers.1.expert_ids": _ids(2, 4, 2)}, {"num_experts": "x"}, "num_experts='x'"),
    "name": ({"layer1": _ids(2, 4, 2)}, {}, "is not named layers.<i>.expert_ids"),
    "topk": ({"layers.1.expert_ids": _ids(2, 4, 3)}, {}, "[N, S, K=2]"),
    "shapes": ({"layers.1.expert_ids": _ids(2, 4, 2), "layers.2.expert_ids": _ids(3, 4, 2)}, {}, "one shape"),
    "float": ({"layers.1.expert_ids": _ids(2, 4, 2).float()}, {}, "must be integers"),
    "range": ({"layers.1.expert_ids": _ids(2, 4, 2) + 7}, {}, "expert id 8 at [0, 0, 1] is outside [0, "
              "num_experts=8)"),
    "twice": ({"layers.1.expert_ids": _ids(2, 4, 2, fill=3)}, {}, "chooses one expert twice"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_malformed_file_is_one_line(tmp_path, case):
    tensors, meta, words = BAD_FILES[case]
    path = tmp_path / f"{case}.safetensors"
    if tensors is None:
        path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    else:
        _write(path, tensors, **meta)
    with pytest.raises(ValueError) as info:
        load_routing(path)
    assert str(path) in str(info.value) and words in str(info.value) and "\n" not in str(info.value)


def test_a_file_for_another_run_fails_before_any_rank_starts(tmp_path):
    from moefold.training.cli.train_checks import validate

    config = tiny_config(steps=1)
    for rec, words in ((_recording(n=4, layers=(1,), seq=32), "holds MoE layers [1], the model has [1, 2]"),
                       (_recording(n=4, E=16, seq=32), "num_experts=16, the model (run) has 8"),
                       (_recording(n=4), "seq_length=5, the model (run) has 32")):
        path = str(rec.save(tmp_path / "r.safetensors"))
        run = dataclasses.replace(config, train=dataclasses.replace(config.train, moe_routing_replay_file=path))
        with pytest.raises(ValueError) as info:
            validate(run, 1)
        assert str(info.value).startswith(f"routing replay file {path}: ") and words in str(info.value)
    short = RoutingRecording(8, {i: torch.tensor([[0, 1]]).repeat(2, 32, 1) for i in (1, 2)})
    path = str(short.save(tmp_path / "short.safetensors"))
    run = dataclasses.replace(config, train=dataclasses.replace(config.train, moe_routing_replay_file=path))
    with pytest.raises(ValueError, match="holds 2 samples; --train-iters=1 x --global-batch-size=4 consume 4"):
        validate(run, 1)


# ------------------------------------------------------------------------------------------- layouts, one world
LAYOUTS = {   # name: (layout, tiny_config kwargs, ModelOptions changes)
    "tp2.dp2": (ParallelConfig(tp=2), {}, {}),
    "ep2.dp4": (ParallelConfig(ep=2), {}, {}),
    "etp2.dp4": (ParallelConfig(etp=2), {}, {}),
    "cp2.dp2": (ParallelConfig(cp=2), {}, {}),
    "dp4": (ParallelConfig(), {}, {}),
    "pp2xtp2": (ParallelConfig(pp=2, tp=2), {"model": {"num_layers": 4}}, {}),
    "pp2xep2.dp2.gpipe": (ParallelConfig(pp=2, ep=2), {"model": {"num_layers": 4}, "pipeline_schedule": "gpipe"}, {}),
    # the batch-level overlap (one micro-batch's forward beside another's backward) with full recompute: each layer's
    # recomputes take their forwards' ids while other micro-batches' forwards run in between
    "tp2xep2.overlap.full": (ParallelConfig(tp=2, ep=2), {"overlap_moe_expert_parallel_comm": True},
                             {"recompute": "full"}),
}
RUN_ONLY = ("pipeline_schedule", "overlap_moe_expert_parallel_comm")   # the world-1 reference runs without them


def _reference_key(kwargs: dict) -> str:
    return repr({k: v for k, v in kwargs.items() if k not in RUN_ONLY})


def _layout_config(pc: ParallelConfig, kwargs: dict, options: dict):
    config = tiny_config(pc, steps=1, **kwargs)
    return dataclasses.replace(config, options=dataclasses.replace(config.options, **options))


def _world(references: dict, files: dict) -> list[str]:
    failures = []
    for name, (pc, kwargs, options) in LAYOUTS.items():
        ref = references[_reference_key(kwargs)]
        with own_groups():
            dims = ParallelDims.build(pc)
            config = _layout_config(pc, kwargs, options)
            recording = _record(config, dims)
            agree = {i: float((recording.ids[i] == t).all(-1).float().mean()) for i, t in ref["recording"].ids.items()}
            # near-ties of two experts' scores may resolve otherwise at another layout (other summation orders); a
            # token order assembled wrongly disagrees almost everywhere
            if recording.layers != ref["recording"].layers or min(agree.values()) < 0.97:
                failures.append(f"{name}: recording agrees with world 1's on {agree} of the tokens")
            got = _replayed(config, files[_reference_key(kwargs)], dims)
            if abs(got["losses"][0] - ref["replayed"]["losses"][0]) > TOL:
                failures.append(f"{name}: replayed loss {got['losses'][0]} vs world 1 {ref['replayed']['losses'][0]}")
            for pname, want in ref["replayed"]["grads"][0].items():
                have = got["grads"][0].get(pname)
                if have is None:
                    continue   # another pipeline stage's parameter
                atol = GRAD_RTOL * max(float(want.abs().max()), 1e-12)
                if not torch.allclose(have, want, atol=atol, rtol=0):
                    failures.append(f"{name}: grad {pname} max err {(have - want).abs().max():.3g} (atol {atol:.3g})")
    return failures


def test_layouts_record_and_replay_as_world1(tmp_path):
    references, files = {}, {}
    for _, kwargs, _ in LAYOUTS.values():
        key = _reference_key(kwargs)
        if key in references:
            continue
        config = tiny_config(steps=1, **{k: v for k, v in kwargs.items() if k not in RUN_ONLY})
        folder = tmp_path / f"ref{len(files)}"
        folder.mkdir()
        files[key] = _source_file(folder, config)
        references[key] = {"recording": _record(config), "replayed": _replayed(config, files[key])}
    results = run_distributed(_world, 4, references, files, timeout=600)
    failures = sorted({f for per_rank in results for f in per_rank})
    assert not failures, "\n".join(failures[:40])


def test_the_flag_reaches_the_checks_before_any_rank(tmp_path, capsys):
    from moefold.training.cli import main

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    code = main(["train", "--recipe", "qwen3_moe_tiny", "--run-dir", str(tmp_path / "run"),
                 "--moe-routing-replay-file", str(bad)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert f"routing replay file {bad}: not a readable safetensors file" in err
