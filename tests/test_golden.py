"""Golden numerics: every training mode reproduces its checked-in results bit for bit.

Each case in CASES trains a small GPT for a few steps with one combination of modes and
compares what came out with ``tests/golden/<case>.json``:

  - the loss of every step, exactly (``float.hex``), and the last gradient norm and loss
    scale;
  - the sha256 of the raw bytes of every entry of ``engine.state_dict()``, with its dtype
    and shape;
  - the sha256 of every data file of ``engine.save_checkpoint(dir)``: ``unit-*.bin`` (fp32
    master, Adam's moments, frozen compute copies) and ``buffers.bin``. Not
    ``manifest.json`` (it carries the config and other run details) and not the RNG files
    (their set depends on the CUDA devices present).

The cases cover the dtypes (fp32, bf16, fp16), the tier pairs (param_tier, optimizer_tier)
(device, host), (host, host), (host, nvme), (nvme, nvme), the split master on and off,
prefetch on and off, gradient accumulation, clipping that triggers and clipping that does
not, early updates, deferred updates (overlap_step_with_forward with the optimizer states
on NVMe) and the same without the overlap, a frozen subset of the parameters, 2-rank
ZeRO stages 1 and 3 over gloo, and 2-rank delayed updates at stages 1 and 2. Each case also checks that it exercises what its name says
(clipping happened, updates ran early or deferred, units moved), so that the matrix cannot
quietly lose a mode.

What this means for a change:
  - A change that is not meant to change numerics (a refactor, a new mechanism behind a
    flag that is off) must reproduce every golden file bit for bit. "Close" is a failure:
    a different summation order, a different rounding or an update applied to other
    values shows up here as a different hash, and is a change of numerics.
  - A change that is meant to change numerics regenerates the files, in a commit of its
    own whose message says why the numbers changed:
        OFFLOAD_REGENERATE_GOLDEN=1 python3 -m pytest tests/test_golden.py
    (without -x: every case that was rewritten fails, naming its file, so that a run that
    regenerates is never taken for a run that checked; then run it again without the
    variable, and it passes).

The files record the torch version, the instruction set torch's CPU kernels use
(``torch.backends.cpu.get_cpu_capability()``) and the native Adam one
(``offload.native_info()['adam_isa']``) that made them: other versions of torch's kernels,
or kernels for another instruction set (AVX2 vs AVX-512 fuse and block differently), give
other bits. On a machine where any of them differs the test fails saying so (and how to
force the recorded ones, ATEN_CPU_CAPABILITY and OFFLOAD_FORCE_ISA, where the CPU has
them), rather than comparing bits it cannot match or passing without a check. The intra-op
thread count is pinned (torch.set_num_threads) because reductions such as the gradient norm
sum in an order that depends on it; compute runs on the CPU whatever the machine has.

Where only the instruction sets differ (the files were made on an AVX2 machine, this one has
AVX-512), the module runs itself again in a child process that forces the recorded ones,
and each test here reports its own outcome there (``recorded_kernels``). Forcing takes four
variables, read when the libraries load: ATEN_CPU_CAPABILITY (torch's own kernels),
ONEDNN_MAX_CPU_ISA (oneDNN's), MKL_CBWR=<isa>,STRICT (MKL's gemm: without it an Intel CPU
limited to AVX2 still sums in another order than the AMD machine that made the files) and
OFFLOAD_FORCE_ISA (our Adam). With them an Intel Xeon with AVX-512 reproduced every file
made on an AMD EPYC with AVX2, bit for bit; with any one left out, some case did not.
"""
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import offload
from offload.gpt import GPT, GPTConfig

from support import free_port

GOLDEN_DIR = Path(__file__).parent / "golden"
REGENERATE = os.environ.get("OFFLOAD_REGENERATE_GOLDEN") == "1"
CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=4)
BATCH = 2          # per rank
NUM_STEPS = 4      # micro-steps (batches) per case
NUM_THREADS = 1    # torch intra-op threads, in the test process and in every rank
LR = 1e-2
WORLD = 2
# A norm no gradient of this model reaches (clipping configured, never applied), and one
# every step exceeds (clipping applied on every update).
HUGE_NORM = 1e9
SMALL_NORM = 0.05
# The device tier holds this fraction of the model's fp32 bytes, so units are evicted and
# fetched again within every step (param_tier "device" keeps the whole model there).
BUDGET_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    config: Dict[str, Any]
    stage: Optional[int] = None  # a ZeRO stage on WORLD ranks; None: one process
    frozen: Tuple[str, ...] = ()  # parameter names (prefixes) with requires_grad=False
    # What the case must exercise (checked on every run, regenerating or not):
    clips: bool = False           # the gradient norm exceeded max_grad_norm
    early: bool = False           # some units were updated during backward
    deferred: bool = False        # step() left updates to the worker (the next forward waits)
    overflows: bool = False       # fp16: some steps were skipped, some not
    speculative: bool = False     # early updates under clipping/fp16 ([Note: speculative updates])
    redone: bool = False          # some of them were redone with the clip coefficient
    delayed: bool = False         # delayed_update: some steps' updates ran delayed ([Note: delayed updates])


def _case(name, dtype, tiers, **kw):
    """A case named ``name`` with ``dtype`` and ``tiers`` = (param_tier, optimizer_tier);
    Case fields in ``kw`` go to the Case, the rest to the config."""
    fields = {f.name for f in dataclasses.fields(Case)}
    case_kw = {k: v for k, v in kw.items() if k in fields}
    config = dict(dtype=dtype, param_tier=tiers[0], optimizer_tier=tiers[1],
                  **{k: v for k, v in kw.items() if k not in fields})
    return Case(name=name, config=config, **case_kw)


DEV_HOST, HOST_HOST, HOST_NVME, NVME_NVME = ("device", "host"), ("host", "host"), ("host", "nvme"), ("nvme", "nvme")
CASES = [
    # fp32: every tier pair; early updates by default, deferred with the states on NVMe
    _case("fp32_device_host", "fp32", DEV_HOST, early=True),
    _case("fp32_host_host", "fp32", HOST_HOST, early=True),
    _case("fp32_host_nvme_deferred", "fp32", HOST_NVME, early=True, deferred=True),
    _case("fp32_nvme_nvme_deferred", "fp32", NVME_NVME, early=True, deferred=True),
    _case("fp32_nvme_nvme_no_overlap", "fp32", NVME_NVME, overlap_step_with_forward=False, early=True),
    _case("fp32_host_host_no_prefetch", "fp32", HOST_HOST, prefetch=False),
    _case("fp32_nvme_nvme_no_prefetch", "fp32", NVME_NVME, prefetch=False),
    _case("fp32_host_host_accumulate_clip", "fp32", HOST_HOST, gradient_accumulation_steps=2,
          max_grad_norm=SMALL_NORM, clips=True),
    _case("fp32_nvme_nvme_accumulate_deferred", "fp32", NVME_NVME, gradient_accumulation_steps=2,
          early=True, deferred=True),
    _case("fp32_host_nvme_clip_not_triggered", "fp32", HOST_NVME, max_grad_norm=HUGE_NORM, early=True, deferred=True,
          speculative=True),
    _case("fp32_host_nvme_frozen", "fp32", HOST_NVME, frozen=("wpe.", "blocks.0.ln1."),
          early=True, deferred=True),
    # bf16: the split master applies with the states on NVMe and the compute copies off the device
    _case("bf16_device_host", "bf16", DEV_HOST, early=True),
    _case("bf16_host_host", "bf16", HOST_HOST, early=True),
    _case("bf16_host_nvme_split", "bf16", HOST_NVME, early=True, deferred=True),
    _case("bf16_host_nvme_whole_master", "bf16", HOST_NVME, split_master=False, early=True, deferred=True),
    _case("bf16_nvme_nvme_split_no_overlap", "bf16", NVME_NVME, overlap_step_with_forward=False, early=True),
    _case("bf16_nvme_nvme_whole_master_clip", "bf16", NVME_NVME, split_master=False,
          max_grad_norm=SMALL_NORM, clips=True, early=True, deferred=True, speculative=True, redone=True),
    _case("bf16_nvme_nvme_split_no_prefetch_frozen", "bf16", NVME_NVME, prefetch=False,
          frozen=("wpe.", "blocks.1.fc.")),
    _case("bf16_device_host_accumulate_clip", "bf16", DEV_HOST, gradient_accumulation_steps=2,
          max_grad_norm=SMALL_NORM, clips=True),
    # fp16: dynamic loss scaling (overflow is checked over every gradient: early updates only
    # speculative, with the states on NVMe)
    _case("fp16_device_host", "fp16", DEV_HOST),
    _case("fp16_host_host_accumulate", "fp16", HOST_HOST, gradient_accumulation_steps=2),
    _case("fp16_nvme_nvme_clip", "fp16", NVME_NVME, max_grad_norm=SMALL_NORM, clips=True, early=True, deferred=True,
          speculative=True, redone=True),
    _case("fp16_host_nvme_overflow", "fp16", HOST_NVME, initial_loss_scale=2.0**17, overflows=True, early=True,
          deferred=True, speculative=True),
    # ZeRO over gloo, WORLD ranks on half batches each
    _case("zero1_fp32_host_nvme_clip", "fp32", HOST_NVME, stage=1, max_grad_norm=SMALL_NORM, clips=True),
    _case("zero1_bf16_host_host_accumulate", "bf16", HOST_HOST, stage=1, gradient_accumulation_steps=2),
    _case("zero3_bf16_nvme_nvme_split", "bf16", NVME_NVME, stage=3, early=True),
    _case("zero3_fp32_host_host_accumulate_clip", "fp32", HOST_HOST, stage=3,
          gradient_accumulation_steps=2, max_grad_norm=SMALL_NORM, clips=True),
    # [Note: delayed updates across ranks] each rank delays its shard's update; at stages 1-2
    # the all-gather of the new shards runs inside it, on the optimizer worker (stage 2 on
    # NVMe: in the buffer read from the home, written to the spare extent)
    _case("zero1_fp32_host_nvme_delayed_clip_not_triggered", "fp32", HOST_NVME, stage=1, delayed_update=True,
          delayed_update_warmup_steps=1, max_grad_norm=HUGE_NORM, delayed=True),
    _case("zero2_bf16_nvme_nvme_split_delayed", "bf16", NVME_NVME, stage=2, delayed_update=True,
          delayed_update_warmup_steps=1, delayed=True),
    _case("zero2_fp32_host_host_delayed", "fp32", HOST_HOST, stage=2, delayed_update=True,
          delayed_update_warmup_steps=1, delayed=True),
]
SINGLE = [c for c in CASES if c.stage is None]
ZERO = [c for c in CASES if c.stage is not None]


# ------------------------------------------------------------------ one run of a case

def batches(seed=1, batch=BATCH):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (batch, CFG.seq_len + 1), generator=g)
            for _ in range(NUM_STEPS)]


def model_fp32_bytes(model):
    return sum(p.numel() for p in model.parameters()) * 4


def bucket_room_bytes(model, stage):
    """[Note: gradient buckets in the device budget] What device_budget keeps beside the
    arena at stage >= 2: the root unit's fp32 gradient bucket and the largest block's, each
    its trainable elements cut into WORLD equal shards, and the reduce-scatter's output, the
    larger one's shard (0 below stage 2)."""
    if stage is None or stage < 2:
        return 0
    blocks = [sum(p.numel() for p in b.parameters() if p.requires_grad) for b in model.blocks]
    root = sum(p.numel() for p in model.parameters() if p.requires_grad) - sum(blocks)
    buckets = [-(-n // WORLD) * WORLD for n in (root, max(blocks))]
    return 4 * (sum(buckets) + max(buckets) // WORLD)


def model_compute_bytes(case):
    return model_fp32_bytes(GPT(CFG)) // (1 if case.config["dtype"] == "fp32" else 2)


def tensor_digest(t: torch.Tensor) -> str:
    """"dtype shape sha256-of-the-raw-bytes", e.g. "float32 [64, 32] 3f1c..."."""
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)} {hashlib.sha256(raw).hexdigest()}"


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_digests(ckpt: Path) -> Dict[str, str]:
    """The data files of a checkpoint (see offload/checkpoint.py): unit-*.bin and
    buffers.bin; the manifest and the RNG files are left out (see the module docstring)."""
    names = sorted(p.name for p in ckpt.iterdir()
                   if p.name.endswith(".bin") and (p.name.startswith("unit-") or p.name == "buffers.bin"))
    assert names, f"no unit files in {ckpt}"
    return {name: file_digest(ckpt / name) for name in names}


def hexes(values):
    return [float(v).hex() for v in values]


def train_case(case: Case, work: Path, rank: int = 0, lr: float = LR) -> Dict[str, Any]:
    """Train ``case`` (on this rank when case.stage is set) and return what it pins, plus
    ``exercised`` (the counters its checks read; not part of the golden file)."""
    config = dict(case.config, device="cpu")
    if case.stage is not None:
        config["stage"] = case.stage
    if "nvme" in (config["param_tier"], config["optimizer_tier"]):
        swap = work / f"swap-{case.name}-rank{rank}"
        swap.mkdir(parents=True)
        config["swap_dir"] = str(swap)
    # Several ranks: rank 1 starts from other values, which wrap() must replace by rank 0's.
    torch.manual_seed(0 if rank == 0 else 123)
    model = GPT(CFG)
    for name, p in model.named_parameters():
        if any(name.startswith(prefix) for prefix in case.frozen):
            p.requires_grad_(False)
    if config["param_tier"] != "device":  # the arena alike at every stage: the buckets' room on top
        config["device_budget"] = int(model_fp32_bytes(model) * BUDGET_FRACTION) + bucket_room_bytes(model, case.stage)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, foreach=False)
    data = batches()
    if case.stage is not None:  # each rank trains on its half of a batch of WORLD * BATCH
        data = [b[rank * BATCH:(rank + 1) * BATCH] for b in batches(batch=WORLD * BATCH)]
    losses, grad_norms = [], []
    with offload.wrap(model, optimizer, config=config) as engine:
        for b in data:
            loss = engine(b[:, :-1], b[:, 1:])
            engine.backward(loss)
            if case.speculative:  # every speculative update runs: none is taken back by step(),
                engine.debug.updates.wait_optimizer()  # so the case commits and redoes as named
            engine.step()
            losses.append(loss.item())
            # None while a deferred step's bookkeeping (the norm among it) is still to run
            grad_norms.append(engine.stats()["grad_norm"])
        state = {name: tensor_digest(t) for name, t in engine.state_dict().items()}
        grad_norms.append(engine.stats()["grad_norm"])  # state_dict() settled the last step
        ckpt = work / f"ckpt-{case.name}"
        engine.save_checkpoint(str(ckpt))
        stats = engine.stats()
    digests = checkpoint_digests(ckpt) if rank == 0 else None  # rank 0 renames it into place
    return {
        "losses": hexes(losses),
        # None when every step overflowed (fp16): a skipped step keeps the last norm taken
        "last_grad_norm": None if grad_norms[-1] is None else float(grad_norms[-1]).hex(),
        "loss_scale": float(stats["loss_scale"]).hex(),
        "skipped_steps": stats["skipped_steps"],
        "state_dict": state,
        "checkpoint": digests,
        "exercised": {
            "max_grad_norm_seen": max((n for n in grad_norms if n is not None), default=0.0),
            "early_updates": stats["early_updates"],
            "deferred_updates": stats["deferred_updates"],
            "speculative_updates": stats["speculative_updates"],
            "redone_updates": stats["redone_updates"],
            "bytes_to_device": stats["bytes_host_to_device"] + stats["bytes_nvme_to_device"],
            "bytes_read_nvme": stats["bytes_read_nvme"],
            "skipped_steps": stats["skipped_steps"],
            "delayed_updates": stats["delayed_updates"],
        },
    }


# ------------------------------------------------------------------ several ranks

def _zero_worker(rank, port, cases, work):
    """Every ZeRO case in turn in one process group (one launch for all of them)."""
    torch.set_num_threads(NUM_THREADS)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results = {case.name: train_case(case, Path(work), rank) for case in cases}
        with open(os.path.join(work, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def zero_results(tmp_path_factory, recorded_kernels):
    """{case name: [rank 0's record, rank 1's record]} of every ZeRO case (None when the
    child process of ``recorded_kernels`` runs them)."""
    if recorded_kernels is not None:
        return None
    work = tmp_path_factory.mktemp("golden-zero")
    # forkserver: fresh processes like spawn, forked from a server that imported torch once
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(_zero_worker, args=(free_port(), ZERO, str(work)), nprocs=WORLD, join=True,
                       start_method="forkserver")
    per_rank = [json.loads((work / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {case.name: [per_rank[r][case.name] for r in range(WORLD)] for case in ZERO}


# ------------------------------------------------------------------ golden files

def environment() -> Dict[str, Any]:
    return {"torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "adam_isa": offload.native_info()["adam_isa"], "num_threads": NUM_THREADS}


def golden_path(case: Case) -> Path:
    return GOLDEN_DIR / f"{case.name}.json"


CHILD_VARIABLE = "OFFLOAD_GOLDEN_CHILD"  # set in the child process of recorded_kernels


def forcing_variables() -> Optional[Dict[str, str]]:
    """The environment variables that give a child process the kernels the golden files
    were made with, when this process's differ from them only in instruction sets; None
    when they match already, when the torch version differs too (nothing to force), when
    regenerating, or in that child itself."""
    if REGENERATE or os.environ.get(CHILD_VARIABLE) == "1":
        return None
    recorded = [json.loads(golden_path(c).read_text()) for c in CASES if golden_path(c).exists()]
    here = environment()
    made = {k: recorded[0].get(k) for k in here} if recorded else here
    if made == here or made["torch"] != here["torch"] or made["num_threads"] != here["num_threads"] or \
            any({k: r.get(k) for k in here} != made for r in recorded):
        return None
    isa = str(made["torch_cpu_capability"])
    return {"ATEN_CPU_CAPABILITY": isa.lower(), "ONEDNN_MAX_CPU_ISA": isa.upper(),
            "MKL_CBWR": f"{isa.upper()},STRICT", "OFFLOAD_FORCE_ISA": str(made["adam_isa"]),
            CHILD_VARIABLE: "1"}


class ChildOutcomes:
    """The outcome of every test of this module in the child process of recorded_kernels."""

    def __init__(self, variables: Dict[str, str], report: Path, output: str) -> None:
        self.variables, self.output = variables, output
        self.outcomes: Dict[str, Tuple[str, str]] = {}
        if report.exists():
            for case in ElementTree.parse(report).getroot().iter("testcase"):
                failed = [c for c in case if c.tag in ("failure", "error", "skipped")]
                kind = failed[0].tag if failed else "passed"
                text = (failed[0].get("message") or "") + "\n" + (failed[0].text or "") if failed else ""
                self.outcomes[case.get("name")] = (kind, text)

    def check(self, test_name: str) -> None:
        forced = " ".join(f"{k}={v}" for k, v in self.variables.items())
        if test_name not in self.outcomes:
            pytest.fail(f"{test_name} did not run in the child process with {forced}; its output:\n"
                        f"{self.output[-4000:]}", pytrace=False)
        kind, text = self.outcomes[test_name]
        if kind != "passed":
            pytest.fail(f"{test_name}, run with the recorded kernels ({forced}), {kind}:\n{text}", pytrace=False)


@pytest.fixture(scope="module")
def recorded_kernels(tmp_path_factory) -> Optional[ChildOutcomes]:
    """None when this process runs the kernels the golden files were made with (or cannot
    be made to); else this module run again in a child process that forces them
    (``forcing_variables``), whose outcomes the tests here report."""
    variables = forcing_variables()
    if variables is None:
        return None
    report = tmp_path_factory.mktemp("golden-child") / "report.xml"
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
         f"--junitxml={report}", "-o", "junit_family=xunit2"],
        cwd=Path(__file__).parent.parent, env={**os.environ, **variables},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    return ChildOutcomes(variables, report, child.stdout)


def check_exercised(case: Case, exercised: List[Dict[str, Any]]) -> None:
    """The case does what its name says, on every rank."""
    for r, seen in enumerate(exercised):
        where = f"{case.name} (rank {r})"
        if case.clips:
            assert seen["max_grad_norm_seen"] > case.config["max_grad_norm"], f"{where}: clipping must trigger"
        elif case.config.get("max_grad_norm") is not None:
            assert seen["max_grad_norm_seen"] < case.config["max_grad_norm"], f"{where}: clipping must not trigger"
        if case.overflows:
            assert 0 < seen["skipped_steps"] < NUM_STEPS, f"{where}: skipped {seen['skipped_steps']} steps"
        assert (seen["early_updates"] > 0) == case.early, f"{where}: early updates {seen['early_updates']}"
        assert (seen["deferred_updates"] > 0) == case.deferred, \
            f"{where}: deferred updates {seen['deferred_updates']}"
        assert (seen["speculative_updates"] > 0) == case.speculative, \
            f"{where}: speculative updates {seen['speculative_updates']}"
        assert (seen["redone_updates"] > 0) == case.redone, f"{where}: redone updates {seen['redone_updates']}"
        assert (seen["delayed_updates"] > 0) == case.delayed, f"{where}: delayed updates {seen['delayed_updates']}"
        if case.config["param_tier"] != "device" and case.stage != 3:
            # The budget holds half the model, so moving more than the whole model means
            # units were evicted and fetched again. (Stage 3 gathers are counted elsewhere.)
            assert seen["bytes_to_device"] > model_compute_bytes(case), f"{where}: units must move"
        if "nvme" in (case.config["param_tier"], case.config["optimizer_tier"]):
            assert seen["bytes_read_nvme"] > 0, where


def describe_difference(expected: Dict[str, Any], actual: Dict[str, Any]) -> str:
    lines = []
    gold_losses, now_losses = expected["losses"], actual["losses"]
    if not isinstance(gold_losses[0], list):  # one process; several ranks: a list per rank
        gold_losses, now_losses = [gold_losses], [now_losses]
    for r, (gold, now) in enumerate(zip(gold_losses, now_losses)):
        for i, (a, b) in enumerate(zip(gold, now)):
            if a != b:
                lines.append(f"first differing loss of rank {r}: step {i}: golden {float.fromhex(a)!r} "
                             f"({a}), now {float.fromhex(b)!r} ({b})")
                break
        if len(gold) != len(now):
            lines.append(f"rank {r}: {len(gold)} losses in the golden file, {len(now)} now")
    for key in ("last_grad_norm", "loss_scale", "skipped_steps"):
        if expected[key] != actual[key]:
            lines.append(f"{key}: golden {expected[key]}, now {actual[key]}")
    for key in ("state_dict", "checkpoint"):
        gold, now = expected[key], actual[key]
        differ = sorted(k for k in set(gold) | set(now) if gold.get(k) != now.get(k))
        if differ:
            lines.append(f"{key}: {len(differ)} of {len(gold)} entries differ: {', '.join(differ[:6])}"
                         f"{', ...' if len(differ) > 6 else ''}")
    return "\n  ".join(lines)


def check_against_golden(case: Case, records: List[Dict[str, Any]]) -> None:
    """``records``: one per rank (one for a single process). Rank 0's state and checkpoint
    are pinned (with several ranks state_dict() gathers the same values on every rank, which
    is checked); every rank's losses are."""
    records = [dict(r) for r in records]  # (the ZeRO fixture's are shared by its tests)
    check_exercised(case, [r.pop("exercised") for r in records])
    for r, rec in enumerate(records[1:], start=1):
        assert rec["state_dict"] == records[0]["state_dict"], \
            f"{case.name}: rank {r}'s state_dict differs from rank 0's"
    actual = dict(records[0])
    if len(records) > 1:
        actual["losses"] = [rec["losses"] for rec in records]
    path = golden_path(case)
    if REGENERATE:
        doc = {"case": case.name, **environment(), "world_size": len(records),
               "stage": case.stage, "frozen": list(case.frozen),
               "config": case.config, "num_steps": NUM_STEPS, "model": dataclasses.asdict(CFG), **actual}
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        pytest.fail(f"regenerated {path.relative_to(Path(__file__).parent.parent)} "
                    f"(OFFLOAD_REGENERATE_GOLDEN=1); run again without it to check, and commit "
                    f"the files in a commit of their own that says why the numerics changed",
                    pytrace=False)
    if not path.exists():
        pytest.fail(f"{path} is missing; make it with OFFLOAD_REGENERATE_GOLDEN=1 python3 -m pytest "
                    f"tests/test_golden.py", pytrace=False)
    golden = json.loads(path.read_text())
    here = environment()
    made = {k: golden.get(k) for k in here}
    if made != here:
        pytest.fail(
            f"{path.name} was made with {made}, this machine has {here}: bits from another torch, "
            f"another CPU kernel set or another Adam ISA cannot be compared. To check against these "
            f"files use that torch and (if this CPU has them) ATEN_CPU_CAPABILITY="
            f"{str(made['torch_cpu_capability']).lower()} OFFLOAD_FORCE_ISA={made['adam_isa']}; to move "
            f"the files to this environment, regenerate them on a commit whose numerics are known "
            f"good (OFFLOAD_REGENERATE_GOLDEN=1 python3 -m pytest tests/test_golden.py) in a commit "
            f"of their own", pytrace=False)
    assert golden["config"] == case.config and golden["frozen"] == list(case.frozen), \
        f"{path.name} was made for another definition of case {case.name}; regenerate it"
    expected = {k: golden[k] for k in actual}
    if expected != actual:
        pytest.fail(f"{case.name}: results differ from {path.name} (golden numerics, see "
                    f"tests/test_golden.py):\n  {describe_difference(expected, actual)}", pytrace=False)


@pytest.fixture
def fixed_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(NUM_THREADS)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("case", SINGLE, ids=[c.name for c in SINGLE])
def test_single_process_reproduces_golden(case, tmp_path, fixed_threads, recorded_kernels, request):
    if recorded_kernels is not None:
        return recorded_kernels.check(request.node.name)
    check_against_golden(case, [train_case(case, tmp_path)])


@pytest.mark.parametrize("case", ZERO, ids=[c.name for c in ZERO])
def test_two_ranks_reproduce_golden(case, zero_results, recorded_kernels, request):
    if recorded_kernels is not None:
        return recorded_kernels.check(request.node.name)
    check_against_golden(case, zero_results[case.name])


def test_one_ulp_of_learning_rate_changes_the_results(tmp_path, fixed_threads, recorded_kernels, request):
    """The comparison is sharp enough to fail: the lr one float32 ulp up gives other bits.
    (One float64 ulp does not: the update is computed in float32, where it rounds away.)"""
    if recorded_kernels is not None:
        return recorded_kernels.check(request.node.name)
    case = SINGLE[0]
    path = golden_path(case)
    if REGENERATE or not path.exists():
        pytest.skip("needs the golden files")
    golden = json.loads(path.read_text())
    if {k: golden.get(k) for k in environment()} != environment():
        pytest.skip("golden files of another environment (test_single_process_reproduces_golden says so)")
    one_ulp_up = torch.nextafter(torch.tensor(LR), torch.tensor(1.0)).item()
    assert one_ulp_up != LR
    actual = train_case(case, tmp_path, lr=one_ulp_up)
    assert actual["state_dict"] != golden["state_dict"]
    assert actual["checkpoint"] != golden["checkpoint"]


def test_two_ranks_delayed_at_stage_1_and_2_hold_the_same_bits(zero_results, recorded_kernels, request):
    """[Note: delayed updates across ranks] With fp32 the stage-2 run (gradients reduce-
    scattered per unit in backward, the updated shards all-gathered in the delayed update)
    equals the stage-1 run (gradients reduced in step()) bit for bit on both ranks: the
    same sums of two ranks' gradients, the same shard updates, the same gathers."""
    if recorded_kernels is not None:
        return recorded_kernels.check(request.node.name)
    one, two = (zero_results[name] for name in ("zero1_fp32_host_nvme_delayed_clip_not_triggered",
                                                "zero2_fp32_host_host_delayed"))
    for rank in range(WORLD):
        for key in ("losses", "last_grad_norm", "state_dict"):
            assert one[rank][key] == two[rank][key], (rank, key)
    assert one[0]["checkpoint"] == two[0]["checkpoint"]
    assert one[0]["exercised"]["delayed_updates"] == two[0]["exercised"]["delayed_updates"] == NUM_STEPS - 1
