"""[Note: saved activations] (offload/memory/activations.py) with dtype="bf16": the saved
tensors are 16-bit and leave the device as they lie, to host RAM ("host") or through it to
swap files ("nvme"). The runs equal the one without offload bit for bit (losses, every
parameter's gradient after each backward, the weights after each step) on the small GPT
and a small Hugging Face Llama, and the bytes are where the counters say: each forward's
saved bytes are what plain autograd saves in the same forward, the host tier holds the
moved groups with "host" and nothing is written to disk, the store's own I/O engine writes
and reads exactly the moved groups (whole pages) with "nvme" and the host holds at most two
of them on their way.

Long sequences: a group (one unit's saved tensors) is staged whole, in one host buffer
and one swap extent; no piece size bounds it. What splits it is the I/O engine, into
requests of at most io_block_bytes (``offload.io.IOEngine``). The last test trains a
sequence whose groups, and whose largest saved tensors, exceed io_block_bytes."""
import warnings

import pytest
import torch

import offload
from offload.gpt import GPT, GPTConfig
from offload.memory.activations import ACTIVATION_MIN_BYTES

from support import assert_same_state, make_opt

PAGE_BYTES = 4096
GPT_CFG = GPTConfig(vocab_size=64, seq_len=64, d_model=64, num_heads=2, num_layers=4)
BATCH = 2
STEPS = 3
# States in RAM and clipping: no unit is updated during backward (no early updates on host
# states with max_grad_norm), so every gradient can be read between backward and step().
BASE = dict(dtype="bf16", param_tier="host", optimizer_tier="host", max_grad_norm=1.0)


def gpt(cfg=GPT_CFG):
    return GPT(cfg)


def llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaForCausalLM(config)
    model.train()
    return model


MODELS = {"gpt": (gpt, 64, lambda m, b: m(b[:, :-1], b[:, 1:])),
          "llama": (llama, 128, lambda m, b: m(input_ids=b, labels=b).loss)}


def batches(vocab, seq_len, n=STEPS):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (BATCH, seq_len + 1), generator=g) for _ in range(n)]


def gradients(engine):
    """Every trainable parameter's gradient, read between backward and step()."""
    grads = engine.debug.gradients
    return {e.fqn: grads.grad_range(u, k, e.offset, e.offset + e.numel).clone()
            for u in engine.units for k, e in enumerate(u.trainable)}


def train(kind, config, seq_len, steps=STEPS):
    """(losses, gradients after each backward, state_dict after each step, stats, the bytes
    each forward saved: kept + moved) of ``kind`` trained with ``config``."""
    build, vocab, loss_of = MODELS[kind]
    torch.manual_seed(0)
    model = build()
    losses, grads, states, saved = [], [], [], []
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        for b in batches(vocab, seq_len, steps):
            loss = loss_of(engine, b)
            act = engine.stats()["activations"]
            saved.append(act["kept_bytes"] + act["to_host_bytes"] + act["to_nvme_bytes"])
            engine.backward(loss)
            grads.append(gradients(engine))
            engine.step()
            losses.append(loss.item())
            states.append(engine.state_dict())
        return losses, grads, states, engine.stats(), saved


def plainly_saved_bytes(kind, seq_len):
    """Bytes plain autograd saves in one forward of the unwrapped model in bf16 (parameters
    aside, each saved tensor once), counted by saved-tensor hooks of the test's own."""
    build, vocab, loss_of = MODELS[kind]
    torch.manual_seed(0)
    model = build().to(torch.bfloat16)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in parameters:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            saved[key] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(model, batches(vocab, seq_len, 1)[0])
    return sum(saved.values())


def assert_same_run(a, b):
    assert a[0] == b[0], "losses differ"
    for ga, gb in zip(a[1], b[1]):
        assert ga.keys() == gb.keys()
        for name in ga:
            assert ga[name].dtype == gb[name].dtype and torch.equal(ga[name], gb[name]), f"gradient of {name} differs"
    for sa, sb in zip(a[2], b[2]):
        assert_same_state(sa, sb)
    assert a[3]["grad_norm"] == b[3]["grad_norm"]


@pytest.mark.parametrize("mode", ["host", "nvme"])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_bf16_activations_train_bit_for_bit_and_land_where_counted(kind, mode, tmp_path):
    seq_len = GPT_CFG.seq_len if kind == "gpt" else 48
    swap = tmp_path / "swap"
    base = dict(BASE, swap_dir=str(swap))
    plain = train(kind, base, seq_len)
    offloaded = train(kind, dict(base, activation_offload=mode), seq_len)
    assert_same_run(plain, offloaded)
    assert any(bool(g.any()) for g in offloaded[1][0].values())  # gradients, not zeros
    stats = offloaded[3]
    act = stats["activations"]
    groups = [u for u in act["units"] if u["where"] != "keep"]
    moved = act["to_host_bytes"] + act["to_nvme_bytes"]
    assert groups and moved > 0
    # each forward saved what plain autograd saves, each saved tensor once; every group but
    # the last of the forward left, with all its tensors of ACTIVATION_MIN_BYTES or more
    assert offloaded[4] == [plainly_saved_bytes(kind, seq_len)] * STEPS
    assert act["units"][-1]["where"] == "keep" and act["units"][-1]["saved_bytes"] > 0
    assert moved == sum(u["moved_bytes"] for u in groups) <= sum(u["saved_bytes"] for u in groups)
    assert act["kept_bytes"] == offloaded[4][-1] - moved
    assert all(u["saved_bytes"] - u["moved_bytes"] < 16 * ACTIVATION_MIN_BYTES for u in groups)
    assert act["returned_bytes"] == STEPS * moved
    assert act["device_bytes"] == act["host_bytes"] == act["nvme_bytes"] == 0  # all back, all let go
    # the engine's own tiers moved what they moved without activation offload
    assert stats["bytes_written_nvme"] == plain[3]["bytes_written_nvme"]
    assert stats["bytes_read_nvme"] == plain[3]["bytes_read_nvme"]
    if mode == "host":
        assert act["to_nvme_bytes"] == 0 and act["to_host_bytes"] == moved
        assert act["moved_to_host_bytes"] == STEPS * moved and act["moved_to_nvme_bytes"] == 0
        assert act["nvme_bytes_written"] == act["nvme_bytes_read"] == act["written_to_nvme_bytes"] == 0
        # every moved group waits in RAM at once, in one host buffer of whole pages
        assert moved <= act["host_peak_bytes"] < moved + len(groups) * PAGE_BYTES
    else:
        assert act["to_host_bytes"] == 0 and act["to_nvme_bytes"] == moved
        assert act["moved_to_nvme_bytes"] == STEPS * moved and act["moved_to_host_bytes"] == 0
        # the store's own I/O engine wrote each moved group once, whole pages, and read it back
        written = act["nvme_bytes_written"]
        assert written == act["written_to_nvme_bytes"] == act["nvme_bytes_read"]
        assert 0 <= written - STEPS * moved < STEPS * len(groups) * PAGE_BYTES
        assert act["nvme_peak_bytes"] == written // STEPS
        # on their way the host held at most two groups, never the whole forward's
        largest_two = sum(sorted(u["moved_bytes"] for u in groups)[-2:])
        assert 0 < act["host_peak_bytes"] < largest_two + 2 * PAGE_BYTES
        assert len(groups) < 3 or act["host_peak_bytes"] < moved
    assert not [p for p in swap.rglob("*") if p.is_file()], "swap files are removed on close"


@pytest.mark.parametrize("mode", ["host", "nvme"])
def test_bf16_long_sequence_groups_larger_than_an_io_block(mode, tmp_path):
    """A sequence of 2048 tokens: each block's group (and its largest saved tensors, the
    MLP's 4 x d_model activations, 2 MiB) is larger than io_block_bytes, so its host buffer
    is one buffer of the whole group and its swap write and read are split into several
    requests by the I/O engine. The run is still the one without offload, bit for bit."""
    cfg = GPTConfig(vocab_size=64, seq_len=2048, d_model=64, num_heads=2, num_layers=3)
    block = offload.OffloadConfig().io_block_bytes
    assert BATCH * cfg.seq_len * 4 * cfg.d_model * 2 > block  # one saved tensor passes a block
    MODELS["long"] = (lambda: gpt(cfg), cfg.vocab_size, MODELS["gpt"][2])
    try:
        swap = tmp_path / "swap"
        base = dict(BASE, swap_dir=str(swap))
        plain = train("long", base, cfg.seq_len, steps=2)
        offloaded = train("long", dict(base, activation_offload=mode), cfg.seq_len, steps=2)
    finally:
        del MODELS["long"]
    assert_same_run(plain, offloaded)
    act = offloaded[3]["activations"]
    groups = [u for u in act["units"] if u["where"] != "keep"]
    blocks = [u for u in groups if u["unit"].startswith("blocks.")]  # the root's moves its token ids
    assert len(blocks) == cfg.num_layers - 1 and min(u["moved_bytes"] for u in blocks) > 2 * block
    moved = sum(u["moved_bytes"] for u in groups)
    assert act["returned_bytes"] == 2 * moved
    if mode == "host":
        assert act["to_host_bytes"] == moved and act["nvme_bytes_written"] == 0
        assert moved <= act["host_peak_bytes"] < moved + len(groups) * PAGE_BYTES
    else:
        assert act["to_nvme_bytes"] == moved
        assert act["nvme_bytes_written"] == act["nvme_bytes_read"] == act["written_to_nvme_bytes"]
        assert 0 <= act["nvme_bytes_written"] - 2 * moved < 2 * len(groups) * PAGE_BYTES
    assert not [p for p in swap.rglob("*") if p.is_file()]
