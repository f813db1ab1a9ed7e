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

from offload.tiers.streams import STANDIN_ENV

from support import batches, free_port

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=3)
WORLD = 2
CASES = [(1, "host", "nvme", "bf16", "exact"), (2, "nvme", "nvme", "bf16", "exact"), (3, "host", "host", "fp32", "exact"),
         (2, "device", "host", "bf16", "exact"),
         # [Note: compact optimizer states] at stage 0 each rank holds the whole compact states
         (0, "host", "nvme", "bf16", "compact"), (0, "nvme", "host", "bf16", "compact")]


def budget_refusals(wrap, row):
    """The fields named by wrap's refusals of one byte less of the row's host budget, then of
    its device budget (a wrap that accepts one is closed and names nothing)."""
    refused = []
    for budgets in (dict(host_budget=row["host_bytes"] - 1), dict(device_budget=row["device_bytes"] - 1)):
        try:
            wrap(**budgets).close()
        except ValueError as e:
            refused.append(str(e).split(":")[0])
    return refused


def planned(stage, param_tier, optimizer_tier, dtype, world=WORLD, group=WORLD, optimizer_states="exact",
            delayed_update=False, device=plan.CPU):
    with torch.device("meta"):
        shape = plan.shape_from_module(GPT(CFG), "gpt")
    configurations = plan_ranks.plan_ranks(shape, dtype, world, stage, group, world, optimizer_states=optimizer_states,
                                           delayed_update=delayed_update, device=device)
    return next(c for c in configurations if (c["param_tier"], c["optimizer_tier"]) == (param_tier, optimizer_tier))


def _worker(rank, port, swap_root, out_dir, standin=False):
    # the forkserver's children have its environment, not the test's: set it here
    if standin:
        os.environ[STANDIN_ENV] = "cuda"
    else:
        os.environ.pop(STANDIN_ENV, None)
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
            results.append(dict(got, refused=budget_refusals(wrap, row), row=row))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_each_ranks_planned_bytes_are_what_its_wrap_checks_its_budgets_against(tmp_path):
    """Each rank wraps at exactly its row's host and device bytes (accepted, and the NVMe
    bytes it holds are the row's) and refuses one byte less of either, naming the budget:
    stage 1 (host, nvme), 2 (nvme, nvme) and (device, host), 3 (host, host); compact states
    at stage 0 (host, nvme) and (nvme, host). Compact states at stage >= 1 are refused rows."""
    run_workers(tmp_path, standin=False)
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


def run_workers(tmp_path, standin):
    """Each rank's wrap at its row's budgets, and at one byte less of each (``_worker``)."""
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(_worker, args=(free_port(), str(tmp_path / "swap"), str(tmp_path), standin), nprocs=WORLD,
                       join=True, start_method="forkserver")
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]
    for rank in range(WORLD):
        for case, got in zip(CASES, results[rank]):
            assert got["nvme"] == got["row"]["nvme_bytes"], (rank, case)
            assert got["device"] == got["row"]["device_bytes"], (rank, case)
            assert got["refused"] == ["host_budget", "device_budget"], (rank, case)
    return results


def test_each_ranks_planned_bytes_on_the_cuda_standin_are_what_its_wrap_checks_against(tmp_path):
    """The same on the CPU stand-in of CUDA (each rank plans and wraps with device "cpu",
    which the stand-in runs as CUDA): the rows are those of ``--device cuda``, and where
    compute copies are read from NVMe below stage 3 they hold the fetch staging buffers
    a CPU device's rows do not."""
    results = run_workers(tmp_path, standin=True)
    cuda = torch.device("cuda")
    for rank in range(WORLD):
        for case, got in zip(CASES, results[rank]):
            stage, param_tier, optimizer_tier, dtype, states = case
            assert got["row"] == planned(stage, param_tier, optimizer_tier, dtype, optimizer_states=states,
                                         device=cuda)["rows"][rank], (rank, case)
    stage_2_nvme = CASES.index((2, "nvme", "nvme", "bf16", "exact"))
    assert results[0][stage_2_nvme]["row"]["host_bytes"] > planned(2, "nvme", "nvme", "bf16")["rows"][0]["host_bytes"]


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


DELAYED_CASES = [(1, "host", "nvme", "bf16"), (2, "nvme", "nvme", "bf16"), (2, "host", "host", "fp32"),
                 (3, "nvme", "host", "bf16")]
DELAYED_STEPS = 3  # the first exact (warm-up 1), the next two delayed


def _delayed_worker(rank, port, swap_root, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results = []
    try:
        data = [b[rank:rank + 1] for b in batches(DELAYED_STEPS)]
        for stage, param_tier, optimizer_tier, dtype in DELAYED_CASES:
            row = planned(stage, param_tier, optimizer_tier, dtype, delayed_update=True)["rows"][rank]
            swap = os.path.join(swap_root, f"delayed-s{stage}{param_tier}{optimizer_tier}-rank{rank}")
            os.makedirs(swap)
            config = dict(device="cpu", stage=stage, dtype=dtype, param_tier=param_tier, optimizer_tier=optimizer_tier,
                          swap_dir=swap, delayed_update=True, delayed_update_warmup_steps=1, prefetch=False)

            def wrap(**budgets):
                torch.manual_seed(0)
                model = GPT(CFG)
                return offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), dict(config, **budgets))

            # trained at exactly the row's budgets: the host tier refuses a planned buffer past
            # host_budget, the device tier a slot past device_budget
            with wrap(host_budget=row["host_bytes"], device_budget=row["device_bytes"]) as engine:
                for b in data:
                    engine.backward(engine(b[:, :-1], b[:, 1:]))
                    engine.step()
                stats = engine.stats()
                got = {"nvme": stats["nvme_bytes"], "device": stats["device_budget_bytes"],
                       "host_peak": stats["host_peak_bytes"], "delayed": stats["delayed_updates"]}
            results.append(dict(got, refused=budget_refusals(wrap, row), row=row))
        torch.save(results, os.path.join(out_dir, f"delayed-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_each_ranks_planned_bytes_with_delayed_updates_are_what_its_wrap_holds(tmp_path):
    """``--delayed-update`` with ``--ranks``: each rank's row counts its spare compute copy
    ([Note: delayed updates across ranks]: of its chunks at stage 3), so each rank wraps and
    trains delayed steps at exactly its row's host and device bytes, holds exactly the
    row's NVMe bytes, and refuses one byte less of either, naming the budget; param_tier
    "device" rows are refused as the config refuses them. Before, the rows left the spare
    copies out: a rank holding them past its planned host or NVMe bytes."""
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(_delayed_worker, args=(free_port(), str(tmp_path / "swap"), str(tmp_path)), nprocs=WORLD,
                       join=True, start_method="forkserver")
    for rank in range(WORLD):
        for case, got in zip(DELAYED_CASES, torch.load(tmp_path / f"delayed-rank{rank}.pt", weights_only=False)):
            assert got["delayed"] == DELAYED_STEPS - 1, (rank, case)
            assert got["nvme"] == got["row"]["nvme_bytes"], (rank, case)
            assert got["device"] == got["row"]["device_bytes"], (rank, case)
            assert got["host_peak"] <= got["row"]["host_bytes"], (rank, case)
            assert got["refused"] == ["host_budget", "device_budget"], (rank, case)
    for stage, param_tier, optimizer_tier, dtype in DELAYED_CASES:
        # the spare copies are what delayed updates add: a compute copy (of the rank's chunks)
        without, with_spare = (planned(stage, param_tier, optimizer_tier, dtype, delayed_update=d)["rows"][0]
                               for d in (False, True))
        spare_tier = "nvme_bytes" if param_tier == "nvme" else "host_bytes"
        assert with_spare[spare_tier] > without[spare_tier], (stage, param_tier)
    for stage in (1, 2):
        device_rows = [c for c in plan_ranks.plan_ranks(plan.shape_from_count(10**6, 4), "bf16", WORLD, stage, WORLD,
                                                        WORLD, delayed_update=True) if c["param_tier"] == "device"]
        assert device_rows and all("delayed_update" in c["refused"] for c in device_rows)
    proc = run_cli("--params", "1e7", "--ranks", "2", "--stage", "2", "--delayed-update", "--host-budget", "1GiB")
    assert proc.returncode == 0, proc.stderr
    ranks_section = proc.stdout.split("several ranks:")[1]
    assert [line.split()[:3] for line in ranks_section.splitlines() if line.startswith("device ")] == \
        [["device", "host", "refused:"], ["device", "nvme", "refused:"]]
