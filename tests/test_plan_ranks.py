"""`offload plan --ranks N` (offload/plan_ranks.py): each rank's bytes per tier are the ones
wrap checks that rank's budgets against, on 2 real gloo ranks; the command line prints a row
per rank, the node's sum, and names the option that does not fit (issue #38)."""
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import offload
from offload import plan, plan_ranks
from offload.gpt import GPT, GPTConfig

from support import free_port

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=3)
WORLD = 2
CASES = [(1, "host", "nvme", "bf16", "exact"), (2, "nvme", "nvme", "bf16", "exact"), (3, "host", "host", "fp32", "exact"),
         (2, "device", "host", "bf16", "exact"),
         # [Note: compact optimizer states] at stage 0 each rank holds the whole compact states
         (0, "host", "nvme", "bf16", "compact"), (0, "nvme", "host", "bf16", "compact")]


def planned(stage, param_tier, optimizer_tier, dtype, world=WORLD, group=WORLD, optimizer_states="exact"):
    with torch.device("meta"):
        shape = plan.shape_from_module(GPT(CFG), "gpt")
    configurations = plan_ranks.plan_ranks(shape, dtype, world, stage, group, world, optimizer_states=optimizer_states)
    return next(c for c in configurations if (c["param_tier"], c["optimizer_tier"]) == (param_tier, optimizer_tier))


def _worker(rank, port, swap_root, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results = []
    try:
        for stage, param_tier, optimizer_tier, dtype, optimizer_states in CASES:
            row = planned(stage, param_tier, optimizer_tier, dtype, optimizer_states=optimizer_states)["rows"][rank]
            swap = os.path.join(swap_root, f"s{stage}{param_tier}{optimizer_tier}{optimizer_states}-rank{rank}")
            os.makedirs(swap)
            config = dict(device="cpu", stage=stage, dtype=dtype, param_tier=param_tier,
                          optimizer_tier=optimizer_tier, swap_dir=swap, optimizer_states=optimizer_states)

            def wrap(**budgets):
                torch.manual_seed(0)
                model = GPT(CFG)
                return offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), dict(config, **budgets))

            with wrap(host_budget=row["host_bytes"], device_budget=row["device_bytes"]) as engine:
                got = {"nvme": engine.stats()["nvme_bytes"], "device": engine.stats()["device_budget_bytes"]}
            refused = []
            for budgets in (dict(host_budget=row["host_bytes"] - 1), dict(device_budget=row["device_bytes"] - 1)):
                try:
                    wrap(**budgets).close()
                except ValueError as e:
                    refused.append(str(e).split(":")[0])
            results.append(dict(got, refused=refused, row=row))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_each_ranks_planned_bytes_are_what_its_wrap_checks_its_budgets_against(tmp_path):
    """Each rank wraps at exactly its row's host and device bytes (accepted, and the NVMe
    bytes it holds are the row's) and refuses one byte less of either, naming the budget:
    stage 1 (host, nvme), 2 (nvme, nvme) and (device, host), 3 (host, host); compact states
    at stage 0 (host, nvme) and (nvme, host). Compact states at stage >= 1 are refused rows."""
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(_worker, args=(free_port(), str(tmp_path / "swap"), str(tmp_path)), nprocs=WORLD,
                       join=True, start_method="forkserver")
    for rank in range(WORLD):
        for case, got in zip(CASES, torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)):
            assert got["nvme"] == got["row"]["nvme_bytes"], (rank, case)
            assert got["device"] == got["row"]["device_bytes"], (rank, case)
            assert got["refused"] == ["host_budget", "device_budget"], (rank, case)
    compact = planned(0, "host", "nvme", "bf16", optimizer_states="compact")["rows"][0]
    assert compact["nvme_bytes"] == plan.place(plan.shape_from_module(GPT(CFG), "gpt"), "bf16", "host", "nvme",
                                               optimizer_states="compact").nvme_bytes  # whole states on each rank
    refused = plan_ranks.plan_ranks(plan.shape_from_count(10**6, 4), "bf16", WORLD, 1, WORLD, WORLD,
                                    optimizer_states="compact")
    assert all("ZeRO stage 1" in c["refused"] for c in refused)
    # the sharded states shrink each rank's bytes against one process's
    one = plan.place(plan.shape_from_count(10**6, 4), "bf16", "host", "host")
    two = planned(1, "host", "host", "bf16")
    assert two["rows"][0]["host_bytes"] < one.host_bytes


def test_node_sums_its_ranks_and_groups_replicate():
    """4 ranks in groups of 2 on 2 nodes: ranks at the same place of their groups hold the
    same; the node's sum is its two ranks'; stage 3 with param_tier "device" is refused as
    wrap refuses it."""
    with torch.device("meta"):
        shape = plan.shape_from_module(GPT(CFG), "gpt")
    configurations = plan_ranks.plan_ranks(shape, "bf16", 4, 3, 2, 2)
    refused = [c for c in configurations if "refused" in c]
    assert {c["param_tier"] for c in refused} == {"device"} and all("stage" in c["refused"] for c in refused)
    for c in configurations:
        if "refused" in c:
            continue
        assert [r["ranks"] for r in c["rows"]] == [[0, 2], [1, 3]]
        for key in ("device_bytes", "host_bytes", "nvme_bytes"):
            assert c["node"][key] == sum(r[key] for r in c["rows"])
    # groups of 2 hold twice a group of 4's shards
    flat = plan_ranks.plan_ranks(shape, "bf16", 4, 3, 4, 4)
    host = lambda cs: next(c for c in cs if c["param_tier"] == "host" and c["optimizer_tier"] == "host")  # noqa: E731
    assert host(configurations)["rows"][0]["host_bytes"] > host(flat)["rows"][0]["host_bytes"]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "offload", "plan", *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=os.getcwd()))


def test_plan_ranks_prints_each_rank_and_the_node_and_names_what_does_not_fit(tmp_path):
    proc = run_cli("--params", "1e8", "--ranks", "4", "--ranks-per-node", "2", "--stage", "2",
                   "--host-budget", "1GiB", "--json", str(tmp_path / "plan.json"))
    assert proc.returncode == 0, proc.stderr
    assert "several ranks: 4 ranks, ZeRO stage 2, sharding groups of 2, 2 ranks per node" in proc.stdout
    assert "node (sum)" in proc.stdout and "each of 4" in proc.stdout
    import json
    report = json.loads((tmp_path / "plan.json").read_text())["ranks"]
    assert report["world_size"] == 4 and report["shard_group_size"] == 2 and report["ranks_per_node"] == 2
    for args, named in ((("--ranks", "6", "--ranks-per-node", "4"), "--ranks-per-node"),
                        (("--ranks", "4", "--shard-group-size", "3"), "--shard-group-size"),
                        (("--ranks", "1"), "--ranks"), (("--shard-group-size", "2"), "--ranks")):
        proc = run_cli("--params", "1e8", *args)
        assert proc.returncode != 0 and named in proc.stderr, (args, proc.stderr)
