"""OffloadConfig: every user-facing setting, checked when it is built.

A config is a frozen dataclass. It can also be given as a plain dict or as the path of a
JSON file with the same field names (``OffloadConfig.from_any``). Sizes are ints (bytes) or
strings such as ``"2GiB"``, ``"512MB"``, ``"1.5GiB"``; they are normalized to ints. Every bad
value raises ``ValueError`` naming the field and what it accepts, before any file or buffer
exists.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Tuple, Union

import torch

from offload._sizes import PAGE_BYTES
from offload.errors import warn_at_caller

Size = Union[int, str, None]

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any, field_name: str) -> Optional[int]:
    """Bytes from an int or a string like "2GiB"; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{field_name}: expected a size in bytes or a string like '2GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{field_name}: a size must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    raise ValueError(
        f"{field_name}: expected a size in bytes or a string like '2GiB' / '512MB', got {value!r}")


def format_size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"


# The names offload.io.probe.BACKENDS holds, in the order io_backend="auto" prefers them; spelled
# out here so a config can be checked without the native extension.
IO_BACKENDS = ("io_uring", "libaio", "threads")


def _check_backend_usable(backend: str) -> None:
    """Refuses a backend this build lacks or the kernel refuses in this process."""
    try:
        from offload.io.probe import backend_refusal
    except ImportError:  # no native extension: wrap() says so itself, naming the fix
        return
    refusal = backend_refusal(backend)
    if refusal is not None:
        raise ValueError(
            f"io_backend: {backend!r} cannot be used in this process: {refusal}; use 'auto' "
            f"(the first of {', '.join(IO_BACKENDS)} that works) or another backend")


# The native I/O engine's limits (native/io/engine.cpp, Engine::Engine; offload/io/engine.py
# checks the same): a block is one kernel request, a positive multiple of 4096 up to 1 GiB;
# up to 4096 blocks are in flight (io_uring and libaio size their rings by it). Spelled out
# here so a config is checked without the native extension; tests/test_config.py pins them
# against IOEngine.
IO_BLOCK_ALIGN_BYTES = PAGE_BYTES
MAX_IO_BLOCK_BYTES = 1 << 30
MAX_IO_QUEUE_DEPTH = 4096

# Loss scales multiply a tensor loss: one above the largest finite float32 makes every
# scaled loss inf, so every fp16 step would be skipped as an overflow.
MAX_LOSS_SCALE = torch.finfo(torch.float32).max

# datetime.timedelta's largest, which the process group's timeout is built from.
MAX_COLLECTIVE_TIMEOUT_SECONDS = datetime.timedelta.max.total_seconds()


def _one_of(name: str, value: Any, accepted: Tuple[Any, ...]) -> None:
    # bool is an int (True == 1) and 1.0 == 1: neither may pass for a member of ``accepted``
    # (a str subclass, such as a str-valued Enum of a config system, still may)
    if isinstance(value, bool) or not any(isinstance(value, type(a)) and value == a for a in accepted):
        raise ValueError(f"{name}: got {value!r}; accepted values are {', '.join(map(repr, accepted))}")


def _check_int(name: str, value: Any, low: int, high: Optional[int] = None) -> None:
    """An int (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low \
            or (high is not None and value > high):
        accepted = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
        raise ValueError(f"{name}: expected {accepted}, got {value!r}")


def _check_number(name: str, value: Any, high: float) -> None:
    """A finite int or float (not a bool) in (0, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= high:
        raise ValueError(f"{name}: expected a finite number > 0 and <= {high:g}, got {value!r}")


@dataclass(frozen=True)
class OffloadConfig:
    """Where training state lives and how it moves. See ARCHITECTURE.md for the model."""

    device: str = "auto"
    """Compute device: "auto" (CUDA when present, else CPU), "cpu", "cuda" or "cuda:N"."""

    device_budget: Size = None
    """Bytes of managed state (compute copies and gradients of units in flight) allowed on
    the device at once. None: no limit beyond the model's own size. Activations are not
    counted, unless activation_offload is set: then the saved tensors the engine keeps on
    the device count too ([Note: saved activations] in memory/activations.py). The smallest
    budget wrap accepts (the root unit, the largest other unit and the largest gradient;
    with several ranks at stage >= 2 also two fp32 gradient buckets, [Note: gradient
    buckets in the device budget] in memory/budget.py) leaves the prefetcher no room: wrap warns then and names the budget that keeps
    prefetch_units units ahead ([Note: prefetch room] in memory/budget.py)."""

    host_budget: Size = None
    """Bytes of host RAM the runtime may hold: gradients, staging buffers and whatever
    state has its home on the host. None: three quarters of the memory available when the
    engine is wrapped (MemAvailable), divided among the ranks of the node
    (``LOCAL_WORLD_SIZE``, as torchrun sets it). With a CPU device, one rank and a tier on NVMe, a
    budget below the step's gradients is met by spilling units' gradients to NVMe and
    reading them back for their update ([Note: gradient spill]); wrap refuses a budget
    below the fixed host needs plus two units' gradients, naming the sizes."""

    param_tier: str = "auto"
    """Home of the compute copy of the parameters: "device", "host", "nvme", or "auto" (the
    default): the device when device_budget holds every unit (or is None) and the run does
    not update speculatively or delayed (those keep the copies at home), else per unit,
    host or NVMe, the host first within host_budget ([Note: placement by budget];
    ``Engine.placement()`` says what was chosen). Without a swap_dir "auto" never chooses
    NVMe; with several ranks it is "host"."""

    optimizer_tier: str = "auto"
    """Home of the fp32 master weights and Adam's moments: "host", "nvme" or "auto" (the
    default: per unit, host or NVMe, as param_tier "auto"; the host for every unit without a
    swap_dir or with several ranks)."""

    swap_dir: Optional[str] = None
    """Directory for swap files; required when a tier is "nvme". With an "auto" tier and no
    swap_dir everything stays on the host. A private run directory is created inside it and
    removed on close."""

    activation_offload: Optional[str] = None
    """Where the tensors autograd saves in forward (activations) wait for backward: None
    (the default) leaves them to the model, on the device and outside device_budget;
    "host" moves each unit's saved tensors to host RAM once the next unit's forward starts
    and brings them back before that unit's backward, every unit's but the last of a
    forward's; "nvme" does the same through host buffers into swap files under swap_dir
    (required then); "auto" keeps them on the device while they fit in device_budget
    beside the compute copies (nothing moves with device_budget None) and moves the
    earliest units' to host RAM only as a saved tensor would not fit. Where it is set,
    device_budget counts the saved tensors kept on the device.
    Results do not change (the bytes are copied, not converted). What moves, when, and
    what does not: [Note: saved activations] in offload/memory/activations.py."""

    activation_host_bytes: Size = None
    """With activation_offload set: bytes of host_budget kept for the saved activations'
    host buffers. The engine's own host needs (and "auto" placement, which moves state into
    RAM while host_budget holds it: [Note: placement by budget]) fit in host_budget less
    this, so that those buffers find at least this much room; beyond their room the
    earliest units' activations go on to NVMe (a unit's larger than the room, in pieces
    through it). None (0): the activations get what the plan leaves, and the first forward
    that sends some of them to NVMe for want of room warns once. Where they may reach NVMe
    (a swap_dir and a host budget) at least 256 KiB is kept for them either way, the room
    for those pieces. ``offload plan --model M --seq-len N --batch B`` prints the bytes one forward
    needs in RAM ([Note: activation host room] in offload/memory/budget.py)."""

    machine_profile: Optional[str] = None
    """Path of an ``offload profile --json`` file: the bandwidths "auto" placement weighs
    tiers by. None: documented round numbers (offload/memory/placement.py, DEFAULT_PROFILE).
    Read and checked at wrap, before anything is touched."""

    dtype: str = "fp32"
    """Compute dtype: "fp32", "bf16" or "fp16" (fp16 uses dynamic loss scaling). The master
    weights and moments are always fp32. With fp32 the compute copy is the master."""

    stage: int = 0
    """ZeRO stage when several ranks train together (torchrun, or an initialized process
    group): 0 every rank keeps everything (data parallel), 1 master weights and Adam moments
    are sharded across ranks, 2 gradients too, 3 the compute copies too (each rank keeps
    1/world_size of every unit at home on param_tier, "host" or "nvme"; a unit is
    all-gathered onto the device just before use and dropped after). Ignored, with a
    warning, on a single process."""

    shard_group_size: Optional[int] = None
    """Several ranks: how many ranks shard each state among themselves (a sharding group;
    ranks 0..N-1 form the first group, N..2N-1 the next, as torchrun numbers a node's ranks
    together). Groups hold replicas of each other's shards: their gradients are all-reduced
    across groups once per optimizer step (FSDP2's HSDP, ZeRO++'s hpZ). None: the ranks of
    one node (torchrun's LOCAL_WORLD_SIZE), or every rank where that is not set; the
    world size must be a multiple of it."""

    collective_timeout_seconds: float = 300.0
    """Several ranks: a collective that waits longer than this for another rank raises an
    error naming the rank that did not arrive (instead of hanging). Finite, > 0."""

    gradient_accumulation_steps: int = 1
    """engine.backward() divides the loss by this; engine.step() applies the optimizer on
    every gradient_accumulation_steps-th call."""

    max_grad_norm: Optional[float] = None
    """Clip the global gradient norm (over all units) to this, a finite number > 0; None: no
    clipping (inf is refused: it would clip nothing yet cost what clipping costs)."""

    unit_classes: Tuple[str, ...] = ()
    """Names of module classes that form units (e.g. ("Block",)). Empty: each child of every
    nn.ModuleList is a unit. The parameters left over form the root unit."""

    unit_predicate: Optional[Callable[[str, torch.nn.Module], bool]] = field(default=None, compare=False)
    """Alternative to unit_classes: predicate(qualified_name, module) -> True for modules
    that form units. Not available from JSON."""

    io_backend: str = "auto"
    """Backend of the native I/O engine: "auto", "io_uring", "libaio" or "threads". "auto"
    takes the first of io_uring, libaio, threads that completes a real aligned write+read in
    swap_dir, in that fixed order, not the fastest: the three move swap traffic at the same
    speed within the disk's noise, and a fixed order keeps runs reproducible. A backend named
    here that this build lacks or the kernel refuses (io_uring disabled by sysctl or
    seccomp) is a ValueError when the config is built. With a tier on "nvme", wrap() checks
    the backend ("auto": finds it) in swap_dir before any swap file is written; one that
    fails there is an OSError naming io_backend, and the swap directory is left as it was."""

    io_block_bytes: Size = 1 << 20
    """Requests larger than this are split into blocks of this size, many in flight. A
    multiple of 4096 bytes from 4KiB to 1GiB (the native engine's limits)."""

    io_queue_depth: int = 32
    """Blocks in flight per I/O engine: 1 to 4096 (the native engine's limit)."""

    swap_checksums: bool = True
    """Keep a CRC32C of every 4 KiB page written to swap (in host RAM: 1.25 MiB per GiB of
    swap) and check every page read against it: swap data changed behind the run's back
    (a disk or filesystem fault, another process) is then an OSError (errno EIO) naming the
    unit, the swap file and the offset, never trained on. Changes no result. The pages are
    summed on the CPU (the SSE4.2 crc32 instruction, a table kernel elsewhere), at a few
    percent of a step (the figures: README, "Swap integrity"). False skips it."""

    prefetch: bool = True
    """Replay the recorded unit order to fetch ahead of use. False: prefetch_units and
    prefetch_bytes are ignored (with a warning when set)."""

    prefetch_units: int = 2
    """How many units ahead the prefetcher may bring compute copies (within device_budget)."""

    prefetch_bytes: Size = None
    """Bytes of compute copies the prefetcher may have on the device or on their way ahead of
    their use (the units of its window, counted in order of use), e.g. "256MiB"; None: as
    much as device_budget leaves. Also bounded by prefetch_units."""

    optimizer_pipeline_depth: int = 3
    """Host staging slots of the optimizer step pipeline (read ahead, update, write back): an
    int >= 2, one slot updating while another is in flight."""

    overlap_step_with_forward: bool = True
    """With the optimizer states on NVMe, one rank, prefetch on and no delayed_update:
    step() queues the updates not run during backward and returns; they finish in the
    order the next forward needs the units, each unit's fetch waiting for its own update.
    Under max_grad_norm, fp16 or skip_nonfinite_steps, step() takes the global norm first
    (from the finished backward) and queues the updates with its factor. A failed update
    is raised by the next call that needs it (forward of that unit, backward, step,
    zero_grad, state_dict, checkpoints, close). False: every update is done inside step()."""

    speculative_updates: Optional[bool] = None
    """With max_grad_norm, fp16 or skip_nonfinite_steps (whose decisions need the global
    gradient norm, known only after backward), still update units during backward: each
    unit's Adam runs as if the clip coefficient were 1 and writes its new states to a second
    set of homes, the old ones kept; step() then commits them when the norm allows (no
    clipping, no skip) and otherwise redoes those updates from the kept states and
    gradients. Bit-identical to the serialized step either way ([Note: speculative
    updates]). It costs a second copy of every state an early update writes (master,
    moments, the compute copy at home; not the root's) on its tier. None: on when the
    optimizer states are on NVMe (disk is cheap), for as many units as the free space of
    swap_dir holds (the last ones first, with a warning when not all), off when they are
    on the host (it would double their RAM); True/False force it. Never with
    param_tier="device", several ranks at stage 0-1 or at stage 2 with compute copies not
    on the host (no early updates there) or delayed_update (its updates start in step(),
    with the norm known)."""

    delayed_update: bool = False
    """ZeRO-Offload's one-step delayed parameter update (Ren et al., USENIX ATC 2021):
    after ``delayed_update_warmup_steps`` exact steps, step t's Adam runs on the optimizer
    worker while step t+1's forward and backward use the weights from before step t's
    update, so the next step's gradients are taken at weights one update old. Steps whose
    gradients overflow (fp16, skip_nonfinite_steps) or get clipped (max_grad_norm) fall
    back to exact steps. It changes the numbers (a stale-gradient method, which can hurt
    convergence, Adam/AdamW included: check the loss curve against an exact run) and costs a
    second set of homes for every trainable unit, as speculative updates do. Off by default;
    not with param_tier="device" or speculative_updates=True. With several ranks, at every
    stage, each rank delays the update of its own shard (at stages 1-2 the all-gather of the
    new shards is part of the delayed update) ([Note: delayed updates] and [Note: delayed
    updates across ranks] in offload/optim/delayed.py)."""

    delayed_update_warmup_steps: int = 40
    """With delayed_update: how many optimizer steps run exactly before updates are delayed
    (an int >= 0; the ZeRO-Offload paper's 40 by default)."""

    optimizer_states: str = "exact"
    """How Adam's states are kept at home: "exact" (the default) an fp32 master (or its
    split low half, split_master) and two fp32 moments, 12 B per parameter with fp32 or 8 B
    with bf16; "compact" both moments 8-bit in blocks of 256 with one fp32 scale each
    ([Note: compact optimizer states] in offload/memory/compact_codec.py). Compact changes
    the numbers (a lossy store of the states) and is refused at wrap, with the reason, for
    what it does not cover: optimizers other than Adam/AdamW/CPUAdam, several ranks at ZeRO
    stage >= 1 (one process ignores the stage, as everywhere), delayed_update, and today
    an accelerator's "device" param_tier (and gathered(modify=True) with param_tier
    "device"). Host, NVMe and "auto" tiers and checkpoints hold the compact states as they are; several ranks
    at stage 0 each hold them whole, as DDP would."""

    split_master: bool = True
    """bf16 compute with the optimizer states on NVMe and the compute copies at home on
    "host" or "nvme" (any ZeRO stage): keep the fp32 master at home as its low 16 bits only,
    the high 16 being the bf16 compute copy ([Note: split master]). Lossless for the master;
    2 B per parameter less on NVMe and less to read and write at every update. The compute
    copy is then the master rounded half away from zero instead of to nearest even: they
    differ only at exact ties, by one bf16 ulp. False: a whole fp32 master apart."""

    initial_loss_scale: float = 2.0**16
    """fp16 only: starting dynamic loss scale; finite, > 0, at most the largest float32 and
    at least min_loss_scale. Ignored, with a warning when set, for other dtypes."""

    loss_scale_window: int = 1000
    """fp16 only: steps without overflow before the scale doubles (an int >= 1)."""

    min_loss_scale: float = 1.0
    """fp16 only: the scale never falls below this; finite, > 0, <= initial_loss_scale."""

    skip_nonfinite_steps: bool = False
    """fp32/bf16: skip the optimizer step when a gradient is NaN/Inf (fp16 always skips)."""

    def __post_init__(self) -> None:
        device = self.device
        if not isinstance(device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
            raise ValueError(f"device: got {device!r}; accepted values are 'auto', 'cpu', 'cuda', 'cuda:N'")
        for name in ("device_budget", "host_budget", "io_block_bytes", "prefetch_bytes", "activation_host_bytes"):
            object.__setattr__(self, name, parse_size(getattr(self, name), name))
        _one_of("param_tier", self.param_tier, ("device", "host", "nvme", "auto"))
        _one_of("optimizer_tier", self.optimizer_tier, ("host", "nvme", "auto"))
        if self.machine_profile is not None:
            if not isinstance(self.machine_profile, (str, os.PathLike)) or \
                    not isinstance(os.fspath(self.machine_profile), str):
                raise ValueError(f"machine_profile: expected the path of an `offload profile --json` file, "
                                 f"got {self.machine_profile!r}")
            object.__setattr__(self, "machine_profile", os.fspath(self.machine_profile))
        _one_of("dtype", self.dtype, ("fp32", "bf16", "fp16"))
        _one_of("stage", self.stage, (0, 1, 2, 3))
        if self.shard_group_size is not None:
            _check_int("shard_group_size", self.shard_group_size, 1)
        if self.stage == 3 and self.param_tier == "device":
            raise ValueError(
                "stage: 3 shards the compute copies at their home tier, but param_tier='device' "
                "keeps every unit whole on the device; use param_tier='host' or 'nvme' with stage 3")
        _one_of("io_backend", self.io_backend, ("auto",) + IO_BACKENDS)
        if self.io_backend != "auto":
            _check_backend_usable(self.io_backend)
        if "nvme" in (self.param_tier, self.optimizer_tier):
            if not self.swap_dir:
                raise ValueError(
                    "swap_dir: required when param_tier or optimizer_tier is 'nvme' "
                    f"(param_tier={self.param_tier!r}, optimizer_tier={self.optimizer_tier!r})")
        _one_of("activation_offload", self.activation_offload, (None, "host", "nvme", "auto"))
        if self.activation_offload == "nvme" and not self.swap_dir:
            raise ValueError("swap_dir: required when activation_offload is 'nvme' (the saved tensors "
                             "are written to swap files there)")
        if self.activation_host_bytes is not None:
            if self.activation_offload is None:
                raise ValueError("activation_host_bytes: keeps host RAM for the saved activations, which "
                                 "only activation_offload ('host', 'nvme' or 'auto') puts there; set it or "
                                 "leave activation_host_bytes None")
            if self.host_budget is not None and self.activation_host_bytes > self.host_budget:
                raise ValueError(f"activation_host_bytes: {self.activation_host_bytes} bytes is more than "
                                 f"host_budget ({self.host_budget} bytes), which it is part of")
        if self.swap_dir is not None:
            if not isinstance(self.swap_dir, (str, os.PathLike)) or \
                    not isinstance(os.fspath(self.swap_dir), str) or "\0" in os.fspath(self.swap_dir):
                raise ValueError(f"swap_dir: expected a directory path (a str without NUL bytes), "
                                 f"got {self.swap_dir!r}")
            object.__setattr__(self, "swap_dir", os.fspath(self.swap_dir))
        for name in ("gradient_accumulation_steps", "loss_scale_window"):
            _check_int(name, getattr(self, name), 1)
        _check_int("io_queue_depth", self.io_queue_depth, 1, MAX_IO_QUEUE_DEPTH)
        _check_int("prefetch_units", self.prefetch_units, 0)
        _check_int("optimizer_pipeline_depth", self.optimizer_pipeline_depth, 2)  # one updating, one in flight
        if self.max_grad_norm is not None:
            if isinstance(self.max_grad_norm, bool) or not isinstance(self.max_grad_norm, (int, float)) \
                    or not 0 < self.max_grad_norm < float("inf"):
                raise ValueError(f"max_grad_norm: expected a finite number > 0, or None for no "
                                 f"clipping, got {self.max_grad_norm!r}")
        if self.io_block_bytes is None or self.io_block_bytes < IO_BLOCK_ALIGN_BYTES \
                or self.io_block_bytes % IO_BLOCK_ALIGN_BYTES or self.io_block_bytes > MAX_IO_BLOCK_BYTES:
            raise ValueError(
                f"io_block_bytes: expected a multiple of {IO_BLOCK_ALIGN_BYTES} bytes from "
                f"{IO_BLOCK_ALIGN_BYTES} to {MAX_IO_BLOCK_BYTES} (1GiB), got {self.io_block_bytes!r}")
        for name in ("device_budget", "host_budget"):
            if getattr(self, name) == 0:
                raise ValueError(f"{name}: must be > 0 (or None for no limit)")
        self._check_units()
        for name in ("initial_loss_scale", "min_loss_scale"):
            _check_number(name, getattr(self, name), MAX_LOSS_SCALE)
        if self.min_loss_scale > self.initial_loss_scale:
            raise ValueError(
                f"min_loss_scale: {self.min_loss_scale!r} is above initial_loss_scale="
                f"{self.initial_loss_scale!r}; the scale starts at initial_loss_scale and never "
                "falls below min_loss_scale, so min_loss_scale must be <= initial_loss_scale")
        _check_number("collective_timeout_seconds", self.collective_timeout_seconds,
                      MAX_COLLECTIVE_TIMEOUT_SECONDS)
        for name in ("prefetch", "skip_nonfinite_steps", "overlap_step_with_forward", "split_master",
                     "swap_checksums"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        if self.speculative_updates is not None and not isinstance(self.speculative_updates, bool):
            raise ValueError(f"speculative_updates: expected True, False or None (auto), "
                             f"got {self.speculative_updates!r}")
        if not isinstance(self.delayed_update, bool):
            raise ValueError(f"delayed_update: expected True or False, got {self.delayed_update!r}")
        _check_int("delayed_update_warmup_steps", self.delayed_update_warmup_steps, 0)
        _one_of("optimizer_states", self.optimizer_states, ("exact", "compact"))
        if self.delayed_update and self.param_tier == "device":
            raise ValueError("delayed_update: needs the compute copies at home on 'host' or 'nvme' (the "
                             "forward reads the copy from before the running update while the update writes "
                             "a second one), but param_tier='device'")
        if self.delayed_update and self.speculative_updates:
            raise ValueError("delayed_update: updates run after step() with the norm known, so there is "
                             "nothing to speculate on; leave speculative_updates at None or False")
        self._warn_ignored()

    def _check_units(self) -> None:
        classes = self.unit_classes
        if isinstance(classes, (str, bytes)) or not isinstance(classes, (list, tuple, set, frozenset)) \
                or not all(isinstance(c, str) and c for c in classes):
            raise ValueError(
                f"unit_classes: expected a list of module class names (non-empty str), got {classes!r}")
        object.__setattr__(self, "unit_classes", tuple(classes))
        if self.unit_predicate is not None:
            if not callable(self.unit_predicate):
                raise ValueError(f"unit_predicate: expected a callable(name, module) -> bool, got {self.unit_predicate!r}")
            if self.unit_classes:
                raise ValueError("unit_predicate: give either unit_classes or unit_predicate, not both")

    def _warn_ignored(self) -> None:
        """One warning naming the fields set away from their defaults that this config ignores.
        (swap_dir and the io_* fields without an "nvme" tier are not reported: scripts that
        switch tiers keep them set, and offload profile builds configs to check a backend.)"""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        ignored = []
        if self.dtype != "fp16":
            ignored += [(n, f"dtype={self.dtype!r}, not 'fp16'") for n in
                        ("initial_loss_scale", "min_loss_scale", "loss_scale_window")]
        if not self.prefetch:
            ignored += [(n, "prefetch=False") for n in ("prefetch_units", "prefetch_bytes")]
        if self.param_tier == "device":
            ignored.append(("speculative_updates", "param_tier='device'"))
        if "auto" not in (self.param_tier, self.optimizer_tier):
            ignored.append(("machine_profile", "no tier is 'auto'"))
        if not self.delayed_update:
            ignored.append(("delayed_update_warmup_steps", "delayed_update=False"))
        ignored = [f"{name} ({why})" for name, why in ignored if getattr(self, name) != defaults[name]]
        if ignored:
            # at the user's OffloadConfig(...), or their wrap(config=...) that built it
            warn_at_caller(f"OffloadConfig: these settings are ignored: {'; '.join(ignored)}", UserWarning)

    @classmethod
    def field_names(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: dict) -> "OffloadConfig":
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ValueError(
                f"unknown config field(s) {', '.join(map(repr, unknown))}; "
                f"valid fields are: {', '.join(cls.field_names())}")
        return cls(**values)

    @classmethod
    def from_json(cls, path: Union[str, os.PathLike]) -> "OffloadConfig":
        try:
            with open(path) as f:
                values = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"config: JSON file {os.fspath(path)!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"config: {os.fspath(path)!r} is not valid JSON: {e}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"config: cannot read JSON file {os.fspath(path)!r}: {e}") from None
        if not isinstance(values, dict):
            raise ValueError(f"config: {os.fspath(path)!r} must hold a JSON object of config fields")
        return cls.from_dict(values)

    @classmethod
    def from_any(cls, config: Union["OffloadConfig", dict, str, os.PathLike, None]) -> "OffloadConfig":
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        if isinstance(config, dict):
            return cls.from_dict(config)
        if isinstance(config, (str, os.PathLike)):
            return cls.from_json(config)
        raise ValueError(f"config: expected an OffloadConfig, a dict or a JSON file path, got {type(config).__name__}")

    def to_dict(self) -> dict:
        """JSON-able view (the predicate, if any, is left out)."""
        values = dataclasses.asdict(self)
        values.pop("unit_predicate")
        values["unit_classes"] = list(self.unit_classes)
        return values

    def needs_norm_first(self) -> bool:
        """Whether a step's updates depend on the global gradient norm, known only after
        backward: clipping, fp16's overflow check or skip_nonfinite_steps."""
        return self.max_grad_norm is not None or self.dtype == "fp16" or self.skip_nonfinite_steps

    def resolved_device(self) -> torch.device:
        """The compute device, with a CUDA device's index: ``device``'s own, else the local
        rank's (``LOCAL_RANK``, set by torchrun: several ranks on one node each take their
        own GPU, whether or not the script called ``torch.cuda.set_device``), else the
        current device."""
        if self.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(self.device)
            if device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device: {self.device!r} was asked for but CUDA is not available")
        if device.type != "cuda" or device.index is not None:
            return device
        return torch.device("cuda", cuda_index(os.environ, torch.cuda.device_count(), torch.cuda.current_device))


def local_world_size(environ: Mapping[str, str]) -> int:
    """The ranks on this node: ``LOCAL_WORLD_SIZE`` as torchrun sets it, else 1."""
    return max(1, int(environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def cuda_index(environ: Mapping[str, str], device_count: int, current: Callable[[], int]) -> int:
    """The GPU of this process when the config names none: the local rank's with several
    ranks on the node (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` > 1, as torchrun sets them), else
    ``current()`` (``torch.cuda.current_device``: 0 unless the script set another)."""
    local_world = local_world_size(environ)
    if local_world <= 1 or "LOCAL_RANK" not in environ:
        return current()
    local_rank = int(environ["LOCAL_RANK"])
    if local_rank >= device_count:
        raise ValueError(f"device: LOCAL_RANK={local_rank} of {local_world} ranks on this node, but this process "
                         f"sees {device_count} GPU(s); give each rank its own (launch at most one rank per GPU, "
                         "or set device='cuda:N' in each rank's config)")
    return local_rank
