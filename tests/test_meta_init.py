"""A model built under ``torch.device("meta")`` has shapes, not values ([Note: a meta model
needs an initializer] in memory/materialize.py): wrap gives its parameters and buffers values
from ``weights=``, from each module's ``reset_parameters()``, from ``init_fn`` or a
transformers model's ``_init_weights``; a tensor none of them wrote is a ValueError naming it
and the ways, and the wrap changes nothing. Before, such a tensor trained from whatever
memory it got (a custom module's parameters, an RMSNorm's weight) or zeros (a meta buffer,
Llama's rotary frequencies), silently."""
import os

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import offload

from support import assert_same_state


class Scale(nn.Module):
    """Values set in __init__ and nowhere else: no reset_parameters()."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(4))
        self.b = nn.Parameter(torch.zeros(3, 4))
        self.register_buffer("c", torch.full((4,), 2.0))

    def forward(self, x):
        return x * self.a + self.c + self.b.sum(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Scale(), Scale()])
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.lin(x).square().mean()


def eager_and_meta(seed=0):
    torch.manual_seed(seed)
    eager = Net()
    torch.manual_seed(seed)
    with torch.device("meta"):
        meta = Net()
    return eager, meta


def config_for(tmp_path):
    return dict(device="cpu", param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path / "swap"))


def init_as_eager(module):
    if isinstance(module, Scale):
        module.a.fill_(1.0)
        module.b.zero_()
        module.c.fill_(2.0)


def trained(model, config, init_fn=None, weights=None, steps=3):
    inputs = torch.randn(steps, 2, 4, generator=torch.Generator().manual_seed(1))
    with offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config, init_fn=init_fn,
                      weights=weights) as engine:
        start = engine.state_dict()
        losses = []
        for x in inputs:
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return start, losses, engine.state_dict()


@pytest.mark.parametrize("init", ["none", "partial"])
def test_a_meta_tensor_nothing_initializes_is_refused_naming_it_and_the_ways_and_changes_nothing(init, tmp_path):
    _, meta = eager_and_meta()
    opt = torch.optim.AdamW(meta.parameters(), lr=1e-2)
    params_before = dict(meta.named_parameters())
    rng_before = torch.get_rng_state()
    os.makedirs(tmp_path / "swap")

    def only_a(module):
        if isinstance(module, Scale):
            module.a.fill_(1.0)

    missing = "layers.0.a, layers.0.b, layers.0.c" if init == "none" else "layers.0.b, layers.0.c"
    refusal_text = (rf"wrap: the model was built on the meta device, and nothing gave {missing} its values: "
                    rf"neither a reset_parameters\(\) of its module \(Scale\) nor an init_fn")
    with pytest.raises(ValueError, match=refusal_text) as refusal:
        offload.wrap(meta, opt, config=config_for(tmp_path), init_fn=only_a if init == "partial" else None)
    assert "wrap(..., weights=PATH)" in str(refusal.value) and "init_fn=fn" in str(refusal.value)
    assert all(p is params_before[n] and p.is_meta for n, p in meta.named_parameters())
    assert all(b.is_meta for b in meta.buffers())
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params_before.values()))
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert os.listdir(tmp_path / "swap") == []


def test_with_an_init_fn_it_starts_and_trains_as_the_eager_model(tmp_path):
    eager, meta = eager_and_meta()
    eager_run = trained(eager, config_for(tmp_path))
    meta_run = trained(meta, config_for(tmp_path), init_fn=init_as_eager)
    assert_same_state(meta_run[0], eager_run[0])
    assert meta_run[1] == eager_run[1]
    assert_same_state(meta_run[2], eager_run[2])


def test_with_weights_it_takes_them(tmp_path):
    eager, meta = eager_and_meta()
    save_file({k: v.contiguous() for k, v in eager.state_dict().items()}, str(tmp_path / "model.safetensors"))
    eager_run = trained(eager, config_for(tmp_path))
    meta_run = trained(meta, config_for(tmp_path), weights=str(tmp_path / "model.safetensors"))
    assert_same_state(meta_run[0], eager_run[0])
    assert meta_run[1] == eager_run[1]


def test_a_meta_transformers_model_without_weights_gets_its_own_initializer(tmp_path):
    """Llama's RMSNorm has no reset_parameters and its rotary frequencies are buffers: its
    _init_weights gives them (1.0, and the eager build's frequencies), as from_config does."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from hf_support import CONFIG
    torch.manual_seed(0)
    eager = LlamaForCausalLM(LlamaConfig(**CONFIG))
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    with offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config_for(tmp_path)) as engine:
        state = engine.state_dict()
        for name, b in eager.named_buffers():
            assert torch.equal(dict(model.named_buffers())[name], b), name
    assert all(torch.isfinite(v).all() for v in state.values())
    norms = [k for k in state if k.endswith("norm.weight")]
    assert norms and all(torch.equal(state[k], torch.ones_like(state[k])) for k in norms)
    # the linear layers and the embedding drawn with the config's initializer_range (0.02), as
    # the eager build's, not with torch's defaults (the embedding's would be 1.0)
    std = LlamaConfig(**CONFIG).initializer_range
    for k in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
        assert abs(state[k].std().item() - std) < 0.1 * std, k
