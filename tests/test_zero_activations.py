"""ZeRO stages 2 and 3 on 2 ranks (gloo, CPU) with activation_offload "host" and "nvme"
([Note: saved activations]): each rank's saved activations leave its device and come back,
and every rank's losses and weights equal those of the same ranks without offload, bit for
bit. Ranks start as in test_zero.py (forkserver, each on its half of the global batch)."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import offload
from offload.gpt import GPT, GPTConfig

from support import free_port

# Per rank, a (1, 32, 64) fp32 block input is 8 KiB, above ACTIVATION_MIN_BYTES: most move.
CFG = GPTConfig(vocab_size=64, seq_len=32, d_model=64, num_heads=2, num_layers=3)
WORLD, GLOBAL_BATCH, STEPS = 2, 2, 3


def _worker(rank, port, config, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        config = dict(config, swap_dir=os.path.join(config["swap_dir"], f"rank{rank}"))
        os.makedirs(config["swap_dir"])
        torch.manual_seed(0)
        model = GPT(CFG)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        g = torch.Generator().manual_seed(1)
        losses = []
        with offload.wrap(model, opt, config=config) as engine:
            for _ in range(STEPS):
                b = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.seq_len + 1), generator=g)[rank:rank + 1]
                loss = engine(b[:, :-1], b[:, 1:])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            result = {"losses": losses, "state": engine.state_dict(), "stats": engine.stats()}
        result["swap_files"] = [f for _, _, files in os.walk(config["swap_dir"]) for f in files]
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run(tmp_path, name, config):
    out = tmp_path / name
    (out / "swap").mkdir(parents=True)
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(_worker, args=(free_port(), dict(config, swap_dir=str(out / "swap")), str(out)),
                       nprocs=WORLD, join=True, start_method="forkserver")
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    assert all(r["swap_files"] == [] for r in results), "swap files removed on close"
    return results


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_ranks_train_bit_for_bit_with_activation_offload(stage, tmp_path):
    base = dict(stage=stage, param_tier="nvme" if stage == 3 else "host", optimizer_tier="host")
    plain = run(tmp_path, "plain", base)
    for mode in ("host", "nvme"):
        offloaded = run(tmp_path, mode, dict(base, activation_offload=mode))
        for r in range(WORLD):
            assert offloaded[r]["losses"] == plain[r]["losses"], (mode, r)
            for k, v in plain[r]["state"].items():
                assert torch.equal(v, offloaded[r]["state"][k]), (mode, r, k)
            act = offloaded[r]["stats"]["activations"]
            moved = act["to_host_bytes" if mode == "host" else "to_nvme_bytes"]
            assert moved > 0 and act["returned_bytes"] == STEPS * moved, (mode, r)
            if mode == "nvme":
                assert act["nvme_bytes_written"] == act["written_to_nvme_bytes"] > 0
