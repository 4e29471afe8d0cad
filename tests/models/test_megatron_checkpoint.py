"""Megatron-Core ``torch_dist`` checkpoints, against megatron-core 0.16.1's own GPTModel (the test extra).

A tiny Megatron GPTModel with MoE layers (GQA + qk-layernorm, a dense first layer, sigmoid group-limited
routing with expert bias, a shared expert, one MTP layer, untied embeddings; Megatron's local layer spec) is
built and saved with ``dist_checkpointing`` at tp2 x ep2 on 4 gloo ranks, as Megatron-LM lays a checkpoint out
(``latest_checkpointed_iteration.txt``, ``iter_N/``, ``args`` in ``common.pt``). Then:

- ``import_megatron`` (world 1, and tp2 x ep2) gives Megatron's logits for the same input, and its MTP loss and
  LM loss equal Megatron's (Megatron's MTP convention: the normalised hidden state);
- ``export_megatron`` of that moefold model loads back into a Megatron GPTModel (``dist_checkpointing.load``,
  tp1 x ep2 on 2 ranks) whose logits equal the original ones;
- missing and unknown tensors are named on one line; ``common.pt`` classes never run.
"""

from __future__ import annotations

import argparse
import shutil
import time

import pytest
import torch

from moefold.models.decoder import MoEDecoder
from moefold.models.megatron import export_megatron, import_megatron, load_megatron_weights, megatron_config
from moefold.parallel.dims import ParallelConfig, ParallelDims
from tests.distributed import run_distributed
from tests.megatron_compat import causal_mask, init_megatron, require_megatron

V, H, S, B, LAYERS = 64, 32, 8, 2, 3


def _args() -> argparse.Namespace:
    """What Megatron-LM's argument parser stores in ``common.pt`` (the architecture part, plus an enum and a dtype
    as a real run has them)."""
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=H, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
        kv_channels=8, qk_layernorm=True, ffn_hidden_size=48, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
        add_bias_linear=False, add_qkv_bias=False, position_embedding_type="rope", rotary_base=10000,
        rotary_percent=1.0, max_position_embeddings=64, untie_embeddings_and_output_weights=True,
        padded_vocab_size=V, num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
        moe_router_score_function="sigmoid", moe_router_pre_softmax=False, moe_router_topk_scaling_factor=2.0,
        moe_router_num_groups=2, moe_router_group_topk=1, moe_router_enable_expert_bias=True,
        moe_shared_expert_intermediate_size=16, moe_layer_freq=[0, 1, 1],
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2, mtp_num_layers=1,
        mtp_loss_scaling_factor=0.3, tensor_model_parallel_size=2, expert_model_parallel_size=2,
        params_dtype=torch.float32, attention_backend=AttnBackend.auto)


def _megatron_model(args: argparse.Namespace):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=H, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, qk_layernorm=True,
        ffn_hidden_size=args.ffn_hidden_size, normalization="RMSNorm", layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        num_moe_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_router_topk, moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor, moe_router_num_groups=2,
        moe_router_group_topk=1, moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=16,
        moe_layer_freq=args.moe_layer_freq, moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type="allgather", moe_router_dtype="fp32", mtp_num_layers=args.mtp_num_layers,
        mtp_loss_scaling_factor=0.3, use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=args.tensor_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(config, block.layer_specs[-1], use_transformer_engine=False) \
        if args.mtp_num_layers else None
    return GPTModel(config, block, vocab_size=V, max_sequence_length=64, position_embedding_type="rope",
                    mtp_block_spec=mtp, share_embeddings_and_output_weights=False, parallel_output=False)


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (B, S), generator=g)
    return ids, torch.randint(0, V, (B, S), generator=g)


def _megatron_outputs(model, losses: bool) -> dict:
    """Megatron's logits (eval) and, with ``losses``, in training mode its LM loss and MTP loss for ``_batch()``
    (Megatron trains MoE at tp > 1 only with sequence parallelism, which its CPU norm does not support)."""
    from megatron.core.transformer import multi_token_prediction as mtp

    ids, labels = _batch()
    pos = torch.arange(S).expand(B, S)
    calls = []   # with MTP Megatron returns losses only: its output layer's last call is the main head (cloned: the
    # loss then overwrites the logits in place)
    hook = model.output_layer.register_forward_hook(lambda mod, inp, out: calls.append(out[0].detach().clone()))
    model.eval()
    with torch.no_grad():
        model(ids, pos, causal_mask(S), labels=labels)
    hook.remove()
    logits = calls[-1].transpose(0, 1).contiguous()   # [S, B, V] -> [B, S, V]
    if not losses:
        return {"logits": logits}
    captured = {}
    mtp.MTPLossLoggingHelper.save_loss_to_tracker = staticmethod(
        lambda loss, layer, *a, **k: captured.__setitem__(layer, loss.detach()))
    model.train()
    lm = model(ids, pos, causal_mask(S), labels=labels)
    return {"logits": logits, "lm": float(lm.mean()), "mtp": float(captured[0])}


def _save_megatron(ckpt: str) -> dict:
    """Rank function (world 4): build the Megatron model at tp2 x ep2, save it Megatron-LM style."""
    init_megatron(tp=2, ep=2)
    from megatron.core import dist_checkpointing

    args = _args()
    torch.manual_seed(11)
    model = _megatron_model(args)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():   # non-trivial norms and expert biases (the same values on every rank)
        for name, p in model.named_parameters():
            if "norm" in name or "layer_norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))
    out = _megatron_outputs(model, losses=False)
    state = {"model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0, "iteration": 5}
    if torch.distributed.get_rank() == 0:
        import os

        os.makedirs(f"{ckpt}/iter_0000005", exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(state, f"{ckpt}/iter_0000005")
    if torch.distributed.get_rank() == 0:
        with open(f"{ckpt}/latest_checkpointed_iteration.txt", "w") as f:
            f.write("5")
    torch.distributed.barrier()
    return out


def _load_megatron(ckpt: str) -> dict:
    """Rank function (world 2): a Megatron model at tp1 x ep2 loads ``ckpt`` (a moefold export)."""
    init_megatron(tp=1, ep=2)
    from megatron.core import dist_checkpointing

    args = _args()
    args.tensor_model_parallel_size = 1
    torch.manual_seed(99)   # other initial weights: everything must come from the checkpoint
    model = _megatron_model(args)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, f"{ckpt}/release")   # as Megatron-LM
    assert state["args"].num_experts == 4 and state["iteration"] == 0
    model.load_state_dict(state["model"])
    return _megatron_outputs(model, losses=True)


def _moefold_outputs(ckpt: str, layout: ParallelConfig, export_to: str | None = None) -> dict:
    """Rank function: moefold's import at ``layout``; its logits (world 1: LM and MTP loss, and the export)."""
    dims = ParallelDims.build(layout)
    model = import_megatron(ckpt, dims)
    ids, labels = _batch()
    if dims.tp > 1 or dims.ep > 1:
        model.eval()
        return {"logits": model.logits(ids)}
    model.eval()
    logits = model.logits(ids)
    model.train()
    out = model(ids, labels)
    if export_to:
        export_megatron(model, export_to)
    return {"logits": logits, "lm": float(out.lm_loss), "mtp": float(out.mtp_loss)}


@pytest.fixture(scope="module")
def megatron_checkpoint(tmp_path_factory):
    require_megatron()
    ckpt = str(tmp_path_factory.mktemp("megatron") / "ckpt")
    ref = run_distributed(_save_megatron, 4, ckpt, timeout=300)[0]
    return ckpt, ref


def test_megatron_checkpoint_imports_with_megatrons_logits_and_losses(megatron_checkpoint, tmp_path):
    ckpt, ref = megatron_checkpoint
    config = megatron_config(ckpt)
    assert (config.num_layers, config.num_experts, config.mtp_num_layers, config.moe_expert_bias) == \
        (LAYERS, 4, 1, True)
    out = tmp_path / "export"
    ours = run_distributed(_moefold_outputs, 1, ckpt, ParallelConfig(), str(out))[0]
    torch.testing.assert_close(ours["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
    parallel = run_distributed(_moefold_outputs, 4, ckpt, ParallelConfig(tp=2, ep=2), timeout=300)
    torch.testing.assert_close(parallel[0]["logits"], ref["logits"], rtol=1e-5, atol=1e-5)

    # the export loads back into Megatron (at another layout) with the same logits
    back = run_distributed(_load_megatron, 2, str(out), timeout=300)[0]
    torch.testing.assert_close(back["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
    # the same weights in both: Megatron's training-mode LM and MTP losses are moefold's
    assert ours["lm"] == pytest.approx(back["lm"], rel=1e-5)
    assert ours["mtp"] == pytest.approx(back["mtp"], rel=1e-5)   # MTP reads the normalised hidden state


def test_missing_and_unknown_tensors_are_named(megatron_checkpoint, tmp_path):
    ckpt, _ = megatron_checkpoint
    config = megatron_config(ckpt)
    with pytest.raises(ValueError, match=r"Megatron tensors match no moefold parameter: .*mtp\.layers\.0"):
        load_megatron_weights(MoEDecoder(config.with_(mtp_num_layers=0)), ckpt)
    with pytest.raises(ValueError, match=r"tensors missing in the Megatron checkpoint .*decoder\.layers\.3\."):
        load_megatron_weights(MoEDecoder(config.with_(num_layers=4, moe_layer_freq=(0, 1, 1, 1))), ckpt)


def test_common_pt_code_never_runs(megatron_checkpoint, tmp_path):
    """A ``common.pt`` whose args hold an object with a malicious ``__reduce__`` is read without running it."""
    ckpt, _ = megatron_checkpoint
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    args = _args()
    args.payload = _Boom()
    torch.save({"args": args}, copy / "iter_0000005" / "common.pt")
    config = megatron_config(copy)   # the stand-in takes the payload's place; nothing ran
    assert config.num_experts == 4 and not _Boom.ran


class _Boom:
    ran = False

    def __reduce__(self):
        return (_explode, ())


def _explode():
    _Boom.ran = True
    raise AssertionError("code from the checkpoint ran")


def _trainer_logits(ckpt: str, run_dir: str) -> torch.Tensor:
    from moefold.training.cli import build_parser
    from moefold.training.cli.train import config_from_args
    from moefold.training.trainer import Trainer

    args = build_parser("train").parse_args(["train", "--load-megatron", ckpt, "--seq-length", str(S),
                                             "--micro-batch-size", "2", "--global-batch-size", "2", "--no-save",
                                             "--run-dir", run_dir])
    config = config_from_args(args)
    trainer = Trainer(config, ParallelDims.build(config.parallel), device="cpu")
    trainer.model.eval()
    return trainer.model.logits(_batch()[0])


def test_cli_convert_and_train_load_megatron(megatron_checkpoint, tmp_path):
    """``moefold convert --from megatron`` (-> moefold, -> --to megatron) and ``train --load-megatron`` start from
    Megatron's weights."""
    from moefold.models.checkpoint import load_checkpoint
    from moefold.training.cli import main as cli_main

    ckpt, ref = megatron_checkpoint
    assert cli_main(["convert", "--from", "megatron", ckpt, str(tmp_path / "mf")]) == 0
    model = load_checkpoint(tmp_path / "mf")
    model.eval()
    torch.testing.assert_close(model.logits(_batch()[0]), ref["logits"], rtol=1e-5, atol=1e-5)
    assert cli_main(["convert", str(tmp_path / "mf"), str(tmp_path / "back"), "--to", "megatron"]) == 0
    assert (tmp_path / "back" / "latest_checkpointed_iteration.txt").read_text() == "release"
    again = import_megatron(tmp_path / "back")
    again.eval()
    torch.testing.assert_close(again.logits(_batch()[0]), ref["logits"], rtol=1e-5, atol=1e-5)
    logits = run_distributed(_trainer_logits, 1, ckpt, str(tmp_path / "run"))[0]
    torch.testing.assert_close(logits, ref["logits"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"--hidden-size .*cannot be combined with --load-megatron"):
        from moefold.training.cli import build_parser
        from moefold.training.cli.train import config_from_args

        config_from_args(build_parser("train").parse_args(["train", "--load-megatron", ckpt, "--hidden-size", "64"]))


class _Payload:
    def __reduce__(self):
        return (exec, ("raise AssertionError('code from the checkpoint ran')",))


def test_megatron_metadata_is_read_the_safe_way(megatron_checkpoint, tmp_path):
    """``.metadata`` of a torch_dist checkpoint goes through the unpickler moefold's own checkpoints are read with
    (``models.dcp_metadata``): a payload in it, or a storage transform, is refused in one line; nothing runs."""
    import pickle

    from moefold.models.dcp_metadata import UnsafeCheckpointError, read_dcp_metadata

    ckpt, _ = megatron_checkpoint
    for case in ("payload", "transform"):
        copy = tmp_path / case
        shutil.copytree(ckpt, copy)
        meta = copy / "iter_0000005" / ".metadata"
        md = read_dcp_metadata(meta, megatron=True)
        with pytest.raises(UnsafeCheckpointError, match="BytesStorageMetadata"):   # moefold's own: tensors only
            read_dcp_metadata(meta)
        if case == "payload":
            md.planner_data = _Payload()
            match = r"\.metadata asks to load builtins\.exec"
        else:
            next(iter(md.storage_data.values())).transform_descriptors = ["zstd"]
            match = r"\.metadata asks for storage transforms"
        meta.write_bytes(pickle.dumps(md))
        with pytest.raises(UnsafeCheckpointError, match=match):
            import_megatron(copy)


def _corpus(prefix) -> str:
    from moefold.training.data.indexed import IndexedDatasetWriter

    g = torch.Generator().manual_seed(1)
    with IndexedDatasetWriter(prefix, V) as writer:
        for _ in range(8):
            writer.add_document(torch.randint(0, V, (40,), generator=g).tolist())
    return str(prefix)


def test_load_megatron_is_a_fresh_run_and_load_of_megatron_is_refused(megatron_checkpoint, tmp_path, monkeypatch,
                                                                      capsys):
    """``train --load-megatron`` starts a new run (its own run id and run directory, nothing resumed) each time;
    ``--load`` of a Megatron directory fails before any rank starts, naming ``--load-megatron``; moefold's own
    ``--save`` directory (the same tracker name) is not taken for a Megatron checkpoint."""
    from moefold.models.megatron import is_megatron_checkpoint
    from moefold.training.checkpoint.identity import read_run
    from moefold.training.cli import main as cli_main

    ckpt, _ = megatron_checkpoint
    monkeypatch.chdir(tmp_path)
    data = _corpus(tmp_path / "c")
    flags = ["--data-path", data, "--seq-length", str(S), "--micro-batch-size", "2", "--global-batch-size", "2",
             "--train-iters", "1", "--no-progress"]
    runs = []
    for _ in range(2):
        assert cli_main(["train", "--load-megatron", ckpt, *flags]) == 0
        out = capsys.readouterr().out
        assert "resumed" not in out
        latest = sorted(p for p in (tmp_path / "runs").glob("*/*") if p.name != "latest")
        runs.append(latest[-1])
        assert (runs[-1] / "checkpoints" / "iter_0000001").is_dir()
        time.sleep(1.1)   # run directories are named by the second
    assert runs[0] != runs[1] and read_run(runs[0]).run_id != read_run(runs[1]).run_id
    save = runs[1] / "checkpoints"
    assert (save / "latest_checkpointed_iteration.txt").is_file() and not is_megatron_checkpoint(save)
    assert is_megatron_checkpoint(ckpt)
    for load in (ckpt, f"{ckpt}/iter_0000005"):
        assert cli_main(["train", "--load-megatron", ckpt, "--load", load, *flags]) == 2
        err = capsys.readouterr().err
        assert f"--load {load} is a Megatron-LM checkpoint; start a new run from its weights with --load-megatron" \
            in err
    assert cli_main(["train", "--load-megatron", str(save), *flags]) == 2
    assert "not a Megatron torch_dist checkpoint (a moefold checkpoint? resume it with --load" in \
        capsys.readouterr().err
