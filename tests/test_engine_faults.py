"""Failures that must lose nothing (issue 7): SIGKILL in a step or a save, ENOSPC/EIO from
the swap, NaN/Inf gradients, and a soak for leaks. Faults are injected, never waited for."""
import contextlib
import errno
import json
import os
import re
import subprocess
import sys
import textwrap
import traceback
import warnings

import pytest
import torch

import offload
import offload.faults
from offload.errors import EngineFailedError
from offload.gpt import GPT, GPTConfig

from support import FaultyIO, assert_same_state, unwrap_swap_io, wrap_swap_io

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=3)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def batch(i, cfg=CFG):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=g)


def make_engine(config, seed=0, cfg=CFG):
    torch.manual_seed(seed)
    model = GPT(cfg)
    return offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)


def run(engine, start, n, cfg=CFG):
    for i in range(start, start + n):
        b = batch(i, cfg)
        engine.backward(engine(b[:, :-1], b[:, 1:]))
        engine.step()


def nvme_config(tmp_path, param_tier="nvme", **extra):
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    return dict(param_tier=param_tier, optimizer_tier="nvme", swap_dir=str(swap), device_budget=100_000,
                **extra)


# ---------------------------------------------------------------------- SIGKILL
WORKER = textwrap.dedent("""
    import json, os, signal, sys
    import torch
    torch.set_num_threads(1)
    import offload, offload.faults
    from offload.gpt import GPT, GPTConfig

    args = json.loads(sys.argv[1])
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=3)
    torch.manual_seed(args["seed"])
    model = GPT(cfg)
    engine = offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=dict(
        param_tier="nvme", optimizer_tier="nvme", swap_dir=args["swap_dir"], device_budget=100_000,
        gradient_accumulation_steps=2))

    def sigkill(**context):
        os.kill(os.getpid(), signal.SIGKILL)

    start = 0
    if args.get("load"):
        engine.load_checkpoint(args["load"])
        start = engine.stats()["micro_steps"]
    for i in range(start, args["micro_steps"]):
        g = torch.Generator().manual_seed(1000 + i)
        b = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=g)
        engine.backward(engine(b[:, :-1], b[:, 1:]))
        engine.step()
        if i + 1 == args.get("save_at"):
            engine.save_checkpoint(args["ckpt"])
            if args.get("kill") == "step":   # in the optimizer step after the next one
                # Adam on a unit (or piece) in the step after the next; armed until the
                # process dies (held: a dropped context manager would disarm it)
                armed = offload.faults.inject("optim.adam_range", sigkill, at=len(engine.units) + 2)
                armed.__enter__()
            if args.get("kill") == "save":   # in the middle of the next save: creating
                # the second unit's file (every durable step: tests/test_checkpoint_crash.py)
                armed = offload.faults.inject("checkpoint.save.create", sigkill, at=2)
                armed.__enter__()
                args["save_at"] += 2
    out = {"removed_stale_runs": len(engine.debug.nvme.space.removed_stale_runs)}
    if args.get("save_after"):
        engine.save_checkpoint(args["save_after"])
    torch.save(engine.state_dict(), args["out"])
    engine.close()
    print(json.dumps(out))
""")


def _worker(tmp_path, **args):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", OFFLOAD_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(script), json.dumps(args)], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("kill", ["step", "save"])
def test_sigkill_in_a_step_or_a_save_loses_nothing(kill, tmp_path):
    swap, ckpt = str(tmp_path / "swap"), str(tmp_path / "ckpts" / "ckpt")
    total, save_at = 10, 4   # micro-steps; accumulation 2, so the save is at update 2
    ref = _worker(tmp_path, seed=0, swap_dir=swap, micro_steps=total, out=str(tmp_path / "ref.pt"))
    assert ref.returncode == 0, ref.stderr
    killed = _worker(tmp_path, seed=0, swap_dir=swap, micro_steps=total, save_at=save_at, kill=kill,
                     ckpt=ckpt, out=str(tmp_path / "never.pt"))
    assert killed.returncode == -9, killed.stderr
    leftovers = os.listdir(swap)
    assert any(e.startswith("offload-run-") for e in leftovers), "the killed run left its swap files"
    if kill == "save":
        assert any(".ckpt.partial-" in e for e in os.listdir(tmp_path / "ckpts"))
    resumed = _worker(tmp_path, seed=1, swap_dir=swap, micro_steps=total, load=ckpt,
                      out=str(tmp_path / "resumed.pt"), save_after=str(tmp_path / "ckpts" / "after"))
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["removed_stale_runs"] == 1
    assert_same_state(torch.load(tmp_path / "resumed.pt", weights_only=True),
                      torch.load(tmp_path / "ref.pt", weights_only=True))
    assert os.listdir(swap) == [], "stale swap files and locks are gone after the next run"
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["after", "ckpt"], "the half-written save is cleaned"


# ---------------------------------------------------------------------- ENOSPC / EIO
def _forward_backward(engine, i):
    b = batch(i)
    engine.backward(engine(b[:, :-1], b[:, 1:]))


def step_and_settle(engine):
    """step(), then zero_grad(): with overlap_step_with_forward step() may return before
    its updates finish, and then their errors come from the next call."""
    engine.step()
    engine.zero_grad()


OVERLAP = pytest.mark.parametrize("overlap", [True, False], ids=["deferred", "in-step"])


@OVERLAP
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16: a split master ([Note: split master])
def test_failed_swap_write_keeps_the_step_in_memory_and_saves_elsewhere(dtype, err, overlap, tmp_path):
    config = nvme_config(tmp_path, overlap_step_with_forward=overlap, dtype=dtype)
    with make_engine(config) as ref:
        run(ref, 0, 3)
        after_fault_step = ref.state_dict()
        run(ref, 3, 2)
        final = ref.state_dict()
    with make_engine(config) as engine:
        run(engine, 0, 2)
        engine.save_checkpoint(str(tmp_path / "before"))
        # Installed before backward: units are updated (and written back) during backward.
        wrap_swap_io(engine, FaultyIO, err, fail_write=3)  # the second unit's master
        _forward_backward(engine, 2)
        with pytest.raises(OSError, match="save_checkpoint") as info:
            step_and_settle(engine)
        assert info.value.errno == err
        assert_same_state(engine.state_dict(), after_fault_step)  # read from the held copies
        with pytest.raises(EngineFailedError, match="held in host RAM"):
            _forward_backward(engine, 3)
        unwrap_swap_io(engine)
        engine.save_checkpoint(str(tmp_path / "elsewhere"))
        engine.load_checkpoint(str(tmp_path / "elsewhere"))  # recovers this engine too
        run(engine, 3, 2)
        assert_same_state(engine.state_dict(), final)
    with make_engine(config, seed=1) as fresh:
        fresh.load_checkpoint(str(tmp_path / "elsewhere"))
        run(fresh, 3, 2)
        assert_same_state(fresh.state_dict(), final)
    with make_engine(config, seed=1) as fresh:
        fresh.load_checkpoint(str(tmp_path / "before"))  # the older checkpoint is untouched
        run(fresh, 2, 3)
        assert_same_state(fresh.state_dict(), final)


def five_steps_and_an_engine_after_two(config, tmp_path):
    """The state after 5 steps of a reference run, and an engine after its first 2 steps
    that saved a checkpoint then (tmp_path/before)."""
    with make_engine(config) as ref:
        run(ref, 0, 5)
        final = ref.state_dict()
    engine = make_engine(config)
    run(engine, 0, 2)
    engine.save_checkpoint(str(tmp_path / "before"))
    return final, engine


def assert_stopped_until_a_checkpoint_is_loaded(engine, tmp_path, final, message):
    """After a step stopped part-way (micro-step 2 of batches 0..4): saving and training
    are refused with ``message``, nothing is written, and loading the checkpoint saved
    after step 2 (tmp_path/before) makes the rest of the run end at ``final``."""
    with pytest.raises(EngineFailedError, match=message):
        engine.save_checkpoint(str(tmp_path / "mixed"))
    assert not os.path.exists(tmp_path / "mixed")
    with pytest.raises(EngineFailedError):
        _forward_backward(engine, 2)
    engine.load_checkpoint(str(tmp_path / "before"))
    run(engine, 2, 3)
    assert_same_state(engine.state_dict(), final)


@OVERLAP
def test_failed_swap_read_stops_the_engine_until_a_checkpoint_is_loaded(overlap, tmp_path):
    config = nvme_config(tmp_path, param_tier="host", overlap_step_with_forward=overlap)
    final, engine = five_steps_and_an_engine_after_two(config, tmp_path)
    with engine:
        # Installed before backward: units are updated (their states read) during backward.
        wrap_swap_io(engine, FaultyIO, errno.EIO, fail_read=2)
        _forward_backward(engine, 2)
        with pytest.raises(OSError, match="resume from the last checkpoint") as info:
            step_and_settle(engine)
        assert info.value.errno == errno.EIO
        unwrap_swap_io(engine)
        assert_stopped_until_a_checkpoint_is_loaded(engine, tmp_path, final, "resume from the last checkpoint")


@OVERLAP
@pytest.mark.parametrize("max_grad_norm", [None, 1.0], ids=["early-updates", "step-pipeline"])
def test_an_interrupt_inside_the_update_stops_the_engine_until_a_checkpoint_is_loaded(
        max_grad_norm, overlap, tmp_path):
    """Ctrl-C (or any exception) part-way through the updates leaves some units at the new
    step and others at the old one; even a KeyboardInterrupt, which is not an I/O error,
    must leave the engine refusing to train or save until a checkpoint is loaded. Without
    clipping the updates run during backward on the optimizer worker (the interrupt comes
    back through step(), or the next call when step() defers them); with it, in step()'s
    own pipeline."""
    config = nvme_config(tmp_path, max_grad_norm=max_grad_norm, overlap_step_with_forward=overlap)
    final, engine = five_steps_and_an_engine_after_two(config, tmp_path)
    with engine:
        # the Adam of some unit after the first ones
        with offload.faults.inject("optim.adam", offload.faults.raising(KeyboardInterrupt), at=5):
            with pytest.raises(KeyboardInterrupt):
                _forward_backward(engine, 2)
                step_and_settle(engine)
        assert_stopped_until_a_checkpoint_is_loaded(engine, tmp_path, final,
                                                    "KeyboardInterrupt.*resume from the last checkpoint")


def test_failed_fetch_in_forward_names_the_unit_and_the_next_pass_reads_it_again(tmp_path):
    """A swap read that fails while a compute copy is fetched changes no state: forward
    raises an OSError naming the unit, and once the disk answers again training goes on
    as if that forward never happened."""
    config = nvme_config(tmp_path)
    with make_engine(config) as ref:
        run(ref, 0, 4)
        final = ref.state_dict()
    with make_engine(config) as engine:
        run(engine, 0, 2)
        engine.zero_grad()  # the last step's deferred updates are done: the next read is a fetch
        wrap_swap_io(engine, FaultyIO, errno.EIO, fail_read=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the failed pass leaves the recorded trace
            with pytest.raises(OSError, match="fetching unit .* to the device failed") as info:
                _forward_backward(engine, 2)
        assert info.value.errno == errno.EIO
        unwrap_swap_io(engine)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run(engine, 2, 2)
        assert_same_state(engine.state_dict(), final)


class NextPassReadsFail(FaultyIO):
    """Fails every read that step() starts for the next pass's first units (the engine's
    prefetch_next_pass), and no other; counts them in ``failed``."""

    def __init__(self, io, err):
        super().__init__(io, err)
        self.failed = 0

    def read_into(self, tensor, path, offset=0):
        if any(frame.name == "prefetch_next_pass" for frame in traceback.extract_stack()):
            self._fail_read, self.failed = self.reads + 1, self.failed + 1
        return super().read_into(tensor, path, offset)


@pytest.mark.parametrize("then", ["forward", "load_checkpoint", "save_checkpoint", "close"])
def test_a_failed_read_ahead_of_the_next_pass_loses_nothing(then, tmp_path):
    """step() starts fetching the next pass's first units. When those reads fail, nothing
    has used them: the step is done, and the failure is raised only to a use that needs
    the unit (the next forward, which the one after reads again); a checkpoint load or
    save, or close(), that lands those fetches warns, counts them
    (stats()["failed_prefetches"]) and does its work."""
    # step() waits for every update, then fetches the next pass's first units whose device
    # copies the updates made stale: the same reads in every run ('blocks.1' here)
    config = dict(nvme_config(tmp_path, overlap_step_with_forward=False), device_budget=200_000)
    with make_engine(config) as ref:
        run(ref, 0, 4)
        final = ref.state_dict()
    before = tmp_path / "after-two-steps"
    engine = make_engine(config)
    try:
        run(engine, 0, 2)
        engine.save_checkpoint(str(before))
        faulty = wrap_swap_io(engine, NextPassReadsFail, errno.EIO)
        run(engine, 2, 1)  # its step's read ahead fails: the step is done all the same
        unwrap_swap_io(engine)
        assert faulty.failed > 0
        if then == "forward":
            # a forward raises for a failed read ahead it meets (one here on the CPU device;
            # on CUDA and its stand-in nothing stays on the device over a step, and each of
            # the next pass's first units read ahead failed), each abandoned, the next
            # reading that unit again
            raised = 0
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the failed pass leaves the recorded trace
                for _ in range(faulty.failed + 1):
                    try:
                        _forward_backward(engine, 3)
                    except OSError as error:
                        assert re.search("fetching unit .* failed.*the next forward reads the unit again", str(error))
                        raised += 1
                    else:
                        break
                engine.step()
            assert 1 <= raised <= faulty.failed
            assert engine.stats()["failed_prefetches"] == 0  # raised to its use instead
            assert_same_state(engine.state_dict(), final)
            return
        with pytest.warns(RuntimeWarning, match="fetching unit .* failed.*nothing used it yet") as said:
            if then == "load_checkpoint":
                engine.load_checkpoint(str(before))
                failed_prefetches = engine.stats()["failed_prefetches"]
                run(engine, 2, 2)
            elif then == "save_checkpoint":
                engine.save_checkpoint(str(tmp_path / "after-three-steps"))
                failed_prefetches = engine.stats()["failed_prefetches"]
                run(engine, 3, 1)
            else:
                engine.close()
        assert all(w.filename == __file__ for w in said if "nothing used it yet" in str(w.message))
        if then == "close":
            return
        assert failed_prefetches == faulty.failed
        assert_same_state(engine.state_dict(), final)
        if then == "save_checkpoint":  # the checkpoint holds the third step
            (tmp_path / "other-swap").mkdir()
            with make_engine(dict(config, swap_dir=str(tmp_path / "other-swap")), seed=1) as resumed:
                resumed.load_checkpoint(str(tmp_path / "after-three-steps"))
                run(resumed, 3, 1)
                assert_same_state(resumed.state_dict(), final)
    finally:
        engine.close()


@pytest.mark.parametrize("tiers", ["nvme", "host"])
def test_an_interrupt_in_the_models_own_forward_ends_the_pass(tiers, tmp_path):
    """Ctrl-C inside model(...) called directly, as the Hugging Face Trainer calls it (not
    engine(...), which ends the pass itself): torch skips the always-called post-forward
    hooks for a KeyboardInterrupt, so the next forward finds the pass still open. It must
    start a new one, and the run equals one that never saw the interrupted forward."""
    config = nvme_config(tmp_path) if tiers == "nvme" else dict(device_budget=100_000)

    def model_step(engine, i):
        b = batch(i)
        engine.backward(engine.module(b[:, :-1], b[:, 1:]))
        engine.step()

    with make_engine(config) as ref:
        for i in range(3):
            model_step(ref, i)
        final = ref.state_dict()
    with make_engine(config) as engine:
        model_step(engine, 0)
        b = batch(1)
        with offload.faults.inject("hooks.forward", offload.faults.raising(KeyboardInterrupt), at=2):
            with pytest.raises(KeyboardInterrupt):
                engine.module(b[:, :-1], b[:, 1:])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the interrupted pass left the recorded trace
            for i in (1, 2):
                model_step(engine, i)
        assert_same_state(engine.state_dict(), final)


@pytest.mark.parametrize("ram", ["available", "none"])
def test_a_failed_write_at_a_budget_without_room(ram, tmp_path, monkeypatch):
    """[Note: swap I/O failures] host_budget exactly the plan leaves no room for the states
    of a failed write: they are held past it all the same (the run's only current states),
    the error says by how much, and a checkpoint saved elsewhere holds the step. Where not
    even half of the RAM the kernel reports available holds them ("none": a machine out of
    memory, the kernel's figure replaced for the test), the step stops part-way."""
    if ram == "none":
        import offload.optim.step
        monkeypatch.setattr(offload.optim.step, "available_memory_bytes", lambda: 0)
    config = nvme_config(tmp_path)
    with make_engine(config) as probe:
        host_bytes = probe._host_planned_bytes  # exactly what the wrap-time plan needs
    with make_engine(dict(config, host_budget=host_bytes)) as engine:
        _forward_backward(engine, 0)
        wrap_swap_io(engine, FaultyIO, errno.ENOSPC, fail_write=1)
        said = ("held in host RAM .* past host_budget.*save_checkpoint" if ram == "available" else
                "more than the host can spare.*resume from the last checkpoint")
        with pytest.raises(OSError, match=said):
            step_and_settle(engine)
        unwrap_swap_io(engine)
        if ram == "available":
            engine.save_checkpoint(str(tmp_path / "ckpt"))
        else:
            with pytest.raises(EngineFailedError):
                engine.save_checkpoint(str(tmp_path / "ckpt"))


def test_enospc_on_a_full_filesystem_during_save_keeps_the_last_checkpoint(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    with make_engine({}) as engine:
        engine.save_checkpoint(str(tmp_path / "probe"))
        size = sum(os.path.getsize(tmp_path / "probe" / f) for f in os.listdir(tmp_path / "probe"))
        tmpfs_bytes = (size * 3 // 2 + 4095) // 4096 * 4096  # one checkpoint fits, two do not
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={tmpfs_bytes}", "tmpfs", str(mount)],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root and mount rights)")
        try:
            engine.save_checkpoint(str(mount / "ckpt"))
            state = engine.state_dict()
            run(engine, 0, 1)
            with pytest.raises(OSError) as info:
                engine.save_checkpoint(str(mount / "ckpt"))
            assert info.value.errno == errno.ENOSPC
            assert os.listdir(mount) == ["ckpt"], "the partial directory is removed"
            run(engine, 1, 1)  # the engine itself is fine
            with make_engine({}, seed=1) as fresh:
                fresh.load_checkpoint(str(mount / "ckpt"))
                assert_same_state(fresh.state_dict(), state)
        finally:
            subprocess.run(["umount", str(mount)], check=True)


# ---------------------------------------------------------------------- a failed wrap
# Where a wrap is made to fail: the first or the last swap write of the initial placement
# (nothing home yet; every unit home but the last), or after its last step (every unit home).
WRAP_FAILURES = ["first swap write", "last swap write", "after the last step"]


def _swap_writes_in_wrap(make_model, config):
    """How many swap writes wrapping ``make_model()`` with ``config`` issues."""
    engines = []
    with offload.faults.inject("nvme.io_engine", lambda io: engines.append(FaultyIO(io, errno.EIO)) or engines[-1]):
        model = make_model()
        offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config).close()
    return engines[0].writes


@contextlib.contextmanager
def _fail_wrap(where, swap_writes):
    """Inside the block, the next wrap fails ``where`` (one of WRAP_FAILURES), and the
    block expects that failure; yields pytest.raises's ExceptionInfo."""
    if where == "after the last step":
        fault = offload.faults.inject(
            "wrap.done", offload.faults.raising(RuntimeError("injected failure after the last step of wrap")))
        refused = pytest.raises(RuntimeError, match="injected failure")
    else:
        k = 1 if where == "first swap write" else swap_writes
        fault = offload.faults.inject("nvme.io_engine", lambda io: FaultyIO(io, errno.EIO, fail_write=k))
        refused = pytest.raises(OSError, match=os.strerror(errno.EIO))
    with fault, refused as failure:
        yield failure


def assert_no_hooks(model):
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks
    for p in model.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None)


@pytest.mark.parametrize("where", WRAP_FAILURES)
def test_a_wrap_failing_part_way_leaves_the_model_as_it_was(where, tmp_path):
    """The initial placement lets each parameter's storage go once its unit is home; a wrap
    failing after that must still give the model back with the same parameters and values,
    the optimizer with the same param groups, no hook and no swap file, and a second wrap
    of them trains like a first one."""
    config = nvme_config(tmp_path)
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = GPT(CFG)
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params_before = dict(model.named_parameters())
    values_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups_before = [list(g["params"]) for g in opt.param_groups]
    swap_writes = _swap_writes_in_wrap(lambda: GPT(CFG), config)
    with _fail_wrap(where, swap_writes) as failure:
        offload.wrap(model, opt, config=config)
    failed = [frame.f_locals["self"] for frame, _ in traceback.walk_tb(failure.tb)
              if isinstance(frame.f_locals.get("self"), offload.engine.Engine)]
    assert failed and all(vars(engine) == {} for engine in failed), "the failed engine holds no buffers"
    for n, p in model.named_parameters():
        assert p is params_before[n], n
        assert p.device == values_before[n].device and torch.equal(p.detach(), values_before[n]), n
    assert [g["params"] for g in opt.param_groups] == groups_before
    assert all(a is b for g, before in zip(opt.param_groups, groups_before) for a, b in zip(g["params"], before))
    assert_no_hooks(model)
    assert os.listdir(config["swap_dir"]) == []
    with offload.wrap(model, opt, config=config) as engine, \
            offload.wrap(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2),
                         config=dict(config, swap_dir=str(tmp_path))) as fresh:
        run(engine, 0, 1)
        run(fresh, 0, 1)
        assert_same_state(engine.state_dict(), fresh.state_dict())
    assert os.listdir(config["swap_dir"]) == []


@pytest.mark.parametrize("where", WRAP_FAILURES + ["init_fn"])
def test_a_wrap_of_a_meta_model_failing_part_way_leaves_it_as_it_was(where, tmp_path):
    """A meta model is materialized into stand-in parameters unit by unit: a wrap failing
    part-way must put its meta parameters (and meta buffers) back in the model and the
    optimizer, leave no hook and no swap file, and rewind the RNG that initialization drew
    from, so that a second wrap gives the values of an eager build and trains."""
    config = nvme_config(tmp_path)
    def meta_gpt():
        with torch.device("meta"):
            return GPT(CFG)

    swap_writes = _swap_writes_in_wrap(meta_gpt, config)
    torch.manual_seed(0)
    eager = GPT(CFG)
    torch.manual_seed(0)
    model = meta_gpt()
    model.blocks[0].register_buffer("counts", torch.empty(4, device="meta"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params_before = dict(model.named_parameters())
    buffers_before = dict(model.named_buffers())
    groups_before = [list(g["params"]) for g in opt.param_groups]
    rng_before = torch.get_rng_state()
    last_block = set(model.blocks[-1].modules())

    def give_counts(module):  # a meta buffer needs an initializer ([Note: a meta model needs an initializer])
        if module is model.blocks[0]:
            module.counts.zero_()

    def init_fn(module):  # with where="init_fn", fails in the last block: the others are home
        give_counts(module)
        if where == "init_fn" and module in last_block:
            raise RuntimeError("injected failure in init_fn")

    if where == "init_fn":
        refused = pytest.raises(RuntimeError, match="injected failure in init_fn")
    else:
        refused = _fail_wrap(where, swap_writes)
    with refused:
        offload.wrap(model, opt, config=config, init_fn=init_fn)
    assert dict(model.named_parameters()).keys() == params_before.keys()
    for n, p in model.named_parameters():
        assert p is params_before[n] and p.is_meta and p.shape == params_before[n].shape, n
    assert all(b is buffers_before[n] and b.is_meta for n, b in model.named_buffers())
    assert all(a is b for g, before in zip(opt.param_groups, groups_before) for a, b in zip(g["params"], before))
    assert [len(g["params"]) for g in opt.param_groups] == [len(before) for before in groups_before]
    assert_no_hooks(model)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert os.listdir(config["swap_dir"]) == []
    with offload.wrap(model, opt, config=config, init_fn=give_counts) as engine:
        state = engine.state_dict()
        for k, v in eager.state_dict().items():
            assert torch.equal(state[k], v), k
        run(engine, 0, 1)
    assert os.listdir(config["swap_dir"]) == []


# ---------------------------------------------------------------------- NaN / Inf
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_nonfinite_gradient_is_reported_with_its_unit_and_skipped_when_asked(skip, dtype):
    with make_engine(dict(dtype=dtype, skip_nonfinite_steps=skip)) as engine:
        run(engine, 0, 1)
        before = engine.state_dict()
        def poison(grad):  # one NaN in the unit's first gradient, on its way to the host
            grad = grad.clone()
            grad.view(-1)[5] = float("nan")
            return grad

        handle = engine.units[2].trainable[0].param.register_hook(poison)
        _forward_backward(engine, 1)
        handle.remove()
        with pytest.warns(RuntimeWarning, match=rf"first in unit {engine.units[2].name!r}") as caught:
            engine.step()
        assert caught[0].filename == __file__, "the warning points at the user's step() call"
        stats = engine.stats()
        assert stats["nonfinite_steps"] == 1
        after = engine.state_dict()
        if skip:
            assert stats["skipped_steps"] == 1
            assert_same_state(after, before)
        else:
            assert stats["skipped_steps"] == 0
            assert any(not torch.isfinite(v).all() for v in after.values())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            if skip:
                run(engine, 2, 1)  # finite again: no warning


@pytest.mark.parametrize("tiers", [("host", "host"), ("nvme", "nvme")], ids="-".join)
def test_the_nonfinite_warning_points_at_the_users_line(tiers, tmp_path):
    """With the states on NVMe step() defers the updates and their bookkeeping, the norm
    among it ([Note: deferred updates]): the warning then comes from the call that settles
    them (here state_dict(), a method under torch.no_grad), and still names the user's line,
    not offload's nor torch's decorator."""
    with make_engine(nvme_config(tmp_path, param_tier=tiers[0]) if tiers[1] == "nvme" else {}) as engine:
        b = batch(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.backward(engine(b[:, :-1], b[:, 1:]) * float("nan"))
            engine.step()
            engine.state_dict()
        nonfinite = [w for w in caught if "non-finite gradient" in str(w.message)]
        assert len(nonfinite) == 1 and nonfinite[0].filename == __file__
        assert engine.stats()["nonfinite_steps"] == 1


# ---------------------------------------------------------------------- soak
def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow  # 500 steps with swap I/O: minutes on a shared 2-core machine
def test_soak_nvme_no_growth_of_rss_or_descriptors(tmp_path):
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, num_heads=2, num_layers=2)
    config = nvme_config(tmp_path)
    config["device_budget"] = None
    samples = []
    with make_engine(config, cfg=cfg) as engine:
        for i in range(500):
            run(engine, i, 1, cfg=cfg)
            if (i + 1) % 50 == 0:
                engine.save_checkpoint(str(tmp_path / "ckpt"))
                if i + 1 >= 150:  # after warm-up
                    samples.append((_rss_bytes(), sorted(os.listdir("/proc/self/fd"))))
        assert engine.stats()["nvme_bytes"] > 0
    rss = [r for r, _ in samples]
    assert max(rss) - rss[0] < 4 << 20, f"RSS grows after warm-up: {rss}"
    assert all(len(fds) == len(samples[0][1]) for _, fds in samples), "file descriptors leak"
    assert os.listdir(tmp_path / "swap") == [], "swap space returns to zero after close"
    assert engine.stats()["nvme_bytes"] == 0
