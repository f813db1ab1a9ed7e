"""Compact optimizer states with several ranks at ZeRO stage 0 (gloo, CPU): each rank holds
whole compact states and steps them with the gradients averaged across ranks, as DDP with
an offloaded optimizer would ([Note: compact optimizer states])."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import offload
from offload.gpt import GPT
from offload.optim import compact as offload_compact
from offload.optim.compact import CompactRange

from support import CFG, batches, free_port, make_opt, train_offload

WORLD = 2
COMPACT = dict(device="cpu", dtype="bf16", optimizer_states="compact", stage=0)


def _compact_states(engine):
    """Every trainable parameter's (master, exp_avg, exp_avg_sq) decoded, and its high part."""
    out = {}
    for u in engine.units if engine.layout.compact_states else ():
        compact = engine.debug.homes.read_compact(u)
        for k in range(len(u.trainable)):
            out[(u.index, k)] = compact.exact(k) + (compact.param(k).high.clone(),)
    return out


def _worker(rank, port, config, data, out_dir, record, resume_at):
    """Rank ``rank`` trains the seed-0 GPT on its half of every batch of ``data``. ``record``:
    every compact step's gradient and hyperparameters, by (unit, parameter) (host homes, no
    speculation: the steps run on the units' own CompactUnits). ``resume_at``: also save a
    checkpoint after that many batches and train the rest again from it in a fresh engine."""
    torch.set_num_threads(1)  # two ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        config = dict(config, swap_dir=os.path.join(config["swap_dir"], f"rank{rank}"))
        per_rank = data[0].shape[0] // WORLD
        mine = [b[rank * per_rank:(rank + 1) * per_rank] for b in data]
        seen, real_step = [], offload_compact.compact_adam_step

        def recording_step(states, grad, **kw):
            seen.append((states.high.data_ptr(), grad.clone(), kw))
            real_step(states, grad, **kw)
        if record:
            offload_compact.compact_adam_step = recording_step
        torch.manual_seed(0 if rank == 0 else 123)  # wrap() broadcasts rank 0's values
        model = GPT(CFG)
        names = {id(p): n for n, p in model.named_parameters()}
        with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
            named, key_of = {}, {}  # (unit, parameter) -> its name; its high part's address -> (unit, parameter)
            for u in engine.units:
                for k, e in enumerate(u.trainable):
                    named[(u.index, k)] = names[id(e.param)]
                    if record:
                        key_of[u.compact.param(k).high.data_ptr()] = (u.index, k)
            losses = train_offload(engine, mine[:resume_at] if resume_at else mine)
            if resume_at:
                engine.save_checkpoint(os.path.join(out_dir, "ckpt"))
                losses += train_offload(engine, mine[resume_at:])
            result = {"losses": losses, "state": engine.state_dict(), "states": _compact_states(engine),
                      "stats": engine.stats(), "names": named,
                      "seen": [(key_of[ptr], grad, kw) for ptr, grad, kw in seen]}
        if resume_at:
            torch.manual_seed(7)
            model = GPT(CFG)
            with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
                engine.load_checkpoint(os.path.join(out_dir, "ckpt"))
                result["resumed_losses"] = train_offload(engine, mine[resume_at:])
                result["resumed_state"] = engine.state_dict()
                result["resumed_states"] = _compact_states(engine)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(config, data, out_dir, record=False, resume_at=0):
    """Each rank's result of ``_worker``."""
    (out_dir / "swap").mkdir(parents=True)
    config = dict(config, swap_dir=str(out_dir / "swap"))
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(_worker, args=(free_port(), config, data, str(out_dir), record, resume_at), nprocs=WORLD,
                       join=True, start_method="forkserver")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def one_process(config, data):
    torch.manual_seed(0)
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        return {"losses": train_offload(engine, data), "state": engine.state_dict(), "stats": engine.stats()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, tuple):
            assert all(torch.equal(p, q) for p, q in zip(x, y)), key
        else:
            assert torch.equal(x, y), key


def test_two_ranks_at_stage_0_step_whole_compact_states_with_the_averaged_gradients(tmp_path):
    """Each of 2 ranks holds the whole compact states (the bytes one process holds) and
    steps them with the gradients averaged across ranks: its masters, codes and high parts
    are the compact rule driven by hand from the initial weights over those gradients, bit
    for bit, and the two ranks' are the same bits. Against one process on the whole batch
    (other roundings of the same gradients' sums) the losses and weights agree as closely
    as the exact states' do."""
    data = batches(8, batch=4)
    runs = run_ranks(dict(COMPACT, param_tier="host", optimizer_tier="host"), data, tmp_path / "ranks", record=True)
    torch.manual_seed(0)
    initial = {n: p.detach().clone() for n, p in GPT(CFG).named_parameters()}
    for run in runs:
        assert_same(run["states"], runs[0]["states"])
        assert_same(run["state"], runs[0]["state"])
        assert len(run["seen"]) == len(data) * len(run["names"])
        for (key, grad, kw), (key0, grad0, kw0) in zip(run["seen"], runs[0]["seen"]):
            assert key == key0 and torch.equal(grad, grad0) and kw == kw0
        by_hand = {key: CompactRange.from_exact(initial[name].reshape(-1).float(), torch.zeros(initial[name].numel()),
                                                torch.zeros(initial[name].numel()))
                   for key, name in run["names"].items()}
        for key, grad, kw in run["seen"]:
            offload_compact.compact_adam_step(by_hand[key], grad, **kw)
        for key, (master, exp_avg, exp_avg_sq, high) in run["states"].items():
            mine = by_hand[key]
            assert torch.equal(master, mine.master()) and torch.equal(high, mine.high), run["names"][key]
            assert torch.equal(exp_avg, mine.moments()[0]) and torch.equal(exp_avg_sq, mine.moments()[1])
    one = one_process(dict(COMPACT, param_tier="host", optimizer_tier="host"), data)
    assert runs[0]["stats"]["optimizer_state_bytes"] == one["stats"]["optimizer_state_bytes"]
    # The ranks sum each half batch's gradients, one process the whole batch's (on more
    # threads): other roundings of the same sums (test_two_ranks_given_the_same_batches_...
    # shows stage 0 adds none of its own). With exact states the same comparison gives 1.2e-3 and
    # 0.067 here (2 ranks' mean loss against one process's; a parameter's largest
    # difference against its largest value); compact ones 7.6e-4 and 0.077.
    losses = [sum(pair) / WORLD for pair in zip(*(run["losses"] for run in runs))]
    assert max(abs(a - b) / b for a, b in zip(losses, one["losses"])) < 2e-3
    for name, want in one["state"].items():
        assert (runs[0]["state"][name] - want).abs().max() <= 0.1 * want.abs().max(), name
    assert losses[-1] < losses[0]


def test_two_ranks_with_compact_states_on_nvme_and_clipping_equal_the_host_run_and_resume_bit_for_bit(tmp_path):
    """Placement never changes the numbers with ranks either: compact homes and compute copies
    on NVMe, clipped (the global gradient norm), give the host run's bits on both ranks; a
    checkpoint saved midway (rank 0 writes the whole states) resumes bit for bit."""
    data = batches(6, batch=4)
    clipped = dict(COMPACT, max_grad_norm=0.5)
    host = run_ranks(dict(clipped, param_tier="host", optimizer_tier="host"), data, tmp_path / "host")
    nvme = run_ranks(dict(clipped, param_tier="nvme", optimizer_tier="nvme"), data, tmp_path / "nvme", resume_at=3)
    for run, on_host in zip(nvme, host):  # each rank its own half of the batches
        assert run["losses"] == on_host["losses"]
        assert_same(run["states"], host[0]["states"])
        assert_same(run["state"], host[0]["state"])
        assert run["resumed_losses"] == run["losses"][3:]
        assert_same(run["resumed_states"], run["states"])
        assert_same(run["resumed_state"], run["state"])
    assert nvme[0]["stats"]["nvme_bytes"] > 0


def test_two_ranks_given_the_same_batches_equal_one_process_bit_for_bit(tmp_path):
    """With the same batch on both ranks the averaged gradient is each rank's own, so stage
    0 adds no arithmetic of its own: the compact states, weights and losses are one
    process's on that batch, bit for bit, host and NVMe homes, clipped. (Both with torch on
    one thread, as the ranks run: a CPU kernel's reductions, a LayerNorm bias's gradient
    among them, round by its thread count.)"""
    halves = batches(4, batch=2)
    data = [torch.cat([b, b]) for b in halves]  # each rank's half is the same batch
    threads = torch.get_num_threads()
    for tiers in ({"param_tier": "host", "optimizer_tier": "host"},
                  {"param_tier": "nvme", "optimizer_tier": "nvme", "max_grad_norm": 0.5}):
        config = dict(COMPACT, **tiers)
        runs = run_ranks(config, data, tmp_path / tiers["param_tier"])
        torch.set_num_threads(1)
        try:
            (tmp_path / "one").mkdir(exist_ok=True)
            torch.manual_seed(0)
            model = GPT(CFG)
            with offload.wrap(model, make_opt(model.parameters()),
                              config=dict(config, swap_dir=str(tmp_path / "one"))) as engine:
                losses = train_offload(engine, halves)
                state, states = engine.state_dict(), _compact_states(engine)
        finally:
            torch.set_num_threads(threads)
        for run in runs:
            assert run["losses"] == losses, tiers
            assert_same(run["states"], states)
            assert_same(run["state"], state)


def _refusal_worker(rank, port, swap_root, out_dir):
    """Each stage's wrap of compact states on 2 ranks: the ValueError's words, and whether
    the model is as it was."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    refusals = {}
    try:
        for stage in (1, 2, 3):
            torch.manual_seed(0)
            model = GPT(CFG)
            before = {k: v.clone() for k, v in model.state_dict().items()}
            config = dict(COMPACT, stage=stage, param_tier="nvme", optimizer_tier="nvme",
                          swap_dir=os.path.join(swap_root, f"rank{rank}"))
            try:
                offload.wrap(model, make_opt(model.parameters()), config=config).close()
                refusals[stage] = None
            except ValueError as e:
                unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
                refusals[stage] = (str(e), unchanged)
        torch.save(refusals, os.path.join(out_dir, f"refusals{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_several_ranks_at_a_sharding_stage_are_refused_by_wrap_and_by_offload_plan_in_the_same_words(tmp_path):
    """[Note: compact optimizer states] One process ignores the stage (test_optim_compact's
    test_one_process_ignores_the_stage_...); where ranks really shard the states (stages
    1-3 on 2 gloo ranks) wrap refuses compact states, naming the stage, the model untouched,
    and `offload plan --ranks 2 --stage N` refuses them with the same words."""
    import subprocess
    import sys

    for rank in range(WORLD):
        (tmp_path / "swap" / f"rank{rank}").mkdir(parents=True)
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(_refusal_worker, args=(free_port(), str(tmp_path / "swap"), str(tmp_path)), nprocs=WORLD,
                       join=True, start_method="forkserver")
    refusals = [torch.load(tmp_path / f"refusals{rank}.pt", weights_only=False) for rank in range(WORLD)]
    for rank in range(WORLD):
        assert refusals[rank] == refusals[0]
        assert not list((tmp_path / "swap" / f"rank{rank}").iterdir())
    for stage in (1, 2, 3):
        words, unchanged = refusals[0][stage]
        assert f"optimizer_states: 'compact' is not available with ZeRO stage {stage}" in words and unchanged
        proc = subprocess.run([sys.executable, "-m", "offload", "plan", "--params", "1e6", "--optimizer-states",
                               "compact", "--ranks", str(WORLD), "--stage", str(stage)],
                              capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=os.getcwd()))
        assert proc.returncode == 1 and f"--optimizer-states compact: {words}" in proc.stderr, proc.stderr
    # and the library's rows: each configuration refused in those words
    from offload import plan, plan_ranks
    rows = plan_ranks.plan_ranks(plan.shape_from_count(10**6, 4), "bf16", WORLD, 1, WORLD, WORLD,
                                 optimizer_states="compact")
    assert {c["refused"] for c in rows} == {refusals[0][1][0]}
