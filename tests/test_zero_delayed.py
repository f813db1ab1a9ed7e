"""[Note: delayed updates across ranks] Issue 38: delayed_update=True with several ranks. Each
rank delays its own shard's update; the stage 1-2 all-gather of the updated shards runs in
the delayed update (on the optimizer worker, into the spare compute copy), stage 3's fetches
gather the committed chunks. N gloo ranks with delayed updates equal ONE process with delayed
updates on the whole batch (within the fp32 reduction-order tolerance of the one-process
ZeRO tests), with clipping on some steps, host and NVMe tiers; a checkpoint saved with
updates pending resumes bit for bit."""
import json
import os
import time
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import offload
import offload.faults
from offload.gpt import GPT
from offload.memory.layout import Layout

from support import (CFG, REL_TOL, free_port, gpt_loss, make_opt, max_rel_error, train_holding_the_first_delayed_update,
                     train_offload)
from support import batches as _batches

GLOBAL_BATCH = 4
STEPS = 8
WARMUP = 2
CLIP_NORM = 5.0  # the test batches' norms fall from about 8 to 3: the first steps clip, the later ones not


def gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(CFG)


def one_process(config, data, swap_dir):
    """The same config on one process, on the whole batch: (losses, state_dict, stats)."""
    config = {k: v for k, v in config.items() if k not in ("stage", "shard_group_size")}
    if swap_dir is not None:
        os.makedirs(swap_dir)
        config["swap_dir"] = str(swap_dir)
    model = gpt()
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        losses = train_offload(engine, data)
        return losses, engine.state_dict(), engine.stats()


def _rank_config(config, out_dir, rank, name):
    if not config.get("swap_dir"):
        return config
    swap = os.path.join(config["swap_dir"], f"{name}-rank{rank}")
    os.makedirs(swap)
    return dict(config, swap_dir=swap)


def _worker(rank, port, world, config, data, out_dir, cut, hold):
    """Train on this rank's part of ``data``; with ``cut``, also a run saved after ``cut``
    steps and one that loads that checkpoint (from other weights) and trains the rest; with
    ``hold``, also a run whose first delayed update is held (support's
    train_holding_the_first_delayed_update)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        per_rank = data[0].shape[0] // world
        mine = [b[rank * per_rank:(rank + 1) * per_rank] for b in data]
        model = gpt()
        with offload.wrap(model, make_opt(model.parameters()), config=_rank_config(config, out_dir, rank, "whole")) \
                as engine:
            losses = train_offload(engine, mine)
            result = {"losses": losses, "state": engine.state_dict(), "stats": engine.stats()}
        if cut is not None:
            ckpt = os.path.join(out_dir, "ckpt")
            model = gpt()
            with offload.wrap(model, make_opt(model.parameters()),
                              config=_rank_config(config, out_dir, rank, "saver")) as engine:
                result["saver_losses"] = train_offload(engine, mine[:cut])
                engine.save_checkpoint(ckpt)
            model = gpt(seed=1)  # other initial weights: the load replaces them
            with offload.wrap(model, make_opt(model.parameters()),
                              config=_rank_config(config, out_dir, rank, "resumed")) as engine:
                engine.load_checkpoint(ckpt)
                result["resumed_losses"] = train_offload(engine, mine[cut:])
                result["resumed_state"] = engine.state_dict()
                result["resumed_stats"] = engine.stats()
        if hold:
            result["held_losses"], result["held_state"], _, result["held"] = train_holding_the_first_delayed_update(
                _rank_config(config, out_dir, rank, "held"), mine, timeout=20)
        # No barrier of its own: with two groups the other group's ranks may still be in their
        # last delayed update's gathers when rank 0 is done, and close() waits for them
        # ([Note: closing with several ranks]) before rank 0 leaves and takes the store along.
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(world, config, data, out_dir, cut=None, hold=False):
    os.makedirs(out_dir, exist_ok=True)
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(_worker, args=(free_port(), world, config, data, str(out_dir), cut, hold),
                       nprocs=world, join=True, start_method="forkserver")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


CASES = [  # (stage, world, shard_group_size, (param_tier, optimizer_tier), max_grad_norm, accumulation)
    (0, 2, None, ("host", "host"), None, 1),
    (0, 2, None, ("nvme", "nvme"), CLIP_NORM, 1),
    (1, 2, None, ("host", "nvme"), CLIP_NORM, 1),
    (1, 2, None, ("nvme", "nvme"), None, 2),  # the gather in the buffer read from NVMe, to the spare extent
    (1, 4, 2, ("host", "host"), CLIP_NORM, 1),  # two groups: the gathers inside each on the worker
    (2, 2, None, ("host", "host"), CLIP_NORM, 1),
    (2, 2, None, ("host", "nvme"), None, 2),
    (2, 2, None, ("nvme", "nvme"), CLIP_NORM, 1),
    (3, 2, None, ("host", "host"), None, 1),
    (3, 2, None, ("nvme", "nvme"), CLIP_NORM, 1),
    (3, 4, 2, ("nvme", "host"), CLIP_NORM, 2),  # two groups: the shards summed across them in step()
]


@pytest.mark.parametrize("stage,world,group,tiers,max_grad_norm,accumulation", CASES)
def test_delayed_updates_on_ranks_equal_one_process_with_delayed_updates(
        stage, world, group, tiers, max_grad_norm, accumulation, tmp_path):
    config = dict(stage=stage, shard_group_size=group, param_tier=tiers[0], optimizer_tier=tiers[1],
                  max_grad_norm=max_grad_norm, gradient_accumulation_steps=accumulation,
                  delayed_update=True, delayed_update_warmup_steps=WARMUP)
    if "nvme" in tiers:
        config["swap_dir"] = str(tmp_path / "swap")
    data = _batches(STEPS * accumulation, batch=GLOBAL_BATCH)
    results = run_ranks(world, config, data, tmp_path / "ranks")
    losses, state, stats = one_process(config, data, tmp_path / "one" if "nvme" in tiers else None)
    assert stats["delayed_updates"] > 0
    for r, res in enumerate(results):
        assert res["stats"]["delayed_updates"] == stats["delayed_updates"], r
        assert res["stats"]["delayed_fallbacks"] == stats["delayed_fallbacks"], r
        assert max_rel_error(res["state"], state) < REL_TOL, r
    if max_grad_norm is not None:
        assert 0 < stats["delayed_fallbacks"] < STEPS - WARMUP, stats["delayed_fallbacks"]
    # the loss of the whole batch is the mean of the ranks' (equal parts, a mean loss)
    mean = [sum(res["losses"][k] for res in results) / world for k in range(len(data))]
    assert max(abs(a - b) / abs(b) for a, b in zip(mean, losses)) < REL_TOL
    for res in results[1:]:  # every rank holds the same weights
        for k, v in res["state"].items():
            assert torch.equal(v, results[0]["state"][k]), k


@pytest.mark.parametrize("stage,tiers", [(1, ("nvme", "nvme")), (2, ("host", "nvme")), (3, ("nvme", "nvme"))])
def test_a_checkpoint_with_delayed_updates_pending_on_ranks_resumes_bit_for_bit(stage, tiers, tmp_path):
    """Saved by 2 ranks while an update is pending (bf16: the lagging compute copy is not the
    rounded master; with every state on NVMe the master is split), loaded by 2 ranks from
    other weights: the rest of the run is the uninterrupted one's to the bit, losses and weights."""
    config = dict(stage=stage, param_tier=tiers[0], optimizer_tier=tiers[1], dtype="bf16",
                  delayed_update=True, delayed_update_warmup_steps=1)
    if "nvme" in tiers:
        config["swap_dir"] = str(tmp_path / "swap")
    data = _batches(6, batch=GLOBAL_BATCH)
    cut = 3
    results = run_ranks(2, config, data, tmp_path / "ranks", cut=cut)
    manifest = json.loads((tmp_path / "ranks" / "ckpt" / "manifest.json").read_text())
    assert any(u.get("delayed_pending") for u in manifest["units"])
    for r, res in enumerate(results):
        assert res["saver_losses"] == res["losses"][:cut], r
        assert res["resumed_losses"] == res["losses"][cut:], r
        assert res["resumed_stats"]["delayed_updates"] > 0, r
        for k, v in res["state"].items():
            assert torch.equal(v, res["resumed_state"][k]), (r, k)


@pytest.mark.parametrize("stage,world,group,tiers", [(2, 2, None, ("host", "host")), (3, 2, None, ("nvme", "nvme")),
                                                     (1, 4, 2, ("nvme", "nvme"))])
def test_the_next_forward_runs_while_a_delayed_update_on_ranks_runs(stage, world, group, tiers, tmp_path):
    """Step 1's first delayed update (the root's; at stage 2 its all-gather comes after the
    hold) is held on each rank until that rank's step-2 forward has run a block: no forward
    waits for it, and the run is the unheld one's to the bit (4 ranks in 2 groups too)."""
    config = dict(stage=stage, shard_group_size=group, param_tier=tiers[0], optimizer_tier=tiers[1],
                  delayed_update=True, delayed_update_warmup_steps=0, collective_timeout_seconds=60)
    if "nvme" in tiers:
        config["swap_dir"] = str(tmp_path / "swap")
    data = _batches(3, batch=GLOBAL_BATCH)
    results = run_ranks(world, config, data, tmp_path / "ranks", hold=True)
    for r, res in enumerate(results):
        assert res["held"] == [True], f"rank {r}: the forward waited for the delayed update"
        assert res["held_losses"] == res["losses"], r
        for k, v in res["state"].items():
            assert torch.equal(v, res["held_state"][k]), (r, k)


def test_every_stage_resolves_delayed_updates_with_spare_homes_and_no_early_updates():
    """With several ranks delayed updates take any stage and compute tier but the device's:
    a spare compute copy for every trainable unit, and no early or speculative updates."""
    for stage in (0, 1, 2, 3):
        for tier in ("host", "nvme"):
            cfg = offload.OffloadConfig(delayed_update=True, param_tier=tier, optimizer_tier="nvme", swap_dir="/tmp",
                                        max_grad_norm=1.0)
            partition = SimpleNamespace(world_size=2, stage=stage, shards_state=stage >= 1,
                                        shards_params=stage == 3, shards_gradients=stage >= 2)
            layout = Layout.resolve(cfg, torch.device("cpu"), partition)
            assert layout.delayed_update and layout.has_spare(0, True) and not layout.spare_states, (stage, tier)
            assert not layout.early_allowed and not layout.speculative, (stage, tier)


@pytest.mark.parametrize("stage,tiers", [(2, ("host", "host")), (3, ("nvme", "nvme"))])
def test_a_checkpoint_with_delayed_updates_pending_on_2_ranks_resumes_on_one_process(stage, tiers, tmp_path):
    """The lagging copy of each rank's range loads re-partitioned: one process goes on from
    the checkpoint of 2 ranks equal to their uninterrupted run (fp32, within its tolerance)."""
    config = dict(stage=stage, param_tier=tiers[0], optimizer_tier=tiers[1], delayed_update=True,
                  delayed_update_warmup_steps=1)
    if "nvme" in tiers:
        config["swap_dir"] = str(tmp_path / "swap")
    data = _batches(6, batch=GLOBAL_BATCH)
    cut = 3
    results = run_ranks(2, config, data, tmp_path / "ranks", cut=cut)
    config = {k: v for k, v in config.items() if k != "stage"}
    if "nvme" in tiers:
        os.makedirs(tmp_path / "one")
        config["swap_dir"] = str(tmp_path / "one")
    model = gpt(seed=1)
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        with pytest.warns(RuntimeWarning, match="re-partitioned"):
            engine.load_checkpoint(str(tmp_path / "ranks" / "ckpt"))
        assert any(u.delayed_pending for u in engine.units)
        losses = train_offload(engine, data[cut:])
        state = engine.state_dict()
    assert max_rel_error(state, results[0]["state"]) < REL_TOL
    mean = [sum(res["losses"][k] for res in results) / 2 for k in range(cut, len(data))]
    assert max(abs(a - b) / abs(b) for a, b in zip(mean, losses)) < REL_TOL


class _Skipping(torch.nn.Module):
    """Three blocks; with ``skip`` set, the forward leaves block 0 out (on every rank alike)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(3)])
        self.head = torch.nn.Linear(16, 1)
        self.skip = False

    def forward(self, x, y):
        h = self.emb(x)
        for i, block in enumerate(self.blocks):
            if not (self.skip and i == 0):
                h = torch.tanh(block(h))
        return ((self.head(h) - y) ** 2).mean()


SKIP_STEP = 3


def _train_skipping(config, data, rank=0, world=1):
    """_Skipping (seed 0) trained on this rank's part of ``data``, block 0 left out of step
    SKIP_STEP's forward; each delayed update of block 0 held 1.5 s on the worker, so that
    it still runs when that backward ends: (losses, state_dict)."""
    torch.manual_seed(0)
    model = _Skipping()
    losses = []

    def slow(unit, **context):
        if unit == "blocks.0":
            time.sleep(1.5)
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine, \
            offload.faults.inject("optim.deferred_update", slow):
        for k, (x, y) in enumerate(data, start=1):
            per_rank = x.shape[0] // world
            model.skip = k == SKIP_STEP
            loss = engine(x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses, engine.state_dict()


def _skipping_worker(rank, port, world, config, data, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the skipped block leaves the trace
            torch.save(_train_skipping(config, data, rank, world), os.path.join(out_dir, f"skip-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_a_unit_no_backward_reaches_waits_for_its_delayed_update_before_its_zeros_land(tmp_path):
    """Stage 2: a unit that the step's forward leaves out on every rank gets its reduce-
    scatter of zeros when backward ends (``Partition._after_backward``); its last delayed
    update, held on the worker, still reads the gradient buffer those zeros land in, so the
    landing takes the buffer back first. The run equals one process with the same skip."""
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)) for _ in range(5)]
    config = dict(stage=2, param_tier="host", optimizer_tier="host", delayed_update=True,
                  delayed_update_warmup_steps=0)
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(_skipping_worker, args=(free_port(), 2, config, data, str(tmp_path)),
                       nprocs=2, join=True, start_method="forkserver")
    results = [torch.load(tmp_path / f"skip-rank{r}.pt", weights_only=False) for r in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        losses, state = _train_skipping({k: v for k, v in config.items() if k != "stage"}, data)
    for r, (rank_losses, rank_state) in enumerate(results):
        assert max_rel_error(rank_state, state) < REL_TOL, r
    mean = [(a + b) / 2 for a, b in zip(results[0][0], results[1][0])]
    assert max(abs(a - b) / abs(b) for a, b in zip(mean, losses)) < REL_TOL


def _failing_update_worker(rank, port, config, data, out_dir):
    """Rank 1's delayed update of blocks.2 (step 1's third, after the root's and blocks.3's)
    fails; each rank records what its next training call raises, and what one after it does."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    per_rank = data[0].shape[0] // 2
    mine = [b[rank * per_rank:(rank + 1) * per_rank] for b in data]

    def fail(unit, **context):
        if rank == 1 and unit == "blocks.2":
            raise OSError(5, "injected failure of a delayed update")
    model = gpt()
    engine = offload.wrap(model, make_opt(model.parameters()), config=config)
    result = {}
    with offload.faults.inject("optim.deferred_update", fail):
        train_offload(engine, mine[:1])
        try:
            train_offload(engine, mine[1:2])
            result["next"] = "no error"
        except Exception as exc:
            result["next"] = f"{type(exc).__name__}: {exc}"
    try:
        gpt_loss(engine, mine[2])
        result["after"] = "no error"
    except Exception as exc:
        result["after"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, f"fail-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # the process group is broken; skip its teardown


def test_a_delayed_update_that_fails_on_one_rank_stops_both_naming_it(tmp_path):
    """Stage 2: rank 1's delayed update of blocks.2 fails before its all-gather, and rank 1
    runs none of that step's later updates, so rank 0's worker waits in blocks.2's gather (not
    matched with another unit's) and raises naming rank 1; both engines refuse to go on."""
    config = dict(stage=2, param_tier="host", optimizer_tier="host", delayed_update=True,
                  delayed_update_warmup_steps=0, collective_timeout_seconds=5)
    data = _batches(3, batch=GLOBAL_BATCH)
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(_failing_update_worker, args=(free_port(), config, data, str(tmp_path)),
                       nprocs=2, join=True, start_method="forkserver")
    results = [json.loads((tmp_path / f"fail-rank{r}.json").read_text()) for r in range(2)]
    assert "injected failure of a delayed update" in results[1]["next"], results[1]
    assert "rank 1" in results[0]["next"] and "parameter all-gather of unit 'blocks.2'" in results[0]["next"], \
        results[0]
    for r in range(2):
        assert results[r]["after"].startswith("EngineFailedError"), (r, results[r])
