"""The Mamba-2 mixer (dense/mamba2.py) equals transformers' ``NemotronHMamba2Mixer`` (its torch path) on tiny
random configs (groups, state sizes, chunk sizes shorter and longer than the sequence, conv bias, time-step
limits), fp32; parameter names are HF's; invalid sizes are refused naming the value."""

from __future__ import annotations

import random

import pytest
import torch

from moefold.dense.mamba2 import Mamba2Config, Mamba2Mixer
from moefold.dense.mamba2_layout import conv_layout, in_proj_layout

transformers = pytest.importorskip("transformers")


def _draw(seed: int) -> dict:
    r = random.Random(seed)
    groups = r.choice([1, 2])
    return dict(hidden_size=32, mamba_num_heads=groups * r.choice([2, 4]), mamba_head_dim=r.choice([4, 8]),
                ssm_state_size=r.choice([4, 16]), n_groups=groups, conv_kernel=r.choice([2, 4]),
                use_conv_bias=r.random() < 0.7, chunk_size=r.choice([4, 8, 64]),
                time_step_limit=r.choice([(0.0, float("inf")), (0.01, 0.5)]),
                layer_norm_epsilon=r.choice([1e-5, 1e-3]))


@pytest.mark.parametrize("seed", range(4))
def test_equals_transformers_mixer(seed):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    fields = _draw(seed)
    hf_config = NemotronHConfig(num_hidden_layers=1, layers_block_type=["mamba"], **fields)
    torch.manual_seed(seed)
    hf = NemotronHMamba2Mixer(hf_config, layer_idx=0).eval()
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in hf.parameters():   # every parameter away from its initial value
            p.copy_((0.3 if p.dim() > 1 else 0.5) * torch.randn(p.shape, generator=gen) + (p.dim() == 1) * 0.5)
    ours = Mamba2Mixer(Mamba2Config(
        hidden_size=32, num_heads=fields["mamba_num_heads"], head_dim=fields["mamba_head_dim"],
        state_size=fields["ssm_state_size"], num_groups=fields["n_groups"], conv_kernel=fields["conv_kernel"],
        conv_bias=fields["use_conv_bias"], chunk_size=fields["chunk_size"], time_step_limit=fields["time_step_limit"],
        norm_eps=fields["layer_norm_epsilon"]))
    assert sorted(n for n, _ in ours.named_parameters()) == sorted(n for n, _ in hf.named_parameters())
    # in_proj's rows and the convolution's channels are group-major in moefold (dense.mamba2_layout)
    sizes = (fields["mamba_num_heads"], fields["mamba_head_dim"], fields["ssm_state_size"], fields["n_groups"])
    state = hf.state_dict()
    for name, layout in (("in_proj.", in_proj_layout(*sizes)), ("conv1d.", conv_layout(*sizes))):
        for key in [k for k in state if k.startswith(name)]:
            state[key] = layout.from_hf(state[key], tuple(state[key].shape))
    ours.load_state_dict(state)
    x = torch.randn(2, 19, 32, generator=gen)
    with torch.no_grad():
        ref = hf(x)
        out = ours(x.transpose(0, 1).contiguous()).transpose(0, 1)
    diff = (out - ref).abs().max().item()
    assert diff <= 1e-5 * max(1.0, ref.abs().max().item()), (fields, diff)


def test_invalid_sizes_are_named():
    with pytest.raises(ValueError, match=r"num_heads=6 is not a multiple of num_groups=4"):
        Mamba2Config(hidden_size=8, num_heads=6, head_dim=2, state_size=4, num_groups=4)
    with pytest.raises(ValueError, match=r"time_step_limit=\(0.5, 0.1\)"):
        Mamba2Config(hidden_size=8, num_heads=2, head_dim=2, state_size=4, time_step_limit=(0.5, 0.1))
