"""The crash-point harness of save_checkpoint (issue 21): a save fails (an exception) or
dies (SIGKILL) at every durable step, each a fault point ``checkpoint.save.<step>``
(offload/faults.py, [Note: atomic checkpoint directory]); afterwards a complete checkpoint,
the old or the new one, is loadable at the name or named by load_checkpoint's error, a
run resumed from it ends bit-identical to the uninterrupted run, and the next save leaves
exactly one checkpoint. Both ways of replacing a checkpoint are exercised: the atomic
exchange (renameat2) and the fallback of two renames, forced by an EINVAL injected at the
exchange."""
import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import offload
import offload.faults
from offload.checkpoint.directory import complete_copies_beside
from offload.errors import CheckpointError
from offload.gpt import GPT, GPTConfig

from support import assert_same_state

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, num_heads=2, num_layers=2)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOTAL = 3                 # updates of the uninterrupted run; checkpoint A after 1, B after 2
DEAD_PID = 2**22 + 12345  # above pid_max on default kernels: never alive
POINTS = offload.faults.points("checkpoint.save.")
NO_EXCHANGE = OSError(errno.EINVAL, "Invalid argument")  # what a filesystem without RENAME_EXCHANGE says


class InjectedCrash(Exception):
    pass


def make_engine(seed):
    torch.manual_seed(seed)
    model = GPT(CFG)
    return offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config={})


def run_to(engine, end):
    for i in range(engine.stats()["micro_steps"], end):
        b = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=torch.Generator().manual_seed(i))
        engine.backward(engine(b[:, :-1], b[:, 1:]))
        engine.step()


class World:
    """The uninterrupted run's final state, checkpoints A (1 update) and B (2 updates), an
    engine at B that does the saves, and one that resumes."""

    def __init__(self, base):
        self.base = base
        with make_engine(0) as ref:
            run_to(ref, TOTAL)
            self.final = ref.state_dict()
        self.saver = make_engine(0)
        run_to(self.saver, 1)
        self.saver.save_checkpoint(str(base / "A"))
        run_to(self.saver, 2)
        self.saver.save_checkpoint(str(base / "B"))
        self.resumer = make_engine(1)
        self.resumed = set()  # manifest checksums of the checkpoints resumed exactly

    def layout(self, parent, scenario):
        """The parent directory before the save: empty ("first"), with a checkpoint A at
        the name ("replace"), or as a save killed between the fallback's renames left it,
        with an incomplete partial directory of another dead save beside it ("interrupted")."""
        shutil.rmtree(parent, ignore_errors=True)
        parent.mkdir()
        if scenario == "replace":
            shutil.copytree(self.base / "A", parent / "ckpt")
        if scenario == "interrupted":
            shutil.copytree(self.base / "A", parent / f".ckpt.old-{DEAD_PID}-00000001")
            shutil.copytree(self.base / "A", parent / f".ckpt.partial-{DEAD_PID}-00000002")
            shutil.copytree(self.base / "A", parent / f".ckpt.partial-{DEAD_PID + 1}-00000003")
            os.unlink(parent / f".ckpt.partial-{DEAD_PID + 1}-00000003" / "manifest.json")

    def check_after_crash(self, parent, scenario):
        """A complete checkpoint is at the name or named beside it, and resumes exactly;
        the next save leaves the new checkpoint alone in the parent."""
        name = str(parent / "ckpt")
        try:
            self.resumer.load_checkpoint(name)
        except CheckpointError as error:
            copies = complete_copies_beside(name)
            if not copies:  # nothing complete: only where no checkpoint existed before
                assert scenario == "first", f"no complete checkpoint is left: {os.listdir(parent)}"
            else:
                assert all(repr(c) in str(error) for c in copies), str(error)
                self.resumer.load_checkpoint(copies[0])
        else:
            copies = [name]
        if copies:
            assert self.resumer.stats()["micro_steps"] in (1, 2)  # A or B
            # The load checked every file against the manifest's sha256, so a manifest
            # already resumed from stands for the very same bytes: resume each once.
            with open(os.path.join(copies[0], "manifest.json")) as f:
                checksum = json.load(f)["checksum"]
            if checksum not in self.resumed:
                run_to(self.resumer, TOTAL)
                assert_same_state(self.resumer.state_dict(), self.final)
                self.resumed.add(checksum)
        self.saver.save_checkpoint(name)
        assert os.listdir(parent) == ["ckpt"], "the next save leaves exactly the checkpoint"
        self.resumer.load_checkpoint(name)
        assert self.resumer.stats()["micro_steps"] == 2

    def close(self):
        self.saver.close()
        self.resumer.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(tmp_path_factory.mktemp("crash"))
    yield w
    w.close()


@contextlib.contextmanager
def exchange_mode(mode):
    """"exchange": the filesystem's atomic exchange; "fallback": the exchange fails with
    EINVAL, as where the filesystem cannot."""
    if mode == "exchange":
        yield
    else:
        with offload.faults.inject("checkpoint.save.exchange", offload.faults.raising(NO_EXCHANGE)):
            yield


def hits_of_a_save(world, parent, scenario, mode):
    """How often a save reaches each checkpoint.save point (0 left out)."""
    world.layout(parent, scenario)
    with contextlib.ExitStack() as stack:
        stack.enter_context(exchange_mode(mode))
        armed = {name: stack.enter_context(offload.faults.inject(name, lambda **context: None))
                 for name in POINTS if not (mode == "fallback" and name == "checkpoint.save.exchange")}
        world.saver.save_checkpoint(str(parent / "ckpt"))
    return {name: a.hits for name, a in armed.items() if a.hits}


CASES = [("first", "exchange"), ("replace", "exchange"), ("replace", "fallback"),
         ("interrupted", "exchange"), ("interrupted", "fallback")]


@pytest.mark.parametrize("scenario,mode", CASES)
def test_an_exception_at_every_durable_step_loses_nothing(world, scenario, mode, tmp_path):
    parent = tmp_path / "parent"
    hits = hits_of_a_save(world, parent, scenario, mode)
    if mode == "exchange" and scenario != "first":
        assert "checkpoint.save.exchange" in hits and "checkpoint.save.rename_aside" not in hits
    if mode == "fallback":
        assert "checkpoint.save.rename_aside" in hits
    for name, count in hits.items():
        for k in range(1, count + 1):
            world.layout(parent, scenario)
            with exchange_mode(mode), offload.faults.inject(name, offload.faults.raising(InjectedCrash), at=k):
                with pytest.raises(InjectedCrash):
                    world.saver.save_checkpoint(str(parent / "ckpt"))
            if scenario != "interrupted":  # an exception leaves nothing of the save behind
                assert os.listdir(parent) in ([], ["ckpt"]), (name, k, os.listdir(parent))
            world.check_after_crash(parent, scenario)


def test_the_harness_reaches_every_checkpoint_point(world, tmp_path):
    """Each checkpoint.save point is reached by a save of some case above, so none of
    them passes without injecting anything."""
    reached = set()
    for scenario, mode in CASES:
        reached |= set(hits_of_a_save(world, tmp_path / "parent", scenario, mode))
    assert sorted(set(POINTS) - reached) == []


# ---------------------------------------------------------------------- SIGKILL
# One worker process loads checkpoint B into an engine, then forks a child per case that
# saves with a SIGKILL armed at the case's point (a process per case would spend its time
# importing torch). The children are killed, so no except or finally of the save runs.
WORKER = textwrap.dedent("""
    import errno, json, os, signal, sys
    import torch
    torch.set_num_threads(1)
    import offload, offload.faults
    from offload.gpt import GPT, GPTConfig

    args = json.loads(sys.argv[1])
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, num_heads=2, num_layers=2)
    torch.manual_seed(1)
    model = GPT(cfg)
    engine = offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config={})
    engine.load_checkpoint(args["source"])

    def sigkill(**context):
        os.kill(os.getpid(), signal.SIGKILL)

    statuses = []
    for case in args["cases"]:
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)  # a child that hangs dies too, and reports SIGALRM
            held = []         # armed until the process dies: a dropped context manager disarms
            if case["mode"] == "fallback":
                held.append(offload.faults.inject("checkpoint.save.exchange",
                            offload.faults.raising(OSError(errno.EINVAL, "Invalid argument"))))
            held.append(offload.faults.inject(case["point"], sigkill, at=case["at"]))
            for armed in held:
                armed.__enter__()
            engine.save_checkpoint(case["ckpt"])
            os._exit(3)       # survived: the point was not reached
        statuses.append(os.waitpid(pid, 0)[1])
    engine.close()
    print(json.dumps(statuses))
""")

# Each point where a kill leaves a distinct state, in the scenario and mode that reach it;
# the file steps at their first and last hit (the first file, and the manifest).
FILE_STEPS = ("create", "write", "fsync")
KILLS = [("first", "exchange", "rename", 1), ("first", "exchange", "parent_fsync", 1)] + [
    ("replace", mode, point, at) for mode, points in [
        ("exchange", ["mkdir", "create", "write", "fsync", "dir_fsync", "exchange", "parent_fsync", "remove_old"]),
        ("fallback", ["rename_aside", "rename", "parent_fsync", "remove_old"])]
    for point in points for at in ([1, "last"] if point in FILE_STEPS else [1])] + [
    ("interrupted", "exchange", "restore", 1), ("interrupted", "exchange", "remove_stale", 1),
    ("interrupted", "exchange", "remove_stale", 2)]


def test_a_sigkill_at_every_durable_step_loses_nothing(world, tmp_path):
    assert sorted({f"checkpoint.save.{p}" for _, _, p, _ in KILLS}) == POINTS, "a point no kill reaches"
    cases = []
    for i, (scenario, mode, point, at) in enumerate(KILLS):
        point = f"checkpoint.save.{point}"
        parent = tmp_path / f"case-{i}"
        if at == "last":
            at = hits_of_a_save(world, parent, scenario, mode)[point]
        world.layout(parent, scenario)
        cases.append(dict(ckpt=str(parent / "ckpt"), mode=mode, point=point, at=at))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", OFFLOAD_NUM_THREADS="1")
    worker = subprocess.run([sys.executable, str(script), json.dumps(dict(source=str(world.base / "B"), cases=cases))],
                            env=env, capture_output=True, text=True, timeout=600)
    assert worker.returncode == 0, worker.stderr
    statuses = json.loads(worker.stdout.strip().splitlines()[-1])
    for i, (scenario, case, status) in enumerate(zip([k[0] for k in KILLS], cases, statuses)):
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9, (case, status)
        world.check_after_crash(tmp_path / f"case-{i}", scenario)
