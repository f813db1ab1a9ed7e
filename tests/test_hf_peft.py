"""LoRA through peft on a wrapped model, and model.state_dict() of a wrapped model ([Note:
state_dict of a wrapped model]): the adapters train as plain peft does, only they carry
optimizer state and swap writes, and peft's save_pretrained writes their trained values."""
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

import offload
from offload.units import PAGE_BYTES

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False)
REL_TOL = 1e-5  # the fp32 parity tolerance of the engine's tests


def batches(n):
    return [torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(s)) for s in range(n)]


def lora_model(base_dir):
    torch.manual_seed(1)
    return get_peft_model(LlamaForCausalLM.from_pretrained(base_dir),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


@pytest.fixture
def base_dir(tmp_path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def _pad(num_bytes):
    return -(-num_bytes // PAGE_BYTES) * PAGE_BYTES


def test_lora_trains_as_plain_peft_with_state_and_writes_for_the_adapters_only(base_dir, tmp_path):
    plain = lora_model(base_dir)
    opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    plain_losses = []
    for b in batches(3):
        loss = plain(input_ids=b, labels=b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        plain_losses.append(loss.item())

    model = lora_model(base_dir)
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    with offload.wrap(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
                      config=dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path))) as engine:
        # the adapters' states only: master (the compute copy, fp32) and two moments, a
        # page-padded prefix of each unit that has adapters
        units_with_adapters = [u for u in engine.units if u.trainable]
        adapter_state = sum(3 * _pad(4 * sum(e.numel for e in u.trainable)) for u in units_with_adapters)
        frozen = sum(e.numel * 4 for u in engine.units for e in u.spec.entries if not e.trainable)
        assert engine.stats()["optimizer_state_bytes"] <= 2 * adapter_state / 3 < frozen / 10
        losses, written = [], []
        for b in batches(3):
            before = engine.stats()["bytes_written_nvme"]
            loss = engine(input_ids=b, labels=b).loss
            engine.backward(loss)
            engine.step()
            engine.state_dict()  # settles the step's writes
            losses.append(loss.item())
            written.append(engine.stats()["bytes_written_nvme"] - before)
        assert all(0 < w <= adapter_state for w in written), (written, adapter_state)
        state = engine.state_dict()
        model.save_pretrained(tmp_path / "adapter")
    assert losses == pytest.approx(plain_losses, rel=REL_TOL)
    reference = plain.state_dict()
    for k, v in reference.items():
        assert torch.allclose(state[k], v, rtol=REL_TOL, atol=1e-7), k
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(saved) == len(trainable)
    for k, v in saved.items():
        assert torch.equal(v, state[k.replace(".weight", ".default.weight")]), k


def test_model_state_dict_of_a_wrapped_model_gives_the_values_and_load_state_dict_is_refused(base_dir, tmp_path):
    model = LlamaForCausalLM.from_pretrained(base_dir)
    with offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                      config=dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path),
                                  dtype="bf16")) as engine:
        b = batches(1)[0]
        engine.backward(engine(input_ids=b, labels=b).loss)
        engine.step()
        state = engine.state_dict()
        full = model.state_dict()
        assert full.keys() == state.keys()
        assert all(torch.equal(full[k], state[k]) for k in state)
        layer = model.model.layers[1].state_dict()  # a submodule's call: its own prefix
        assert all(torch.equal(v, state[f"model.layers.1.{k}"]) for k, v in layer.items())
        assert all(isinstance(v, torch.nn.Parameter) for k, v in model.state_dict(keep_vars=True).items()
                   if "weight" in k)
        engine.backward(engine(input_ids=b, labels=b).loss)  # early updates, no step() yet
        with pytest.raises(RuntimeError, match=r"state_dict\(\) between backward\(\) and step\(\)"):
            model.state_dict()
        engine.step()
        assert model.state_dict().keys() == state.keys()  # the failed call left nothing behind
        with pytest.raises(ValueError, match="load_state_dict.*would be lost"):
            model.load_state_dict(full)
