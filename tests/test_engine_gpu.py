"""CUDA paths: the device tier on a GPU, copies on the copy stream, pinned staging.
Skipped on machines without CUDA (see conftest.py); run them where a GPU is lent."""
import copy

import pytest
import torch

import offload
from offload.gpt import GPT

from support import CFG, REL_TOL, batches, budget_for, make_opt, max_rel_error, train_offload

pytestmark = pytest.mark.gpu


def cuda_batches(n):
    return [b.cuda() for b in batches(n)]


@pytest.mark.parametrize("param_tier", ["device", "host", "nvme"])
@pytest.mark.parametrize("optimizer_tier", ["host", "nvme"])
def test_cuda_fp32_parity_every_tier_combination(param_tier, optimizer_tier, tmp_path):
    torch.manual_seed(0)
    ref = GPT(CFG).cuda()
    model = copy.deepcopy(ref).cpu()
    data = cuda_batches(10)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for b in data:
        loss = ref(b[:, :-1], b[:, 1:])
        loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
    config = dict(device="cuda", param_tier=param_tier, optimizer_tier=optimizer_tier,
                  swap_dir=str(tmp_path), device_budget=None if param_tier == "device" else budget_for(model, 0.6))
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        assert engine.device.type == "cuda"
        train_offload(engine, data)
        ref_state = {k: v.cpu() for k, v in ref.state_dict().items()}
        # CUDA and CPU kernels round differently (TF32 is off by default for fp32 matmul,
        # but reductions differ); the Adam itself runs on the CPU in both.
        assert max_rel_error(engine.state_dict(), ref_state) < 100 * REL_TOL
        stats = engine.stats()
        assert stats["device_peak_bytes"] <= stats["device_budget_bytes"]
        if param_tier != "device":
            assert stats["bytes_host_to_device"] > 0


def test_cuda_device_budget_bounds_the_gpu_arena():
    torch.manual_seed(0)
    model = GPT(CFG)
    budget = budget_for(model, 0.5)
    before = torch.cuda.memory_allocated()
    with offload.wrap(model, make_opt(model.parameters()),
                      config=dict(device="cuda", param_tier="host", device_budget=budget)) as engine:
        assert torch.cuda.memory_allocated() - before <= budget + (1 << 20)
        train_offload(engine, cuda_batches(3))
        assert engine.stats()["device_peak_bytes"] <= budget


def test_aligned_empty_is_pinned_with_cuda():
    from offload.io import aligned_empty

    buf = aligned_empty(1 << 20)
    assert buf.is_pinned() and buf.data_ptr() % 4096 == 0


@pytest.mark.parametrize("param_tier", ["host", "nvme"])
def test_cuda_bf16_split_master_tracks_a_whole_master(param_tier, tmp_path):
    """[Note: split master] On CUDA the high halves come from the compute copy at home (no
    update through a device copy there): the loss curve is that of a whole fp32 master
    (they differ only at exact ties), with 2 B per parameter less of master on NVMe."""
    from offload.units import padded_numel

    data = cuda_batches(6)
    runs = {}
    for split in (True, False):
        torch.manual_seed(0)
        model = GPT(CFG)
        config = dict(device="cuda", dtype="bf16", param_tier=param_tier, optimizer_tier="nvme",
                      swap_dir=str(tmp_path / str(split)), device_budget=budget_for(model, 0.6),
                      split_master=split)
        with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
            losses = train_offload(engine, data)
            low = sum(padded_numel(u.spec.trainable_numel, 2) * 2 for u in engine.units if u.trainable)
            master = sum(u.master_numel * 4 for u in engine.units if u.trainable)
            runs[split] = (losses, engine.stats()["nvme_bytes"])
    (losses, nvme), (whole_losses, whole_nvme) = runs[True], runs[False]
    assert nvme == whole_nvme - master + low
    assert max(abs(a - b) / b for a, b in zip(losses, whole_losses)) < 1e-3
