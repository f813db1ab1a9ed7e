"""CUDA paths: the device tier on a GPU, copies on the copy stream, pinned staging.
Skipped on machines without CUDA (see conftest.py); run them where a GPU is lent."""
import copy

import pytest
import torch

import offload
from offload.gpt import GPT

from support import (BF16_LOSS_REL_TOL, CFG, REL_TOL, batches, budget_for, check_activation_offload,
                     check_delayed_updates, make_opt, max_rel, max_rel_error, train_offload)

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


def test_the_host_tiers_buffers_are_pinned_in_place_at_their_size(tmp_path):
    """[Note: pinned buffers] cudaHostRegister on the tier's own mappings: pinned, counted
    at their size, unpinned at close; temporary buffers stay pageable."""
    from offload.io import aligned_empty

    assert not aligned_empty(1 << 20).is_pinned()
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = offload.wrap(model, make_opt(model.parameters()),
                          config=dict(device="cuda", param_tier="nvme", optimizer_tier="nvme",
                                      swap_dir=str(tmp_path), device_budget=budget_for(model, 0.6)))
    host = engine.debug.host
    with engine:
        train_offload(engine, cuda_batches(2))
        assert host.pinned_bytes == host.used_bytes > 0
    assert host.pinned_bytes == 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_device_homed_compute_copies_with_states_on_nvme(dtype, tmp_path):
    """Issue 37, finding 1 on the GPU: the commonest setup trains, as the CPU device does."""
    data = batches(4)
    runs = {}
    for device in ("cuda", "cpu"):
        torch.manual_seed(0)
        model = GPT(CFG)
        config = dict(device=device, dtype=dtype, param_tier="device", optimizer_tier="nvme",
                      swap_dir=str(tmp_path / device))
        with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
            runs[device] = train_offload(engine, [b.to(device) for b in data])
    assert max(abs(a - b) / abs(b) for a, b in zip(runs["cuda"], runs["cpu"])) < (1e-2 if dtype == "bf16" else 1e-4)


def test_a_slow_compute_stream_never_reads_a_slot_a_later_fill_overwrites(tmp_path):
    """Issue 37, finding 2 on the GPU: each unit's forward first queues a long sleep on the
    compute stream, so its kernels run long after the CPU has moved on and released its
    slot; a fill of that slot for another unit waits for the release's event. The outputs
    of evaluation under no_grad with slots reused equal those of a run without the sleeps."""
    torch.manual_seed(0)
    model = GPT(CFG)
    data = cuda_batches(3)
    config = dict(device="cuda", param_tier="host", optimizer_tier="host", device_budget=budget_for(model, 0.5))

    def evaluate(slow):
        outs = []
        m = copy.deepcopy(model)
        with offload.wrap(m, make_opt(m.parameters()), config=config) as engine:
            handles = [block.register_forward_pre_hook(lambda *_: torch.cuda._sleep(20_000_000))
                       for block in engine.module.blocks] if slow else []
            with torch.no_grad():
                for b in data:
                    outs.append(engine(b[:, :-1], b[:, 1:]).item())
            for h in handles:
                h.remove()
        return outs
    assert evaluate(slow=True) == evaluate(slow=False)


def test_cuda_clipping_with_speculation_and_gradients_copied_out_without_blocking(tmp_path):
    """[Note: gradients off the device] with clipping and speculative updates on NVMe
    states: the curve of the CPU device's run."""
    data = batches(5)
    runs = {}
    for device in ("cuda", "cpu"):
        torch.manual_seed(0)
        model = GPT(CFG)
        config = dict(device=device, param_tier="host", optimizer_tier="nvme", max_grad_norm=1.0,
                      swap_dir=str(tmp_path / device))
        with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
            runs[device] = train_offload(engine, [b.to(device) for b in data])
    assert max(abs(a - b) / abs(b) for a, b in zip(runs["cuda"], runs["cpu"])) < 1e-4


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
    # The compute copies differ by one bf16 ulp wherever a master sits on an exact tie (the
    # split copy rounds half away from zero, the whole one to nearest even: a random fp32
    # initialization of this size has such ties), and Adam carries that on: two bf16 runs
    # apart, held to the bf16 bound as test_optim_split_master holds them after the first
    # tie. On the H200 (issue #43) they were 1.7e-3 apart, past the 1e-3 this test first had.
    assert max(abs(a - b) / b for a, b in zip(losses, whole_losses)) < BF16_LOSS_REL_TOL



# Written after the first GPU session (issue #43) from the CPU tests of each mode; not yet run
# on a GPU. Their bodies (support.check_*) run on the CPU device in test_device_streams.py.

def test_cuda_delayed_updates_follow_the_cpu_device(tmp_path):
    check_delayed_updates(("cuda", "cpu"), tmp_path)


@pytest.mark.parametrize("kind", ["host", "nvme"])
def test_cuda_activation_offload_returns_what_it_moved(kind, tmp_path):
    check_activation_offload(kind, ("cuda",), tmp_path)


def test_cuda_offload_trainer_follows_the_cpu_device(tmp_path):
    """OffloadTrainer on the Trainer's CUDA device (states on NVMe, clipping every step): the
    loss curve of the same run on the CPU device."""
    from hf_support import trainer_losses

    cuda, cpu = trainer_losses(tmp_path / "cuda", use_cpu=False), trainer_losses(tmp_path / "cpu", use_cpu=True)
    assert len(cuda) == len(cpu) > 0 and max_rel(cuda, cpu) < 1e-4
