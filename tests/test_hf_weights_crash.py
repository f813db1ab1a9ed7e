"""The crash-point harness of save_pretrained ([Note: atomic model directory] in
offload/checkpoint/export.py): a save fails (an exception) or dies (SIGKILL) at every durable
step, each a fault point ``checkpoint.pretrained.<step>`` (offload/faults.py). Afterwards
the directory loads, through ``wrap(..., weights=)``'s reader and through
``from_pretrained`` alike, as the whole earlier save or the whole new one (never a mix, and
both readers the same one), what else the directory held is untouched, and the next save
leaves the new save alone with those entries. An exception before the switch leaves the
earlier save and nothing of the failed one. Every change of layout is exercised: a first
save, one file to one file, to shards and back, shards over shards of the same names, and a
directory holding what a killed save leaves."""
import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

import offload
import offload.faults
from offload.io.safetensors import WeightFiles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POINTS = offload.faults.points("checkpoint.pretrained.")
SHARD = 160_000                # bytes: the tiny llama (about 430 KB of fp32) in 3 shards
DEAD_PID = 2**22 + 12345       # above pid_max on default kernels: never alive
FOREIGN = ("README.md", "checkpoint-1")  # a file and a directory that are not the save's
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False)
# (the directory before the save, the layout of the new save)
CASES = [("first", "single"), ("first", "sharded"), ("single", "single"), ("single", "sharded"),
         ("sharded", "single"), ("sharded", "sharded"), ("resaved", "sharded"), ("leftovers", "sharded")]


class InjectedCrash(Exception):
    pass


@pytest.fixture(autouse=True)
def _quiet():
    hf_logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="transformers")
        yield


def shard_size(layout):
    return SHARD if layout == "sharded" else "5GB"


class World:
    """An engine whose weights were A when the template directories were saved and are B
    now (one optimizer step later); ``src_b`` holds B for the SIGKILL worker."""

    def __init__(self, base):
        self.base = base
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(base / "src")
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        self.engine = offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   config=dict(param_tier="host", optimizer_tier="host"), weights=base / "src")
        self.old = self.engine.state_dict()
        templates = base / "templates"
        for name in ("single", "sharded", "resaved", "leftovers"):
            (templates / name).mkdir(parents=True)
            (templates / name / "README.md").write_text("not the save's")
            (templates / name / "checkpoint-1").mkdir()
            (templates / name / "checkpoint-1" / "trainer_state.json").write_text("{}")
        self.engine.save_pretrained(templates / "single")
        self.engine.save_pretrained(templates / "sharded", max_shard_size=SHARD)
        self.engine.save_pretrained(templates / "resaved", max_shard_size=SHARD)
        self.engine.save_pretrained(templates / "resaved", max_shard_size=SHARD)  # shards named with its id
        self.engine.save_pretrained(templates / "leftovers")
        stale = templates / "leftovers" / f".offload-save-{DEAD_PID}-00000001"
        stale.mkdir()
        (stale / "model-00001-of-00003.safetensors").write_bytes(b"half")
        shutil.copy(templates / "sharded" / "model-00002-of-00003.safetensors",  # moved in, never indexed
                    templates / "leftovers" / "model-00002-of-00003.safetensors")
        batch = torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
        self.engine.backward(self.engine(batch, labels=batch).loss)
        self.engine.step()
        self.new = self.engine.state_dict()
        assert any(not torch.equal(self.old[k], self.new[k]) for k in self.old)
        self.engine.save_pretrained(base / "src_b")

    def layout(self, out, scenario):
        shutil.rmtree(out, ignore_errors=True)
        if scenario != "first":
            shutil.copytree(self.base / "templates" / scenario, out, symlinks=True)

    def which(self, values):
        """"old" or "new" when ``values`` is exactly that state, else an assertion."""
        for name, state in (("old", self.old), ("new", self.new)):
            if values.keys() == state.keys() and all(torch.equal(values[k], state[k]) for k in state):
                return name
        raise AssertionError(f"the directory loads neither the old nor the new save: {sorted(values)[:4]}...")

    def loaded(self, out):
        """What each reader loads from ``out``: "old", "new" or None (nothing loads)."""
        try:
            with WeightFiles(out) as files:
                ours = self.which({name: files.read(name) for name in files.shapes})
        except ValueError as error:
            assert "holds neither" in str(error) or "neither a model directory" in str(error), str(error)
            ours = None
        try:
            model = LlamaForCausalLM.from_pretrained(out)
        except (OSError, ValueError):
            theirs = None
        else:
            theirs = self.which({k: v for k, v in model.state_dict().items() if k in self.old})
        assert ours == theirs, f"weights= loads {ours}, from_pretrained {theirs}: {sorted(os.listdir(out))}"
        return ours

    def check_after(self, out, scenario, new_layout, raised_at=None):
        """The directory loads the old or new save whole, keeps its other entries, and the
        next save leaves the new save alone with them. Returns which loaded."""
        which = self.loaded(out)
        if scenario == "first":
            assert which in (None, "new")
        else:
            assert which in ("old", "new")
            assert (out / "README.md").read_text() == "not the save's"
            assert (out / "checkpoint-1" / "trainer_state.json").read_text() == "{}"
        if raised_at is not None and out.exists():
            ours = [e for e in os.listdir(out) if e.startswith(f".offload-save-{os.getpid()}-")]
            assert not ours, (raised_at, ours)
            if which != "new":  # before the switch: nothing of the failed save
                before = set(os.listdir(self.base / "templates" / scenario)) if scenario != "first" else set()
                assert set(os.listdir(out)) <= before | {"config.json", "generation_config.json"}, \
                    (raised_at, sorted(set(os.listdir(out)) - before))
        self.engine.save_pretrained(out, max_shard_size=shard_size(new_layout))
        assert self.loaded(out) == "new"
        left = sorted(set(os.listdir(out)) - set(FOREIGN))
        if new_layout == "single":
            assert left == ["config.json", "generation_config.json", "model.safetensors"], left
        else:
            index = json.loads((out / "model.safetensors.index.json").read_text())
            assert left == sorted(["config.json", "generation_config.json", "model.safetensors.index.json",
                                   *set(index["weight_map"].values())]), left
        return which

    def close(self):
        self.engine.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(tmp_path_factory.mktemp("hf-crash"))
    yield w
    w.close()


def hits_of_a_save(world, out, scenario, new_layout):
    """How often a save reaches each checkpoint.pretrained point (0 left out)."""
    world.layout(out, scenario)
    with contextlib.ExitStack() as stack:
        armed = {name: stack.enter_context(offload.faults.inject(name, lambda **context: None)) for name in POINTS}
        world.engine.save_pretrained(out, max_shard_size=shard_size(new_layout))
    return {name: a.hits for name, a in armed.items() if a.hits}


def some_hits(count):
    """Every hit of a point reached a few times; else the first two, one in the middle and
    the last two (each shard's header and tensors are writes of the same kind)."""
    return list(range(1, count + 1)) if count <= 6 else sorted({1, 2, count // 2, count - 1, count})


@pytest.mark.parametrize("scenario,new_layout", CASES)
def test_an_exception_at_every_durable_step_leaves_the_old_or_the_new_save(world, scenario, new_layout, tmp_path):
    out = tmp_path / "out"
    hits = hits_of_a_save(world, out, scenario, new_layout)
    if scenario in ("single", "leftovers") and new_layout == "sharded":
        assert "checkpoint.pretrained.switch" in hits
    seen = set()
    for name, count in hits.items():
        for k in some_hits(count):
            world.layout(out, scenario)
            with offload.faults.inject(name, offload.faults.raising(InjectedCrash), at=k):
                with pytest.raises(InjectedCrash):
                    world.engine.save_pretrained(out, max_shard_size=shard_size(new_layout))
            seen.add(world.check_after(out, scenario, new_layout, raised_at=(name, k)))
    assert "new" in seen and (scenario == "first" or "old" in seen), seen


def test_the_harness_reaches_every_pretrained_point(world, tmp_path):
    reached = set()
    for scenario, new_layout in CASES:
        reached |= set(hits_of_a_save(world, tmp_path / "out", scenario, new_layout))
    assert sorted(set(POINTS) - reached) == []


def test_an_injected_enospc_keeps_its_errno_names_the_file_and_leaves_the_old_save(world, tmp_path):
    import errno

    out = tmp_path / "out"
    world.layout(out, "sharded")
    full = OSError(errno.ENOSPC, "No space left on device")
    with offload.faults.inject("checkpoint.pretrained.write", offload.faults.raising(full), at=3):
        with pytest.raises(OSError) as caught:
            world.engine.save_pretrained(out, max_shard_size=SHARD)
    assert caught.value.errno == errno.ENOSPC
    staged = caught.value.filename  # the file being written, in the save's staging directory
    assert os.path.dirname(os.path.dirname(staged)) == str(out), staged
    assert os.path.basename(staged).startswith("model-00001-of-00003"), staged
    assert "save_pretrained could not write" in str(caught.value)
    assert world.check_after(out, "sharded", "sharded", raised_at=("write", 3)) == "old"


# ---------------------------------------------------------------------- SIGKILL
# One worker process wraps the model from src_b (the engine at B), then forks a child per
# case that saves with a SIGKILL armed at the case's point: no except or finally runs.
WORKER = textwrap.dedent("""
    import json, os, signal, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM
    import offload, offload.faults

    args = json.loads(sys.argv[1])
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**args["config"]))
    engine = offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                          config=dict(param_tier="host", optimizer_tier="host"), weights=args["source"])

    def sigkill(**context):
        os.kill(os.getpid(), signal.SIGKILL)

    statuses = []
    for case in args["cases"]:
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)  # a child that hangs dies too, and reports SIGALRM
            if case["point"] == "after a weights file":  # no fault point: any writer's files
                from offload.io.safetensors import SafetensorsWriter
                finish, done = SafetensorsWriter.finish, []

                def finish_then_die(writer):
                    finish(writer)
                    done.append(writer)
                    if len(done) == case["at"]:
                        sigkill()
                SafetensorsWriter.finish = finish_then_die
            else:
                armed = offload.faults.inject(case["point"], sigkill, at=case["at"])
                armed.__enter__()  # held until the process dies: a dropped context manager disarms
            engine.save_pretrained(case["out"], max_shard_size=case["shard"])
            os._exit(3)       # survived: the point was not reached
        statuses.append(os.waitpid(pid, 0)[1])
    engine.close()
    print(json.dumps(statuses))
""")


def run_kills(world, tmp_path, kills):
    """Each (scenario, new layout, point, hit) killed in a child of one worker process;
    then each directory is checked. Returns the set of (scenario, what loaded)."""
    cases = []
    for i, (scenario, new_layout, point, at) in enumerate(kills):
        out = tmp_path / f"case-{i}"
        world.layout(out, scenario)
        cases.append(dict(out=str(out), point=point, at=at, shard=shard_size(new_layout)))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", OFFLOAD_NUM_THREADS="1")
    worker = subprocess.run([sys.executable, str(script), json.dumps(dict(
        source=str(world.base / "src_b"), config=CONFIG, cases=cases))],
        env=env, capture_output=True, text=True, timeout=600)
    assert worker.returncode == 0, worker.stderr
    statuses = json.loads(worker.stdout.strip().splitlines()[-1])
    seen = set()
    for i, ((scenario, new_layout, point, at), status) in enumerate(zip(kills, statuses)):
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9, (point, at, status)
        seen.add((scenario, world.check_after(tmp_path / f"case-{i}", scenario, new_layout)))
    return seen


def test_a_save_killed_after_a_weights_file_leaves_the_old_or_the_new_save(world, tmp_path):
    """The report's two cases, without fault points: shards over shards killed after the
    first shard was written (it left 1 new tensor among 25 old ones, loaded silently), and
    shards to one file killed once model.safetensors was written (weights= read the old
    shards, from_pretrained the new file)."""
    run_kills(world, tmp_path, [("sharded", "sharded", "after a weights file", 1),
                                ("sharded", "sharded", "after a weights file", 2),
                                ("sharded", "single", "after a weights file", 1)])


def test_a_sigkill_at_every_durable_step_leaves_the_old_or_the_new_save(world, tmp_path):
    kills = []
    for scenario, new_layout in CASES:
        for point, count in hits_of_a_save(world, tmp_path / "probe", scenario, new_layout).items():
            for at in sorted({1, count}) if count > 4 else range(1, count + 1):
                kills.append((scenario, new_layout, point, at))
    assert {k[2] for k in kills} == set(POINTS), "a point no kill reaches"
    seen = run_kills(world, tmp_path, kills)
    assert ("sharded", "old") in seen and ("sharded", "new") in seen, seen
