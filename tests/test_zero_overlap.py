"""[Note: early updates across ranks] Issue 38, the optimizer overlapped with backward with
several ranks: at stage 3 (and at stage 2 with host compute copies, its all-gather left to
step()) a unit's shard update starts on the optimizer worker once its reduce-scatter of the
last micro-step is done, while backward goes on. Each run equals one
process on the whole batch, equals bit for bit the same ranks with every update in step()
(prefetch=False: no early updates), and counts early updates on every rank. Under clipping
they are speculative ([Note: speculative updates]): committed or redone alike on every rank."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import offload
from offload.gpt import GPT

from support import CFG, REL_TOL, free_port, make_opt, max_rel_error, train_offload
from support import batches as _batches

GLOBAL_BATCH = 4
STEPS = 4


def gpt(frozen=(), seed=0):
    """The test GPT (``seed``), parameters whose names contain one of ``frozen`` frozen."""
    torch.manual_seed(seed)
    model = GPT(CFG)
    for name, p in model.named_parameters():
        p.requires_grad_(not any(f in name for f in frozen))
    return model


def reference(data, accumulation=1, max_grad_norm=None, frozen=()):
    """Plain PyTorch on the whole batch."""
    model = gpt(frozen)
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    for i, b in enumerate(data):
        (model(b[:, :-1], b[:, 1:]) / accumulation).backward()
        if (i + 1) % accumulation == 0:
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            opt.zero_grad()
    return model.state_dict()


def _worker(rank, port, world, config, data, out_dir, frozen, zero_grad_at=None, read_at=None):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        if config.get("swap_dir"):
            config = dict(config, swap_dir=os.path.join(config["swap_dir"], f"rank{rank}"))
            os.makedirs(config["swap_dir"])
        model = gpt(frozen)
        per_rank = data[0].shape[0] // world
        norms = []
        accumulation = config.get("gradient_accumulation_steps", 1)
        with offload.wrap(model, make_opt([p for p in model.parameters() if p.requires_grad]),
                          config=config) as engine:
            probes, refusals = [], []
            for i, b in enumerate(data):
                mine = b[rank * per_rank:(rank + 1) * per_rank]
                if i == read_at:  # state_dict() between backward and step: refused alike on every rank
                    prefetcher = engine.debug.prefetcher
                    prefetcher.enabled = rank != 0  # early updates on rank 1 only ([Note: early updates])
                    engine.backward(engine(mine[:, :-1], mine[:, 1:]))
                    prefetcher.enabled = True
                    engine.debug.updates.wait_optimizer()
                    try:
                        engine.state_dict()
                    except RuntimeError as exc:
                        refusals.append(str(exc))
                    engine.step()
                    continue
                if i == zero_grad_at:  # zero_grad() in place of the step; then the same batch on every rank
                    engine.backward(engine(mine[:, :-1], mine[:, 1:]))
                    engine.zero_grad()
                    with torch.no_grad():
                        probes.append(engine(b[:, :-1], b[:, 1:]).item())
                    continue
                train_offload(engine, [mine])
                if (i + 1) % accumulation == 0:
                    norms.append(engine.stats()["grad_norm"])
            result = {"state": engine.state_dict(), "stats": engine.stats(), "norms": norms, "probes": probes,
                      "refusals": refusals}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(world, config, data, out_dir, frozen=(), zero_grad_at=None, read_at=None):
    """``world`` gloo ranks training ``config`` on their parts of ``data``: each rank's result."""
    os.makedirs(out_dir, exist_ok=True)
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(_worker, args=(free_port(), world, config, data, str(out_dir), frozen, zero_grad_at,
                                                   read_at),
                       nprocs=world, join=True, start_method="forkserver")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def run_both(world, config, data, tmp_path, frozen=()):
    """The run with early updates and its serialized twin (prefetch=False: every update in step())."""
    runs = []
    for name, prefetch in (("early", True), ("serialized", False)):
        run_config = dict(config, prefetch=prefetch)
        if "nvme" in (config.get("param_tier"), config.get("optimizer_tier")):
            swap = tmp_path / name / "swap"
            swap.mkdir(parents=True)
            run_config["swap_dir"] = str(swap)
        runs.append(run_ranks(world, run_config, data, tmp_path / name, frozen))
    return runs


def assert_same_states(a, b):
    for r, (x, y) in enumerate(zip(a, b)):
        for k, v in x["state"].items():
            assert torch.equal(v, y["state"][k]), (r, k)


CASES = [  # (stage, world, shard_group_size, (param_tier, optimizer_tier), dtype, gradient_accumulation_steps)
    (3, 2, None, ("host", "host"), "fp32", 1),
    (3, 2, None, ("nvme", "nvme"), "bf16", 2),
    (3, 4, 2, ("host", "host"), "fp32", 2),  # two groups: the shard's sum across them in backward
    (2, 2, None, ("host", "host"), "fp32", 2),
    (2, 2, None, ("host", "nvme"), "bf16", 1),
]


@pytest.mark.parametrize("stage,world,group,tiers,dtype,accumulation", CASES)
def test_early_updates_overlap_backward_and_equal_the_serialized_step(
        stage, world, group, tiers, dtype, accumulation, tmp_path):
    config = dict(stage=stage, param_tier=tiers[0], optimizer_tier=tiers[1], dtype=dtype, shard_group_size=group,
                  gradient_accumulation_steps=accumulation)
    data = _batches(STEPS * accumulation, batch=GLOBAL_BATCH)
    early, serialized = run_both(world, config, data, tmp_path)
    for r in range(world):
        assert early[r]["stats"]["early_updates"] > 0, f"rank {r}: no unit was updated during backward"
        assert serialized[r]["stats"]["early_updates"] == 0, f"rank {r}"
        assert early[r]["norms"] == serialized[r]["norms"], f"rank {r}"
    assert_same_states(early, serialized)
    if dtype == "fp32":
        ref = reference(data, accumulation)
        for r, res in enumerate(early):
            assert max_rel_error(res["state"], ref) < REL_TOL, f"rank {r}"


def test_stage_1_and_stage_2_with_compute_copies_on_nvme_keep_every_update_in_step(tmp_path):
    """Stage 1 reduces the gradients in step(), and at stage 2 with the compute copies on
    NVMe the owed all-gather would have to read and write them again: no early updates
    there, and the run still equals one process."""
    data = _batches(STEPS, batch=GLOBAL_BATCH)
    for stage, tier in ((1, "host"), (2, "nvme")):
        swap = tmp_path / f"stage{stage}" / "swap"
        swap.mkdir(parents=True)
        results = run_ranks(2, dict(stage=stage, param_tier=tier, optimizer_tier=tier, swap_dir=str(swap)), data,
                            tmp_path / f"stage{stage}")
        ref = reference(data)
        for r, res in enumerate(results):
            assert res["stats"]["early_updates"] == 0, (stage, r)
            assert max_rel_error(res["state"], ref) < REL_TOL, (stage, r)


CLIP_NORM = 5.0  # the test batches' norms fall from about 8 to 3: the first steps clip, the later ones not
CLIP_CASES = [  # (stage, world, shard_group_size, (param_tier, optimizer_tier), dtype, accumulation, frozen)
    (3, 2, None, ("host", "host"), "fp32", 1, (".ln",)),  # a frozen tail in each block: the spare homes hold it too
    (3, 2, None, ("nvme", "nvme"), "bf16", 2, ()),
    (3, 4, 2, ("nvme", "nvme"), "fp32", 1, ()),
    (2, 2, None, ("host", "host"), "fp32", 1, (".ln",)),
    (2, 4, 2, ("host", "nvme"), "bf16", 2, ()),
]


@pytest.mark.parametrize("stage,world,group,tiers,dtype,accumulation,frozen", CLIP_CASES)
def test_speculative_updates_under_clipping_equal_the_serialized_step(
        stage, world, group, tiers, dtype, accumulation, frozen, tmp_path):
    """[Note: speculative updates] with several ranks: every rank takes the same commit or
    redo decision (the norm is all-reduced), committed on the steps that do not clip and
    redone on those that do, bit for bit the serialized step either way."""
    config = dict(stage=stage, param_tier=tiers[0], optimizer_tier=tiers[1], dtype=dtype, shard_group_size=group,
                  gradient_accumulation_steps=accumulation, max_grad_norm=CLIP_NORM, speculative_updates=True)
    data = _batches(8 * accumulation, batch=GLOBAL_BATCH)
    early, serialized = run_both(world, config, data, tmp_path, frozen)
    norms = early[0]["norms"]
    assert any(n > CLIP_NORM for n in norms) and any(n < CLIP_NORM for n in norms), norms
    for r in range(world):
        stats = early[r]["stats"]
        assert stats["redone_updates"] > 0, f"rank {r}: no speculation was redone after clipping"
        assert stats["speculative_updates"] > stats["redone_updates"], f"rank {r}: none was committed"
        assert serialized[r]["stats"]["speculative_updates"] == 0, f"rank {r}"
        assert early[r]["norms"] == serialized[r]["norms"] == norms, f"rank {r}"
    assert_same_states(early, serialized)
    if dtype == "fp32":
        ref = reference(data, accumulation, CLIP_NORM, frozen)
        for r, res in enumerate(early):
            assert max_rel_error(res["state"], ref) < REL_TOL, f"rank {r}"


def test_a_zero_grad_in_place_of_the_step_after_early_updates_keeps_the_ranks_alike(tmp_path):
    """Stage 2: units updated early owe their all-gathers to the step; a zero_grad() that
    comes instead (the units updated early keep their update, as with one process) runs
    them, so every rank's compute copies agree: a forward of one batch gives one loss on
    every rank, and training goes on alike."""
    data = _batches(4, batch=GLOBAL_BATCH)
    results = run_ranks(2, dict(stage=2, param_tier="host", optimizer_tier="host"), data, tmp_path, zero_grad_at=2)
    assert all(res["stats"]["early_updates"] > 0 for res in results)
    assert results[0]["probes"] == results[1]["probes"]
    for k, v in results[0]["state"].items():
        assert torch.equal(v, results[1]["state"][k]), k


def test_a_read_between_backward_and_step_is_refused_on_every_rank_when_one_updated_early(tmp_path):
    """state_dict() between backward and step() mixes two steps where units were updated
    early; every rank refuses it when any rank did (here rank 1 alone), instead of the
    others waiting in its gathers, and the run goes on equal to one process."""
    data = _batches(3, batch=GLOBAL_BATCH)
    results = run_ranks(2, dict(stage=2, param_tier="host", optimizer_tier="host", collective_timeout_seconds=60),
                        data, tmp_path, read_at=1)
    assert results[0]["refusals"] and results[1]["refusals"], [res["refusals"] for res in results]
    assert all("between backward() and step()" in res["refusals"][0] for res in results)
    ref = reference(data)
    for r, res in enumerate(results):
        assert max_rel_error(res["state"], ref) < REL_TOL, r


def _resume_worker(rank, port, world, config, data, out_dir, frozen, resume):
    """Train on ``data`` with a checkpoint after half of it; ``resume``: a model of other
    values (frozen ones too) loads that checkpoint and trains the second half."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = gpt(frozen, seed=7 if resume else 0)
        per_rank = data[0].shape[0] // world
        half = len(data) // 2
        ckpt = os.path.join(out_dir, "ckpt")
        with offload.wrap(model, make_opt([p for p in model.parameters() if p.requires_grad]),
                          config=config) as engine:
            if resume:
                engine.load_checkpoint(ckpt)
            else:
                train_offload(engine, [b[rank * per_rank:(rank + 1) * per_rank] for b in data[:half]])
                engine.save_checkpoint(ckpt)
            train_offload(engine, [b[rank * per_rank:(rank + 1) * per_rank] for b in data[half:]])
            result = {"state": engine.state_dict(), "stats": engine.stats()}
        torch.save(result, os.path.join(out_dir, f"{'resumed' if resume else 'saved'}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_a_checkpoint_resumes_stage_3_speculation_exactly_with_frozen_parameters(tmp_path):
    """The spare homes' frozen chunk, which no update writes, is loaded with the homes: the
    resumed run (from a model of other values, frozen ones too: random, not LayerNorm's
    ones) commits speculative updates and equals the uninterrupted one bit for bit."""
    config = dict(stage=3, param_tier="host", optimizer_tier="host", max_grad_norm=CLIP_NORM,
                  speculative_updates=True)
    data = _batches(8, batch=GLOBAL_BATCH)
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    for resume in (False, True):
        mp.start_processes(_resume_worker, args=(free_port(), 2, config, data, str(tmp_path), (".proj.",), resume),
                           nprocs=2, join=True, start_method="forkserver")
    for r in range(2):
        saved = torch.load(tmp_path / f"saved-rank{r}.pt", weights_only=False)
        resumed = torch.load(tmp_path / f"resumed-rank{r}.pt", weights_only=False)
        assert resumed["stats"]["speculative_updates"] > resumed["stats"]["redone_updates"], r  # some committed
        for k, v in saved["state"].items():
            assert torch.equal(v, resumed["state"][k]), (r, k)


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_overflow_drops_speculative_updates_alike_on_every_rank(stage, tmp_path):
    """fp16 loss scaling: a step whose gradients overflow is skipped on every rank (the norm
    is all-reduced) and its speculative updates dropped; the run equals the serialized one
    bit for bit."""
    config = dict(stage=stage, param_tier="host", optimizer_tier="host", dtype="fp16", speculative_updates=True,
                  initial_loss_scale=2.0 ** 17)
    data = _batches(6, batch=GLOBAL_BATCH)
    early, serialized = run_both(2, config, data, tmp_path)
    for r in range(2):
        stats = early[r]["stats"]
        assert 0 < stats["skipped_steps"] < len(data), stats["skipped_steps"]
        assert stats["skipped_steps"] == serialized[r]["stats"]["skipped_steps"]
        assert stats["speculative_updates"] > stats["redone_updates"], r  # some committed
        assert early[r]["norms"] == serialized[r]["norms"], r
    assert_same_states(early, serialized)
