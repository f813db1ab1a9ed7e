"""ZeRO stages 0-2 across 2 ranks (gloo, CPU) equal one process on the whole batch, hold
1/world_size of the sharded state per rank, and fail with errors that name ranks instead of
hanging (issue 8)."""
import errno
import json
import os
import re
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import offload
import offload.checkpoint.access
from offload.checkpoint import export_checkpoint
from offload.gpt import GPT, GPTConfig
from offload.units import padded_numel
from offload.zero import even_range

from support import FaultyIO, free_port, train_offload, unwrap_swap_io, wrap_swap_io

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=4)
REL_TOL = 1e-5
WORLD = 2
GLOBAL_BATCH = 4
STEPS = 10


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.seq_len + 1), generator=g)
            for _ in range(n)]


def make_opt(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)


def max_rel_error(state, ref_state):
    worst = 0.0
    for k, ref in ref_state.items():
        scale = ref.abs().max().clamp_min(1e-12)
        worst = max(worst, ((state[k].float() - ref.float()).abs().max() / scale).item())
    return worst


def reference(data, accumulation=1, max_grad_norm=None):
    """Plain PyTorch on the whole batch."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = make_opt(model.parameters())
    for i, b in enumerate(data):
        (model(b[:, :-1], b[:, 1:]) / accumulation).backward()
        if (i + 1) % accumulation == 0:
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            opt.zero_grad()
    return model.state_dict()


def single_process_stats(config):
    torch.manual_seed(0)
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        return engine.stats()


def _init(rank, port):
    torch.set_num_threads(1)  # two ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)


def _train_worker(rank, port, config, data, out_dir):
    _init(rank, port)
    try:
        if config.get("swap_dir"):
            config = dict(config, swap_dir=os.path.join(config["swap_dir"], f"rank{rank}"))
            os.makedirs(config["swap_dir"])
        torch.manual_seed(0 if rank == 0 else 123)  # wrap() must broadcast rank 0's values
        model = GPT(CFG)
        per_rank = GLOBAL_BATCH // WORLD
        losses = []
        with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
            for i, b in enumerate(data):
                mine = b[rank * per_rank:(rank + 1) * per_rank]
                loss = engine(mine[:, :-1], mine[:, 1:])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                if i == len(data) // 2:
                    host_peak_midway = engine.stats()["host_peak_bytes"]
            result = {"state": engine.state_dict(), "stats": engine.stats(),
                      "host_peak_midway": host_peak_midway,
                      "grad_norm": engine.stats()["grad_norm"], "losses": losses}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(worker, *args):
    # forkserver: fresh processes like spawn, but forked from a server that has imported
    # torch (and torch._dynamo, which torch.optim pulls in) once, not once per rank and test.
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(worker, args=(free_port(),) + args, nprocs=WORLD, join=True,
                       start_method="forkserver")


def load_results(out_dir):
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def run_stages(worker, stages, config, data, tmp_path):
    """Each stage's results on every rank: ``worker`` on 2 ranks with ``config`` and
    ``stage`` set, a swap directory of its own under tmp_path/stageS."""
    runs = {}
    for stage in stages:
        out = tmp_path / f"stage{stage}"
        swap = out / "swap"
        swap.mkdir(parents=True)
        run_ranks(worker, dict(config, stage=stage, swap_dir=str(swap)), data, str(out))
        runs[stage] = load_results(out)
    return runs


def assert_same_states(runs, a, b):
    for r in range(WORLD):
        for k, v in runs[a][r]["state"].items():
            assert torch.equal(v, runs[b][r]["state"][k]), (r, k)


CASES = [  # (stage, tier, gradient_accumulation_steps, max_grad_norm)
    (0, "host", 1, None), (0, "nvme", 2, 0.5),
    (1, "host", 1, None), (1, "nvme", 2, 0.5),
    (2, "host", 2, 0.5), (2, "nvme", 1, None),
    (3, "host", 2, 0.5), (3, "nvme", 1, None),
]


@pytest.mark.parametrize("stage,tier,accumulation,max_grad_norm", CASES)
def test_two_ranks_on_half_batches_equal_one_process_and_shard_memory(
        stage, tier, accumulation, max_grad_norm, tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    config = dict(stage=stage, param_tier=tier, optimizer_tier=tier,
                  swap_dir=str(swap) if tier == "nvme" else None,
                  gradient_accumulation_steps=accumulation, max_grad_norm=max_grad_norm)
    data = batches(STEPS * accumulation)
    run_ranks(_train_worker, config, data, str(tmp_path))
    results = load_results(tmp_path)
    ref = reference(data, accumulation, max_grad_norm)
    for r, res in enumerate(results):
        assert res["stats"]["world_size"] == WORLD and res["stats"]["rank"] == r
        assert max_rel_error(res["state"], ref) < REL_TOL, f"rank {r}"
    if max_grad_norm is not None:
        assert all(res["grad_norm"] > max_grad_norm for res in results), "clipping must be exercised"

    # Per-rank memory, from element counts: the single process holds every unit's padded
    # trainable prefix; a rank holds ceil(T / 2) padded to a page (stage >= 1).
    single = single_process_stats(dict(config, stage=0, swap_dir=str(swap)))
    model = GPT(CFG)
    trainable = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    trainable.insert(0, sum(p.numel() for p in model.parameters()) - sum(trainable))
    num_units = len(trainable)
    opt_bytes = [res["stats"]["optimizer_state_bytes"] for res in results]
    grad_bytes = [res["stats"]["gradient_bytes"] for res in results]
    assert single["gradient_bytes"] == 4 * sum(trainable)
    if stage == 0:
        assert opt_bytes == [single["optimizer_state_bytes"]] * WORLD
        assert grad_bytes == [single["gradient_bytes"]] * WORLD
        return
    for r in range(WORLD):
        # fp32 compute: the compute copy is the master, so the state is the two moments.
        expected = sum(2 * 4 * even_range(t, r, WORLD).state_numel for t in trainable)
        assert opt_bytes[r] == expected
        assert opt_bytes[r] <= single["optimizer_state_bytes"] / 2 + num_units * 2 * 4096
    # Host buffers are made once: none is added after the first steps. With early updates
    # (stage 3 here) the pool of gradient buffers fills lazily up to as many as units wait
    # for the optimizer worker at once, which depends on how far it got: at most one each.
    for res in results:
        grown = res["stats"]["host_peak_bytes"] - res["host_peak_midway"]
        if res["stats"]["early_updates"]:
            assert 0 <= grown <= res["stats"]["gradient_bytes"] + num_units * 4096, grown
        else:
            assert grown == 0, grown
    param_bytes = [res["stats"]["parameter_bytes"] for res in results]
    if stage == 3:  # fp32: each rank's compute chunks are its master shards
        assert param_bytes == [sum(4 * even_range(t, r, WORLD).state_numel for t in trainable)
                               for r in range(WORLD)]
        assert all(p <= single["parameter_bytes"] / 2 + num_units * 4096 for p in param_bytes)
    else:
        assert param_bytes == [single["parameter_bytes"]] * WORLD
    if stage == 1:
        assert all(g >= single["gradient_bytes"] for g in grad_bytes)
    else:
        assert grad_bytes == [4 * sum(even_range(t, r, WORLD).numel for t in trainable)
                              for r in range(WORLD)]
        assert sum(grad_bytes) == single["gradient_bytes"]
        assert all(g <= single["gradient_bytes"] / 2 + 4 * num_units for g in grad_bytes)
        assert all(res["stats"]["gradient_bucket_peak_bytes"] > 0 for res in results)


def reference_losses(data):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = make_opt(model.parameters())
    losses = []
    for b in data:
        loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_bf16_stage_2_equals_stage_0_bit_for_bit(tmp_path):
    """bf16 compute keeps a separate fp32 master, shard-sized with stage 2: Adam on shards,
    the gathered bf16 compute copy and the gathered masters in state_dict reproduce plain
    data parallel (stage 0) exactly, and the loss tracks fp32 like one process does."""
    data = batches(STEPS)
    runs = {}
    for stage in (0, 2):
        out = tmp_path / f"stage{stage}"
        out.mkdir()
        run_ranks(_train_worker, dict(stage=stage, dtype="bf16"), data, str(out))
        runs[stage] = load_results(out)
    for r in range(WORLD):
        for k, v in runs[0][r]["state"].items():
            assert v.dtype == torch.float32 and torch.equal(v, runs[2][r]["state"][k]), (r, k)
    global_losses = [sum(x) / WORLD for x in zip(*(res["losses"] for res in runs[2]))]
    ref = reference_losses(data)
    assert global_losses[-1] < global_losses[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(global_losses, ref)) < 0.05
    single = single_process_stats(dict(stage=0, dtype="bf16"))
    num_units = CFG.num_layers + 1
    assert runs[2][0]["stats"]["optimizer_state_bytes"] <= \
        single["optimizer_state_bytes"] / 2 + num_units * 3 * 4096


def _engine_after_one_step(rank, port, config):
    """This rank's engine over the test GPT after one step on its half batch, and that batch."""
    _init(rank, port)
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = offload.wrap(model, make_opt(model.parameters()), config=config)
    b = batches(1)[0][rank * 2:rank * 2 + 2]
    engine.backward(engine(b[:, :-1], b[:, 1:]))
    engine.step()
    return engine, b


def _failing_worker(rank, port, out_dir, stage):
    engine, b = _engine_after_one_step(rank, port, dict(stage=stage, param_tier="host",
                                                        collective_timeout_seconds=30))
    if rank == 1:
        os._exit(0)  # dies without a word; spawn must not kill rank 0 for it
    message = "no error"
    try:
        engine.backward(engine(b[:, :-1], b[:, 1:]))
        engine.step()
    except RuntimeError as exc:
        message = str(exc)
    except Exception:
        message = traceback.format_exc()
    with open(os.path.join(out_dir, "rank0.txt"), "w") as f:
        f.write(message)
    os._exit(0)  # the process group is broken; skip its teardown


@pytest.mark.parametrize("stage,first_collective", [(2, "reduce-scatter"), (3, "parameter all-gather")])
def test_a_rank_that_dies_raises_on_the_others_naming_it(stage, first_collective, tmp_path):
    run_ranks(_failing_worker, str(tmp_path), stage)
    message = (tmp_path / "rank0.txt").read_text()
    assert "rank 1" in message and "never reached" in message, message
    assert first_collective in message, message


class _FailingReads:
    """Stands in for a rank's I/O engine: every read fails with EIO."""

    class _Failed:
        def wait(self):
            raise OSError(5, "Input/output error (injected)")

        def done(self):
            return True

    def __init__(self, io):
        self.inner = io

    def read_into(self, tensor, path, offset=0):
        return self._Failed()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _swap_failure_worker(rank, port, out_dir):
    config = dict(stage=2, param_tier="nvme", optimizer_tier="nvme", collective_timeout_seconds=5,
                  swap_dir=os.path.join(out_dir, f"swap{rank}"), device_budget=170_000)  # 164.1 KiB the least at stage 2
    engine, b = _engine_after_one_step(rank, port, config)
    result = {}
    try:
        engine.backward(engine(b[:, :-1], b[:, 1:]))
        if rank == 1:  # after backward: the reads that fail are the optimizer step's
            wrap_swap_io(engine, _FailingReads)
        engine.step()
        result["step"] = "no error"
    except (OSError, RuntimeError) as exc:
        result["step"] = f"{type(exc).__name__}: {exc}"
    try:
        engine(b[:, :-1], b[:, 1:])
        result["after"] = "no error"
    except Exception as exc:
        result["after"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # the process group is broken; skip its teardown


def test_a_swap_failure_on_one_rank_stops_both_engines(tmp_path):
    """Stage 2 on NVMe: rank 1's swap reads fail in the optimizer step. Rank 1 raises the
    I/O error; rank 0, whose update then waits on rank 1 in an all-gather, raises a
    collective error naming it. Each has updated some units and not others, so both
    engines refuse to go on until a checkpoint is loaded."""
    run_ranks(_swap_failure_worker, str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert results[1]["step"].startswith("OSError") and "swap I/O failed" in results[1]["step"], results[1]
    assert results[0]["step"].startswith("RuntimeError") and "rank 1" in results[0]["step"], results[0]
    for r in range(WORLD):
        assert results[r]["after"].startswith("EngineFailedError"), (r, results[r])
        assert "resume from the last checkpoint" in results[r]["after"], (r, results[r])


def _hanging_worker(rank, port, out_dir):
    _init(rank, port)
    config = dict(stage=1, collective_timeout_seconds=2)
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = offload.wrap(model, make_opt(model.parameters()), config=config)
    b = batches(1)[0][rank * 2:rank * 2 + 2]
    message = "no error"
    try:
        if rank == 1:
            time.sleep(8)  # hangs past rank 0's timeout
        engine.backward(engine(b[:, :-1], b[:, 1:]))
        engine.step()
    except RuntimeError as exc:
        message = str(exc)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(message)
    os._exit(0)


def test_a_rank_that_hangs_times_out_on_the_others_naming_it(tmp_path):
    run_ranks(_hanging_worker, str(tmp_path))
    message = (tmp_path / "rank0.txt").read_text()
    assert "rank 1" in message and "never reached" in message, message
    assert "collective_timeout_seconds=2" in message, message


def _mismatch_worker(rank, port, out_dir):
    _init(rank, port)
    try:
        torch.manual_seed(0)
        model = GPT(CFG)
        config = dict(stage=1, max_grad_norm=1.0 if rank == 0 else 2.0)
        try:
            offload.wrap(model, make_opt(model.parameters()), config=config)
            message = "no error"
        except ValueError as exc:
            message = str(exc)
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(message)
    finally:
        dist.destroy_process_group()


def test_mismatched_configs_are_detected_at_wrap_time_on_every_rank(tmp_path):
    run_ranks(_mismatch_worker, str(tmp_path))
    for r in range(WORLD):
        message = (tmp_path / f"rank{r}.txt").read_text()
        assert "rank 1 differs from rank 0" in message and "max_grad_norm" in message, message


def test_stage_on_a_single_process_warns_and_trains_like_stage_0():
    torch.manual_seed(0)
    model = GPT(CFG)
    with pytest.warns(UserWarning, match="stage=2 is ignored"):
        engine = offload.wrap(model, make_opt(model.parameters()), config=dict(stage=2))
    with engine:
        stats = engine.stats()
        assert stats["world_size"] == 1 and stats["rank"] == 0


def test_stage_3_needs_a_home_tier_for_the_compute_copies():
    with pytest.raises(ValueError, match="stage: 3 .*param_tier='device'"):
        offload.OffloadConfig(stage=3, param_tier="device")


FROZEN = ("wpe.weight", "blocks.1.ln1.weight", "blocks.2.qkv.weight")


def _budgeted_worker(rank, port, config, data, out_dir):
    """Frozen parameters in the root unit and in blocks, and a device budget of the minimum
    plus one block: units are evicted and prefetched, and the frozen tails gathered too."""
    _init(rank, port)
    try:
        config = dict(config, swap_dir=os.path.join(config["swap_dir"], f"rank{rank}"))
        os.makedirs(config["swap_dir"])
        # Small optimizer pieces: a block's shard is updated in several (a multiple of 4096
        # elements keeps every piece on a page in fp32 and 16-bit buffers alike).
        offload.units.OPTIMIZER_PIECE_NUMEL = 4096

        def build():
            torch.manual_seed(0)
            model = GPT(CFG)
            for name, p in model.named_parameters():
                p.requires_grad_(name not in FROZEN)
            return model
        try:
            model = build()
            offload.wrap(model, make_opt(model.parameters()), config=dict(config, device_budget=4096))
            raise AssertionError("a 4 KiB device budget must be refused")
        except ValueError as exc:
            minimum = int(re.search(r"at least (\d+) bytes", str(exc)).group(1))
        block_bytes = 2 * sum(p.numel() for p in GPT(CFG).blocks[0].parameters())  # bf16
        model = build()
        per_rank = GLOBAL_BATCH // WORLD
        with offload.wrap(model, make_opt(model.parameters()),
                          config=dict(config, device_budget=minimum + block_bytes)) as engine:
            for b in data:
                mine = b[rank * per_rank:(rank + 1) * per_rank]
                engine.backward(engine(mine[:, :-1], mine[:, 1:]))
                engine.step()
            result = {"state": engine.state_dict(), "stats": engine.stats()}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_stage_3_gathers_units_within_the_budget_and_equals_stage_0_bit_for_bit(tmp_path):
    """bf16 on NVMe with frozen parameters and a tight device budget: every fetch
    all-gathers the unit's chunks (trainable prefix and frozen tail) from the ranks' swap
    files, and the optimizer updates each shard in several pieces; the weights after 4 steps
    equal plain data parallel (stage 0) exactly, and each rank's compute copies at home are
    half of stage 0's."""
    runs = run_stages(_budgeted_worker, (0, 3), dict(dtype="bf16", param_tier="nvme", optimizer_tier="nvme"),
                      batches(4), tmp_path)
    assert_same_states(runs, 0, 3)
    for r in range(WORLD):
        stats = runs[3][r]["stats"]
        assert stats["device_peak_bytes"] <= stats["device_budget_bytes"]
        assert stats["prefetch_hits"] > 0
        assert stats["parameter_bytes"] <= runs[0][r]["stats"]["parameter_bytes"] / 2 + \
            (CFG.num_layers + 1) * 2 * 4096
    torch.manual_seed(0)
    initial = GPT(CFG).state_dict()
    for name in FROZEN:  # frozen values (kept in the compute dtype) came through unchanged
        assert torch.equal(runs[3][0]["state"][name], initial[name].to(torch.bfloat16)), name


def test_shard_ranges_cover_the_prefix_once():
    for t in (0, 1, 5, 1024, 4097, 12608):
        ranges = [even_range(t, r, 3) for r in range(3)]
        assert sum(s.numel for s in ranges) == t
        assert all(s.state_numel % 1024 == 0 and s.state_numel >= s.numel for s in ranges)
        assert [s.lo for s in ranges[1:]] == [s.hi for s in ranges[:-1]]


def test_bf16_stage_1_on_nvme_equals_stage_0_bit_for_bit(tmp_path):
    """The shard path with states on NVMe: the shard's master, split ([Note: split master]:
    its low halves at home, the high ones the shard's part of the bf16 compute copy), and
    moments read and written whole, the compute copy gathered and written back. Each rank
    keeps 2 B of master per element of its shard, padded to a page, and 8 B of moments."""
    runs = run_stages(_train_worker, (0, 1), dict(dtype="bf16", param_tier="nvme", optimizer_tier="nvme"),
                      batches(4), tmp_path)
    assert_same_states(runs, 0, 1)
    model = GPT(CFG)
    trainable = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    trainable.insert(0, sum(p.numel() for p in model.parameters()) - sum(trainable))
    for r in range(WORLD):
        shards = [even_range(t, r, WORLD) for t in trainable]
        expected = sum(2 * padded_numel(s.numel, 2) + 2 * 4 * s.state_numel for s in shards)
        assert runs[1][r]["stats"]["optimizer_state_bytes"] == expected


def _checkpoint_worker(rank, port, config, data, out_dir, phase):
    """phase "save": 3 steps, save, 2 more steps; "resume": load, the same 2 steps.
    config["chunk"]: the checkpoint's pieces ([Note: bounded checkpoint memory]), or None."""
    _init(rank, port)
    config = dict(config)
    chunk = config.pop("chunk", None)
    if chunk is not None:
        offload.checkpoint.access.CHUNK_NUMEL = chunk
    try:
        if config.get("swap_dir"):
            config = dict(config, swap_dir=os.path.join(config["swap_dir"], f"{phase}-rank{rank}"))
            os.makedirs(config["swap_dir"])
        torch.manual_seed(0 if rank == 0 else 123)
        model = GPT(CFG)
        per_rank = GLOBAL_BATCH // WORLD
        result = {}

        def train(batches_):
            for b in batches_:
                mine = b[rank * per_rank:(rank + 1) * per_rank]
                engine.backward(engine(mine[:, :-1], mine[:, 1:]))
                engine.step()
        with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
            ckpt = os.path.join(out_dir, "ckpt")
            if phase == "save":
                train(data[:3])
                engine.save_checkpoint(ckpt)
                result["saved"] = engine.state_dict()
            else:
                engine.load_checkpoint(os.path.join(out_dir, phase.split(":")[1]))
                result["loaded"] = engine.state_dict()
            train(data[3:])
            result["final"] = engine.state_dict()
        torch.save(result, os.path.join(out_dir, f"{phase.replace(':', '-')}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stage,tier,dtype,chunk", [(0, "host", "fp32", None), (2, "nvme", "bf16", None),
                                                   (3, "nvme", "fp32", None), (2, "nvme", "bf16", 1000),
                                                   (3, "nvme", "bf16", 1000)])
def test_sharded_checkpoint_resumes_exactly_and_repartitions(stage, tier, dtype, chunk, tmp_path, monkeypatch):
    """Each rank writes its part; 2 ranks resume bit-exactly; one process loads the same
    consolidated weights (and export gives them too); that process's checkpoint loads back
    into 2 ranks at stage 3. ``chunk``: saved and loaded in pieces of 1000 elements, which
    cut the shards off their pages ([Note: bounded checkpoint memory])."""
    swap = tmp_path / "swap"
    swap.mkdir()
    if chunk is not None:
        monkeypatch.setattr(offload.checkpoint.access, "CHUNK_NUMEL", chunk)
    config = dict(stage=stage, param_tier=tier, optimizer_tier=tier, dtype=dtype,
                  swap_dir=str(swap) if tier == "nvme" else None, chunk=chunk)
    data = batches(5)
    run_ranks(_checkpoint_worker, config, data, str(tmp_path), "save")
    run_ranks(_checkpoint_worker, config, data, str(tmp_path), "resume:ckpt")
    saved = [torch.load(tmp_path / f"save-rank{r}.pt", weights_only=False) for r in range(WORLD)]
    resumed = [torch.load(tmp_path / f"resume-ckpt-rank{r}.pt", weights_only=False) for r in range(WORLD)]
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["world_size"] == WORLD
    if stage >= 1:  # both ranks wrote unit files
        assert {f.split("-rank-")[1] for f in manifest["files"] if f.startswith("unit-")} == \
            {"00000.bin", "00001.bin"}
    if chunk is not None:  # the blocks' weights (3072 elements) were cut on each rank
        assert max(len(e["pieces"]) for u in manifest["units"] for e in u["entries"]) > WORLD
    for r in range(WORLD):
        for key, value in saved[r]["saved"].items():
            assert torch.equal(resumed[r]["loaded"][key], value), (r, key)
        for key, value in saved[r]["final"].items():
            assert torch.equal(resumed[r]["final"][key], value), (r, key)

    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "weights.pt"))
    exported = torch.load(tmp_path / "weights.pt")
    torch.manual_seed(5)
    model = GPT(CFG)
    single = dict(config, stage=0, swap_dir=str(swap / "single") if tier == "nvme" else None)
    del single["chunk"]
    with pytest.warns(RuntimeWarning, match="written by 2 rank"):
        with offload.wrap(model, make_opt(model.parameters()), config=single) as engine:
            engine.load_checkpoint(str(tmp_path / "ckpt"))
            loaded = engine.state_dict()
            engine.save_checkpoint(str(tmp_path / "single"))
    for key, value in saved[0]["saved"].items():
        assert torch.equal(loaded[key], value), key
        assert torch.equal(exported[key], value), key

    back = dict(config, stage=3, param_tier="nvme", optimizer_tier="nvme", swap_dir=str(swap))
    run_ranks(_checkpoint_worker, back, data, str(tmp_path), "resume:single")  # warns in the ranks
    for r in range(WORLD):
        again = torch.load(tmp_path / f"resume-single-rank{r}.pt", weights_only=False)
        for key, value in saved[0]["saved"].items():
            assert torch.equal(again["loaded"][key], value), (r, key)


def _refused_save_worker(rank, port, out_dir):
    _init(rank, port)
    try:
        torch.manual_seed(0)
        model = GPT(CFG)
        with offload.wrap(model, make_opt(model.parameters()), config=dict(stage=1)) as engine:
            try:
                engine.save_checkpoint(os.path.join(out_dir, "not-a-dir"))
                message = "no error"
            except ValueError as exc:
                message = str(exc)
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(message)
    finally:
        dist.destroy_process_group()


def test_a_save_refused_on_rank_0_is_refused_on_every_rank(tmp_path):
    (tmp_path / "not-a-dir").write_text("a file")
    run_ranks(_refused_save_worker, str(tmp_path))
    assert "not a directory" in (tmp_path / "rank0.txt").read_text()
    message = (tmp_path / "rank1.txt").read_text()
    assert "rank 0 failed" in message and "not a directory" in message, message
    assert (tmp_path / "not-a-dir").read_text() == "a file"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _held_copies_worker(rank, port, out_dir):
    config = dict(stage=0, param_tier="nvme", optimizer_tier="nvme",
                  swap_dir=os.path.join(out_dir, f"swap{rank}"))
    engine, b = _engine_after_one_step(rank, port, config)
    try:
        result = {"step": "no error"}
        engine.backward(engine(b[:, :-1], b[:, 1:]))
        if rank == 0:  # the rank that writes the checkpoint at stage 0
            wrap_swap_io(engine, FaultyIO, errno.ENOSPC, fail_write=1)
        try:
            engine.step()
            engine.zero_grad()  # a deferred step's errors come from here
        except OSError as exc:
            result["step"] = str(exc)
        if rank == 0:
            unwrap_swap_io(engine)
        engine.save_checkpoint(os.path.join(out_dir, "ckpt"))
        result["state"] = engine.state_dict()
        engine.close()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_stage_0_saves_the_copies_held_after_a_failed_swap_write(tmp_path):
    """Stage 0 on NVMe: a swap write of rank 0 (which writes the checkpoint) fails in the
    optimizer step; the updated states it holds in host RAM are what the checkpoint gets,
    the same weights as rank 1's."""
    run_ranks(_held_copies_worker, str(tmp_path))
    results = load_results(str(tmp_path))
    assert "save_checkpoint" in results[0]["step"] and results[1]["step"] == "no error", results[0]["step"]
    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "weights.pt"))
    exported = torch.load(tmp_path / "weights.pt")
    for key, value in results[1]["state"].items():
        assert torch.equal(results[0]["state"][key], value), key
        assert torch.equal(exported[key], value), key


def _bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.BatchNorm1d(16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _buffers_worker(rank, port, out_dir):
    _init(rank, port)
    try:
        g = torch.Generator().manual_seed(7)
        data = [torch.randn(8, 8, generator=g) * (1 + i) for i in range(5)]
        mine = [x[rank * 4:(rank + 1) * 4] for x in data]
        ddp_model = _bn_model()
        ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
        opt = make_opt(ddp.parameters())
        for x in mine:
            ddp(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        model = _bn_model()
        with offload.wrap(model, make_opt(model.parameters()), config=dict(stage=2)) as engine:
            for x in mine:
                engine.backward(engine(x).pow(2).mean())
                engine.step()
            state = engine.state_dict()
        torch.save({"ddp": ddp_model.state_dict(), "offload": state}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_buffers_follow_rank_0_before_each_forward_like_ddp(tmp_path):
    """BatchNorm running statistics: each forward starts from rank 0's, as DDP's
    broadcast_buffers does, so every rank ends where DDP's same rank ends."""
    run_ranks(_buffers_worker, str(tmp_path))
    results = load_results(tmp_path)
    for r, res in enumerate(results):
        assert set(res["offload"]) == set(res["ddp"])
        assert max_rel_error(res["offload"], res["ddp"]) < REL_TOL, r
    # the last forward ran on different batches: the ranks' statistics differ, as with DDP
    assert not torch.equal(results[0]["offload"]["1.running_mean"], results[1]["offload"]["1.running_mean"])


def test_one_swap_dir_serves_the_ranks_of_a_node(tmp_path):
    """Issue 38, per-node resources: the config as the README's torchrun example writes it,
    one swap_dir for every rank, trains (it stopped every rank with "in use by another
    run"); each rank's swap space is its rank-<RANK> subdirectory, and the run equals the
    one with a directory per rank."""
    data = batches(3)
    config = dict(param_tier="nvme", optimizer_tier="nvme", stage=2)
    shared, separate = tmp_path / "shared", tmp_path / "separate"
    shared.mkdir()
    separate.mkdir()
    run_ranks(_shared_swap_worker, dict(config, swap_dir=str(tmp_path / "swap")), data, str(shared))
    run_ranks(_train_worker, dict(config, swap_dir=str(tmp_path / "per-rank")), data, str(separate))
    a, b = load_results(str(shared)), load_results(str(separate))
    for rank in range(WORLD):
        assert a[rank]["losses"] == b[rank]["losses"]
        assert a[rank]["swap_dirs"] == [f"rank-{rank}"]
    assert sorted(os.listdir(tmp_path / "swap")) == [f"rank-{r}" for r in range(WORLD)]


def _shared_swap_worker(rank, port, config, data, out_dir):
    _init(rank, port)
    try:
        torch.manual_seed(0)
        model = GPT(CFG)
        per_rank = GLOBAL_BATCH // WORLD
        with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
            swap_dirs = sorted(os.listdir(config["swap_dir"]))
            losses = train_offload(engine, [b[rank * per_rank:(rank + 1) * per_rank] for b in data])
        dist.barrier()
        torch.save({"losses": losses, "swap_dirs": [d for d in swap_dirs if d == f"rank-{rank}"]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_the_default_host_budget_is_a_share_of_the_node():
    """Issue 38: without host_budget each of the node's LOCAL_WORLD_SIZE ranks plans for its
    share of three quarters of the available memory, not for all of it."""
    from offload.config import local_world_size
    from offload.memory.layout import host_budget_share

    assert host_budget_share(8 << 30, 1) == 6 << 30
    assert host_budget_share(8 << 30, 4) == (6 << 30) // 4
    assert local_world_size({"LOCAL_WORLD_SIZE": "8"}) == 8 and local_world_size({}) == 1


def _save_pretrained_worker(rank, port, stage, data, out_dir):
    _init(rank, port)
    try:
        torch.manual_seed(0)
        model = GPT(CFG)
        per_rank = GLOBAL_BATCH // WORLD
        with offload.wrap(model, make_opt(model.parameters()), config=dict(stage=stage)) as engine:
            for b in data:
                mine = b[rank * per_rank:(rank + 1) * per_rank]
                engine.backward(engine(mine[:, :-1], mine[:, 1:]))
                engine.step()
            # a directory per rank: the one of rank 1 must not appear
            engine.save_pretrained(os.path.join(out_dir, f"saved-by-rank{rank}"))
            torch.save(engine.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stage", [1, 3])
def test_save_pretrained_reads_on_every_rank_and_writes_on_rank_0(stage, tmp_path):
    """[Note: save_pretrained with several ranks]: every rank reads (at stage >= 1 reading
    gathers shards: a rank that skipped it would leave the other waiting), rank 0 writes."""
    from safetensors.torch import load_file
    run_ranks(_save_pretrained_worker, stage, batches(3), str(tmp_path))
    assert not (tmp_path / "saved-by-rank1").exists()
    saved = load_file(str(tmp_path / "saved-by-rank0" / "model.safetensors"))
    state = torch.load(tmp_path / "rank0.pt")
    assert saved.keys() <= state.keys() and all(torch.equal(saved[k], state[k]) for k in saved)
