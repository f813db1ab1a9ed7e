"""[Note: split master] bf16 with the optimizer states on NVMe keeps the fp32 master at home
as its low 16 bits, the high 16 being the bf16 compute copy."""
import pytest
import torch

import offload
from offload.gpt import GPT
from offload.optim import join_master, split_master
from offload.units import padded_numel

from support import BF16_LOSS_REL_TOL, CFG, batches, budget_for, gpt_loss, make_opt, train_offload


def half_away_bits(master):
    """The bf16 bits of ``master`` rounded half away from zero, from integer arithmetic."""
    bits = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return (((bits + 0x8000) >> 16) & 0xFFFF).to(torch.int32)


def differs_at_a_tie(master):
    """Where ``master`` rounds otherwise half away from zero than to nearest even: exact ties
    (low half 0x8000) whose high half is even, which nearest even keeps."""
    nearest_even = master.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return nearest_even != half_away_bits(master)


def test_split_then_join_gives_every_master_back_and_rounds_like_nearest_even_but_at_ties():
    # every high half with the low halves around the rounding point, plus random patterns
    high = torch.arange(1 << 16, dtype=torch.int64)
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    bits = ((high[:, None] << 16) | lows[None, :]).reshape(-1)
    bits = torch.cat([bits, torch.randint(0, 1 << 32, (1 << 20,), generator=torch.Generator().manual_seed(0))])
    master = bits.to(torch.int32).view(torch.float32).contiguous()  # int64 -> int32 wraps
    hi = torch.empty(master.numel(), dtype=torch.bfloat16)
    lo = torch.empty(master.numel(), dtype=torch.int16)
    split_master(master, hi, lo)
    back = torch.empty_like(master)
    join_master(hi, lo, back)
    nan = torch.isnan(master)
    assert nan.any() and torch.equal(back.view(torch.int32)[~nan], master.view(torch.int32)[~nan])
    assert torch.isnan(back[nan]).all() and torch.isnan(hi[nan].float()).all()
    hi_bits = hi.view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(hi_bits[~nan], half_away_bits(master)[~nan])
    nearest_even = master.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    tie = (master.view(torch.int32) & 0xFFFF) == 0x8000
    differs = (hi_bits != nearest_even) & ~nan
    assert differs.any() and not (differs & ~tie).any()  # only exact ties round otherwise
    assert torch.equal(differs, differs_at_a_tie(master) & ~nan)


def test_split_master_rejects_mismatched_buffers():
    master = torch.zeros(8)
    with pytest.raises(TypeError, match="low"):
        split_master(master, torch.empty(8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.float16))
    with pytest.raises(ValueError, match="high"):
        join_master(torch.empty(4, dtype=torch.bfloat16), torch.empty(8, dtype=torch.int16), master)


def bf16_engine(swap_dir, split, param_tier="nvme", seed=0, **extra):
    torch.manual_seed(seed)
    model = GPT(CFG)
    config = dict(dtype="bf16", param_tier=param_tier, optimizer_tier="nvme", swap_dir=str(swap_dir),
                  device_budget=budget_for(model, 0.4), split_master=split, **extra)
    return offload.wrap(model, make_opt(model.parameters()), config=config)


@pytest.mark.parametrize("param_tier,extra", [
    ("nvme", {}), ("host", {}),
    # step()'s own pipeline (clipping needs every gradient first), over accumulated micro-batches
    ("nvme", {"max_grad_norm": 1.0, "gradient_accumulation_steps": 2, "speculative_updates": False})],
    ids=["nvme", "host", "nvme-clipped"])
def test_the_home_holds_low_halves_and_the_compute_copy_is_the_high_half(param_tier, extra, tmp_path):
    """After some steps every unit's compute copy at home is its master rounded half away
    from zero, and the master's home holds the low halves, 2 B per element instead of 4:
    the difference shows in the NVMe bytes to the byte. The run is the one of a whole fp32
    master, bit for bit, until a master sits exactly on a tie: only there do the compute
    copies differ (by one bf16 ulp), and from there Adam carries that on."""
    data = batches(6)
    accumulation = extra.get("gradient_accumulation_steps", 1)
    with bf16_engine(tmp_path / "whole", False, param_tier, **extra) as whole, \
            bf16_engine(tmp_path / "split", True, param_tier, **extra) as engine:
        whole_losses, losses, tied_at = [], [], None
        for i, b in enumerate(data):
            if tied_at is None and i % accumulation == 0:  # at an update boundary, both settled
                masters, whole_masters = engine.state_dict(), whole.state_dict()
                for name, value in masters.items():
                    assert torch.equal(value.view(torch.int32), whole_masters[name].view(torch.int32)), name
                if any(differs_at_a_tie(m).any() for m in masters.values()):
                    tied_at = i  # the compute copies differ from here on, at such ties only
            for e, out in ((whole, whole_losses), (engine, losses)):
                loss = gpt_loss(e, b)
                e.backward(loss)
                e.step()
                out.append(loss.item())
            if tied_at is None:  # the same compute copies computed this loss
                assert losses[-1] == whole_losses[-1], i
        whole_bytes = whole.stats()["nvme_bytes"]
        whole.zero_grad()
        for u in whole.units:  # a whole master's compute copy: rounded to nearest even
            t = u.spec.trainable_numel
            master = whole.debug.homes.read_master(u)[:t]
            compute = whole.debug.homes.load(u.compute_home, t, torch.bfloat16)
            assert torch.equal(compute.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
        engine.zero_grad()
        state = engine.state_dict()
        saved = sum(u.master_numel * 4 - padded_numel(u.spec.trainable_numel, 2) * 2
                    for u in engine.units if u.trainable)
        assert engine.stats()["nvme_bytes"] == whole_bytes - saved
        for u in engine.units:
            t = u.spec.trainable_numel
            master = engine.debug.homes.read_master(u)[:t]
            compute = engine.debug.homes.load(u.compute_home, t, torch.bfloat16)
            low = engine.debug.homes.load(u.master_home, t, torch.int16)
            assert u.master_home.nbytes == padded_numel(t, 2) * 2
            assert torch.equal(compute.view(torch.int16).to(torch.int32) & 0xFFFF, half_away_bits(master))
            assert torch.equal(low, master.view(torch.int32).to(torch.int16))  # the low 16 bits
            for e in u.trainable:
                assert torch.equal(state[e.fqn].reshape(-1), master[e.offset:e.offset + e.numel])
    # After a tie the runs are two bf16 trainings of one model whose compute copies differed
    # by one bf16 rounding in a few elements, the size of the rounding every bf16 op makes:
    # their curves stay as close as a bf16 run stays to fp32 (BF16_LOSS_REL_TOL). How much
    # closer depends on the CPU's kernels: Adam amplifies the one-ulp difference chaotically.
    assert max(abs(a - b) / b for a, b in zip(losses, whole_losses)) < BF16_LOSS_REL_TOL


@pytest.mark.host_device
def test_split_master_moves_fewer_bytes_per_step(tmp_path):
    """Per update the master costs 2 B of reads (its low halves; the high ones are the
    compute copy, read as before) and 2 B of writes where a whole master costs 4 and 4, on
    top of the compute copy's own write."""
    moved = {}
    for split in (True, False):
        with bf16_engine(tmp_path / str(split), split, overlap_step_with_forward=False, prefetch=False) as engine:
            train_offload(engine, batches(2))
            before = engine.stats()
            train_offload(engine, batches(1, seed=7))
            after = engine.stats()
            moved[split] = (after["bytes_read_nvme"] - before["bytes_read_nvme"],
                            after["bytes_written_nvme"] - before["bytes_written_nvme"])
            master = sum(u.master_numel * 4 for u in engine.units if u.trainable)
            low = sum(padded_numel(u.spec.trainable_numel, 2) * 2 for u in engine.units if u.trainable)
    (read, written), (read_whole, written_whole) = moved[True], moved[False]
    assert written == written_whole - master + low
    # the high halves of units whose device copy is stale come from the compute home
    assert read_whole - master + low <= read < read_whole


@pytest.mark.parametrize("save_split,load_split", [(True, True), (True, False), (False, True)])
def test_checkpoints_hold_the_fp32_master_whatever_its_home_layout(save_split, load_split, tmp_path):
    """A checkpoint stores fp32 masters: one saved from split homes loads into an engine
    with a whole master and the other way round, the masters bit for bit; a split engine
    resumed from its own checkpoint continues exactly as an uninterrupted one."""
    data = batches(5)
    with bf16_engine(tmp_path / "ref", save_split) as ref:
        train_offload(ref, data)
        final = ref.state_dict()
    with bf16_engine(tmp_path / "a", save_split) as engine:
        train_offload(engine, data[:3])
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        saved = engine.state_dict()
    with bf16_engine(tmp_path / "b", load_split, seed=1) as engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        loaded = engine.state_dict()
        for k in saved:
            assert torch.equal(loaded[k], saved[k]), k
        train_offload(engine, data[3:])
        resumed = engine.state_dict()
    if save_split == load_split:
        for k in final:
            assert torch.equal(resumed[k], final[k]), k


def test_split_master_applies_only_where_it_can(tmp_path):
    """fp32 has no separate master; fp16 halves are not the top of an fp32; the host
    optimizer tier and compute copies living on the device keep a whole master."""
    def master_bytes(**config):
        torch.manual_seed(0)
        model = GPT(CFG)
        config = dict(dict(swap_dir=str(tmp_path), optimizer_tier="nvme", param_tier="nvme"), **config)
        with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
            return {u.master_home.nbytes if u.master_home is not None and not isinstance(u.master_home, torch.Tensor)
                    else None for u in engine.units[1:]}, [u.master_numel for u in engine.units[1:]]

    for config in (dict(dtype="fp16", initial_loss_scale=2.0**10), dict(dtype="bf16", param_tier="device")):
        sizes, numels = master_bytes(**config)
        assert sizes == {numels[0] * 4}, config
    sizes, numels = master_bytes(dtype="bf16")
    assert sizes == {padded_numel(numels[0], 2) * 2}
    with pytest.raises(ValueError, match="split_master"):
        offload.OffloadConfig(split_master="yes")
