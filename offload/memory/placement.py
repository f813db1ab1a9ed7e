"""Placement: on which tier each unit's compute copy and optimizer states live, and the
machine profile (link bandwidths, Adam throughput) the choice and the step-time prediction
use. One function decides (``place_units``); wrap and ``offload plan`` both call it.

[Note: placement by budget] With ``param_tier="auto"`` or ``optimizer_tier="auto"`` (both
the defaults) the engine chooses, for every unit, where its compute copy and where its fp32
master and Adam moments live. Compute copies go to the device, all of them, when
``device_budget`` holds every unit (or is None: no limit), as ``param_tier="device"`` puts
them: then nothing is fetched; but not in a run that may update speculatively (clipping,
fp16 or skips, unless speculative_updates=False) or delayed, which need the copies at home.
With several ranks an "auto" role is on the host, every unit (per-unit placement is for one
process). Otherwise the choice is per unit, host RAM or NVMe: it starts from every auto role on NVMe
(or, without a swap_dir, on the host) and moves roles to the host one at a time, best first,
as long as the host budget still holds everything else the run keeps there, counted by the
one budget arithmetic (memory/budget.py ``host_bytes``: staging slots, spare homes of
speculative updates, gradients), less the saved activations' share of it
(activation_host_bytes: [Note: activation host room] in memory/budget.py):

- A role's worth is the NVMe time it saves per step per byte of RAM it takes, from the
  profile's bandwidths: a compute copy is read in forward and again in backward (the root
  unit once, it stays on the device in between), and written by its update (with fp32 it is
  the master: read and written by the update too); optimizer states are read and written
  once a step. Speculative updates ([Note: speculative updates]) double a host-homed role's
  RAM (its spare), halving its worth; delayed updates ([Note: delayed updates]) double a
  compute copy's only (they write master and moments in place), and move the states on the
  optimizer worker beside the next forward and backward, where only their CPU share
  (DELAYED_IO_CPU_FRACTION, [Note: step prediction]) shows in the step: a delayed run's
  states are worth a quarter of their NVMe time, and its compute copies, whose fetches
  forward and backward wait for, go to RAM first.
- The step's gradients compete for the same RAM: beyond the budget they are spilled
  ([Note: gradient spill]), written and read back once a step, on the main thread. Roles
  worth more per byte than a spilled gradient go first, with only the spill's floor
  (``budget.spill_floor_bytes``: the bounce buffer, the room of the gradients beyond the
  allowance, the tied ones held) kept back; the rest go only where every gradient still fits in RAM.
- Among roles of equal worth, units in forward order first: the units forward needs first
  are the ones backward finishes last, whose updates the next step waits for.

Placement never changes numerics: the same kernel runs on the same values whichever tier a
state comes from (tests/test_memory_placement.py checks mixed placements bit for bit against
the all-NVMe run). That is why an "auto" tier turns the split master off ([Note: split
master]: its bf16 compute copy rounds ties away from zero, and a unit with its states in RAM
keeps a whole master): every auto placement computes what (nvme, nvme) with
split_master=False, and (host, host), compute. With explicit tiers the placement is uniform
and nothing is chosen.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from offload.config import OffloadConfig, format_size
from offload.errors import warn_at_caller
from offload.memory.budget import (
    UnitSizes, activation_reserve_text, compact_home_bytes, compact_num_pieces, held_shared_bytes, host_bytes, minimum_device_budget, minimum_host_budget, spill_floor_bytes,
    swap_bytes, unit_home_bytes)
from offload.io.swap import usable_bytes
from offload._sizes import PAGE_BYTES
from offload.memory.layout import FP32_BYTES, Layout

PROFILE_SCHEMA = "offload-profile"
PROFILE_VERSION = 1
LINKS = ("nvme_read", "nvme_write", "host_to_device", "device_to_host", "host_memcpy")

# [Note: default profile] Used when no profile is given: round numbers for a current
# server (one PCIe 4.0 NVMe SSD, a PCIe 4.0 x16 GPU link with pinned buffers, one socket of
# AVX-512 cores). Run `offload profile --swap-dir DIR --json PATH` to measure your own.
DEFAULT_PROFILE: dict = {
    "schema": PROFILE_SCHEMA,
    "version": PROFILE_VERSION,
    "source": "default (documented round numbers, not a measurement)",
    "bandwidth_bytes_per_second": {
        "nvme_read": 3.0e9,
        "nvme_write": 2.0e9,
        "host_to_device": 12.0e9,
        "device_to_host": 12.0e9,
        "host_memcpy": 10.0e9,
    },
    "adam_params_per_second": 1.0e9,
    "recommended_io": {"io_backend": "auto", "io_block_bytes": 1 << 20, "io_queue_depth": 32},
}


# ---------------------------------------------------------------------------- profiles
def validate_profile(profile: dict, where: str) -> dict:
    """Check a loaded profile against the schema (see offload/profile.py); ValueError names
    what is wrong."""
    if not isinstance(profile, dict) or profile.get("schema") != PROFILE_SCHEMA:
        raise ValueError(f"{where}: not an offload profile (expected \"schema\": \"{PROFILE_SCHEMA}\")")
    if profile.get("version") != PROFILE_VERSION:
        raise ValueError(f"{where}: profile version {profile.get('version')!r} is not supported "
                         f"(this offload reads version {PROFILE_VERSION}); run `offload profile` again")
    bandwidth = profile.get("bandwidth_bytes_per_second")
    if not isinstance(bandwidth, dict):
        raise ValueError(f"{where}: missing \"bandwidth_bytes_per_second\"")
    for link in LINKS:
        value = bandwidth.get(link)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{where}: bandwidth_bytes_per_second.{link} must be a number > 0, got {value!r}")
    adam = profile.get("adam_params_per_second")
    if isinstance(adam, bool) or not isinstance(adam, (int, float)) or not adam > 0:
        raise ValueError(f"{where}: adam_params_per_second must be a number > 0, got {adam!r}")
    return profile


def load_profile(path: Optional[str], field: str = "--profile") -> dict:
    """The profile at ``path`` (DEFAULT_PROFILE for None), checked; a ValueError names
    ``field`` (the option or config field it came from) and the file."""
    if path is None:
        return DEFAULT_PROFILE
    try:
        with open(path) as f:
            profile = json.load(f)
    except OSError as e:
        raise ValueError(f"{field}: cannot read {path!r}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{field}: {path!r} is not valid JSON: {e}") from None
    return validate_profile(profile, f"{field}: {path}")


# ---------------------------------------------------------------------------- placement
@dataclass(frozen=True)
class UnitPlacement:
    """Where one unit's state lives, and its bytes there (spare homes included)."""

    name: str
    compute_tier: str              # "device", "host" or "nvme"
    state_tier: Optional[str]      # "host" or "nvme"; None for a unit with nothing to train
    compute_bytes: int             # the compute copy at home (the master too when merged)
    state_bytes: int               # the fp32 master (unless merged) and the Adam moments


@dataclass(frozen=True)
class Placement:
    """The placement of every unit, root first (``Engine.placement()``, ``offload plan``)."""

    units: Tuple[UnitPlacement, ...]

    @property
    def compute_tiers(self) -> Tuple[str, ...]:
        return tuple(u.compute_tier for u in self.units)

    @property
    def state_tiers(self) -> Tuple[str, ...]:
        """Per unit; "" for a unit with nothing to train."""
        return tuple(u.state_tier or "" for u in self.units)

    def bytes_per_tier(self) -> Dict[str, int]:
        """Bytes of compute copies, masters and moments at home on each tier."""
        out = {"device": 0, "host": 0, "nvme": 0}
        for u in self.units:
            out[u.compute_tier] += u.compute_bytes
            if u.state_tier is not None:
                out[u.state_tier] += u.state_bytes
        return out

    def describe(self) -> List[str]:
        """One line per unit: its name, tiers and bytes (``offload plan`` prints them)."""
        width = max(len(u.name) for u in self.units)
        return [f"{u.name:<{width}}  compute copy {u.compute_tier:<6} {format_size(u.compute_bytes):>10}   "
                + (f"master+moments {u.state_tier:<4} {format_size(u.state_bytes):>10}"
                   if u.state_tier is not None else "nothing to train")
                for u in self.units]


def describe_units(units: Sequence[UnitSizes], layout: Layout) -> Placement:
    """The placement ``layout`` (whose tiers are decided) gives ``units``."""
    out = []
    for i, u in enumerate(units):
        home = unit_home_bytes(u, layout, i)
        compute_tier = layout.compute_tier(i)
        compute = u.compute_numel * layout.compute_element_bytes if compute_tier == "device" else home.compute
        out.append(UnitPlacement(u.name, compute_tier, layout.state_tier(i) if u.trainable else None,
                                 compute, home.master + home.moments))
    return Placement(tuple(out))


def place_units(units: Sequence[UnitSizes], layout_for: Callable[[Tuple[str, ...], Tuple[str, ...]], Layout],
                *, param_tier: str, optimizer_tier: str, host_budget: Optional[int], has_swap: bool,
                profile: dict) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """[Note: placement by budget] The tier of every unit's compute copy and of its states
    ("" for a unit with nothing to train), root first: uniform for explicit tiers, chosen
    for "auto" ones. ``layout_for(compute_tiers, state_tiers)``: the run's Layout with
    those tiers (the arithmetic depends on them: speculative spares, staging slots).
    ``host_budget``: set whenever a tier is "auto" (Layout gives it a default). A budget
    below what even the all-NVMe placement keeps in RAM is a ValueError naming host_budget."""
    n = len(units)
    auto_compute, auto_states = param_tier == "auto", optimizer_tier == "auto"
    start = "nvme" if has_swap else "host"
    compute = [start if auto_compute else param_tier] * n
    states = [(start if auto_states else optimizer_tier) if u.trainable else "" for u in units]
    if not (auto_compute or auto_states) or not has_swap:
        return tuple(compute), tuple(states)
    assert host_budget is not None, "Layout gives host_budget a default when a tier is auto"
    everything = (tuple("host" if auto_compute else t for t in compute),
                  tuple("host" if auto_states and t else t for t in states))
    layout = layout_for(tuple(compute), tuple(states))
    # [Note: activation host room] the activations' share is never placed into
    reserved = layout.activation_host_bytes
    if host_bytes(units, layout_for(*everything)).total + reserved <= host_budget:
        return everything  # no NVMe traffic at all (and no staging slots or spare homes)
    floor = minimum_host_budget(units, layout)
    if host_budget < floor:
        raise ValueError(
            f"host_budget: {format_size(host_budget)} ({host_budget} bytes) is too small even with every "
            f"'auto' state on NVMe: the run keeps {format_size(floor)} ({floor} bytes) in RAM "
            "(staging buffers, the gradients of the units in flight and whatever an explicit tier puts there"
            + (f", and {activation_reserve_text(layout)}" if reserved else "") + ")")
    bandwidth = profile["bandwidth_bytes_per_second"]
    read, write = 1.0 / bandwidth["nvme_read"], 1.0 / bandwidth["nvme_write"]
    gradient_worth = read + write  # a spilled gradient byte is written and read back once a step
    candidates: List[Tuple[float, int, str]] = []  # (worth: seconds saved per RAM byte, unit, role)
    for i, u in enumerate(units):
        # [Note: speculative updates], [Note: delayed updates] (a compute copy only) spares
        copies, state_copies = layout.home_copies(i, u.trainable)
        if auto_compute:
            reads = (1 if i == 0 else 2) + (1 if layout.merged and u.trainable else 0)
            candidates.append(((reads * read + (write if u.trainable else 0.0)) / copies, i, "compute"))
        if auto_states and u.trainable:
            # [Note: delayed updates] a delayed update moves the states on the worker, beside
            # the next forward and backward: only its CPU share shows in the step
            hidden = DELAYED_IO_CPU_FRACTION if layout.delayed_update else 1.0
            candidates.append(((read + write) * hidden / state_copies, i, "states"))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    for worth, i, role in candidates:
        trial_compute, trial_states = list(compute), list(states)
        (trial_compute if role == "compute" else trial_states)[i] = "host"
        trial = layout_for(tuple(trial_compute), tuple(trial_states))
        # worth more than a spilled gradient: only the spill's floor of gradients stays in RAM
        # (where gradients can spill: [zero] several ranks keep them all)
        need = minimum_host_budget(units, trial) if worth > gradient_worth \
            else host_bytes(units, trial).total + reserved
        if need <= host_budget:
            compute, states, layout = trial_compute, trial_states, trial
    return tuple(compute), tuple(states)


def resolve_placement(config: OffloadConfig, device: torch.device, partition: Any,
                      units: Sequence[UnitSizes]) -> Layout:
    """The run's Layout with every unit's tiers decided ([Note: placement by budget]):
    wrap calls it once its units are cut, before any budget is checked or anything
    allocated. ValueErrors name the config field (machine_profile, host_budget, the tiers)."""
    auto = "auto" in (config.param_tier, config.optimizer_tier)
    # [zero] with several ranks each rank places what it keeps (``units``: its shards) under
    # its own host budget (by default its share of the node's); the collectives do not care
    # which tier a rank reads its part from
    profile = load_profile(config.machine_profile, "machine_profile") if auto else DEFAULT_PROFILE

    base = Layout.resolve(config, device, partition)

    def layout_for(compute_tiers: Tuple[str, ...], state_tiers: Tuple[str, ...]) -> Layout:
        # the default host budget as read once, for every candidate and the result
        return Layout.resolve(config, device, partition, (compute_tiers, state_tiers), base.host_budget)

    if auto and base.host_budget is None and config.swap_dir is not None:
        raise ValueError("host_budget: 'auto' tiers with a swap_dir need a host budget, and the memory "
                         "available could not be read on this system; give host_budget")
    param_tier = _param_tier(config, partition, units, base)
    tiers = place_units(units, layout_for, param_tier=param_tier, optimizer_tier=config.optimizer_tier,
                        host_budget=base.host_budget, has_swap=config.swap_dir is not None, profile=profile)
    layout = layout_for(*tiers)
    if config.speculative_updates is None and layout.speculative and config.swap_dir is not None:
        layout = fit_spares_to_swap(units, layout, usable_bytes(config.swap_dir))
    return layout


def _param_tier(config: OffloadConfig, partition: Any, units: Sequence[UnitSizes], base: Layout) -> str:
    """config.param_tier, or "device" for an "auto" one where every compute copy fits the
    device budget. Not with delayed updates, which keep a lagging compute copy at home, nor
    where the run may update speculatively (clipping, fp16 or skips), which a device-homed
    compute copy rules out: there the compute copies stay at home, as with param_tier "host"."""
    if config.param_tier == "auto" and not config.delayed_update \
            and not (partition is not None and partition.shards_params) \
            and not (config.needs_norm_first() and config.speculative_updates is not False) and (
            config.device_budget is None
            or config.device_budget >= minimum_device_budget(units, "device", base.compute_element_bytes)):
        return "device"  # no fetch at all
    return config.param_tier


def minimum_state_host_bytes(config: OffloadConfig, device: torch.device, partition: Any,
                             units: Sequence[UnitSizes]) -> int:
    """[Note: activation host room] The host RAM the engine's own needs take at least under
    ``config``'s tiers (every "auto" role where placement starts: on NVMe with a swap_dir,
    else on the host; gradients spilled where they can be): what host_budget holds beside
    activation_host_bytes at the most (``minimum_host_budget`` less that share)."""
    config = dataclasses.replace(config, activation_host_bytes=None)
    base = Layout.resolve(config, device, partition)
    param_tier = _param_tier(config, partition, units, base)
    start = "nvme" if config.swap_dir is not None else "host"
    compute = tuple(start if param_tier == "auto" else param_tier for _ in units)
    states = tuple((start if config.optimizer_tier == "auto" else config.optimizer_tier) if u.trainable else ""
                   for u in units)
    layout = Layout.resolve(config, device, partition, (compute, states), base.host_budget)
    # less what Layout keeps for activations even without a share (ACTIVATION_PIECE_BYTES)
    return minimum_host_budget(units, layout) - layout.activation_host_bytes


# [Note: speculative updates] Spare homes, an optional speed-up, take at most this share of
# the swap directory's free space: the rest stays for checkpoints, logs and other runs.
SPARE_FREE_FRACTION = 0.9


def fit_spares_to_swap(units: Sequence[UnitSizes], layout: Layout, usable: Optional[int]) -> Layout:
    """[Note: speculative updates] With speculative_updates left to the engine (None): when
    SPARE_FREE_FRACTION of the swap directory's free space (``usable``) cannot hold every
    unit's spare homes beside the rest of the run, the units backward finishes first (the
    last ones) get spare homes while they fit, and a warning says how many; the others are
    updated once step() knows the norm. Numerics are the same either way."""
    if usable is None:
        return layout
    free_bytes = int(usable * SPARE_FREE_FRACTION)
    if swap_bytes(units, layout) <= free_bytes:
        return layout
    keep = [False] * len(units)
    for i in reversed(range(1, len(units))):
        if not units[i].trainable:
            continue
        keep[i] = True
        if swap_bytes(units, dataclasses.replace(layout, spare_units=tuple(keep))) > free_bytes:
            keep[i] = False
            break
    fitted = dataclasses.replace(layout, spare_units=tuple(keep))
    wanted = sum(1 for i, u in enumerate(units) if layout.has_spare(i, u.trainable))
    warn_at_caller(
        f"speculative_updates: the swap directory has room ({format_size(free_bytes)}, "
        f"{SPARE_FREE_FRACTION:.0%} of its free space) for the spare homes of "
        f"{sum(keep)} of {wanted} units (each needs its states twice); the others are updated after backward, "
        f"once the gradient norm is known. With all of them the run needs {format_size(swap_bytes(units, layout))} "
        "of swap; speculative_updates=False silences this", RuntimeWarning)
    return fitted


# ---------------------------------------------------------------------------- prediction
@dataclass(frozen=True)
class StepPrediction:
    """[Note: step prediction] What one optimizer step (one micro-batch) of a CPU-device run
    moves to and from NVMe, and the time predicted for it."""

    nvme_read_bytes: int
    nvme_write_bytes: int
    io_seconds: float                 # the bytes at the profile's NVMe bandwidths
    compute_seconds: Optional[float]  # the step with every state in RAM (measured or given)
    exposed_fraction: float = 0.0     # EXPOSED_IO_FRACTION, or 0 with delayed updates
    io_cpu_fraction: float = 0.0      # DELAYED_IO_CPU_FRACTION with delayed updates, else 0

    @property
    def seconds(self) -> Optional[float]:
        """max(busy, I/O) + the I/O that cannot overlap compute, busy being the compute time
        plus the CPU work the overlapped I/O takes from it (see the constants below)."""
        if self.compute_seconds is None:
            return None
        busy = self.compute_seconds + self.io_cpu_fraction * self.io_seconds
        return max(busy, self.io_seconds) + self.exposed_fraction * min(busy, self.io_seconds)


# [Note: step prediction] The share of the smaller of compute and NVMe time that shows in the
# step anyway: the first fetches of forward, the last units' updates of backward, synchronous
# gradient spills. A documented constant, fitted with tools/bench_train.py
# --sweep-host-budget (which prints predicted against measured at every point, the compute
# time being the same path's step with every state in RAM, measured in the same run) on the
# 2-core reference machine; the fit is in docs/performance.md ("Memory"). It depends on
# the machine's ratio of compute to disk speed: rerun the sweep where that differs.
EXPOSED_IO_FRACTION = 0.25
# With delayed_update ([Note: delayed updates]) step t's updates, all of its state traffic,
# run under step t+1's forward and backward: nothing is exposed, but the updates' CPU work
# (Adam on the staged pieces, split and join, checksums, staging copies) runs beside the
# forward and backward on the same cores, and grows with the bytes they move. So the step is
# max(compute + DELAYED_IO_CPU_FRACTION x I/O, I/O), the compute time being a delayed run's
# with every state in RAM. Fitted with the same sweep on the same machine (the fit: in
# docs/performance.md, "Memory").
DELAYED_IO_CPU_FRACTION = 0.25


def predict_step(units: Sequence[UnitSizes], layout: Layout, profile: dict,
                 compute_seconds: Optional[float] = None, resident_units: int = 1) -> StepPrediction:
    """[Note: step prediction] NVMe traffic of one step of ``layout``'s placement (one
    process, CPU device) and its predicted time. Per unit with its compute copy on NVMe:
    read in forward and again in backward (the root once, and the last ``resident_units``
    of forward stay for backward); written by the update unless merged (then the update
    reads and writes it as the master). With its states on NVMe: the master (unless
    merged; its low half when split) and both moments read and written; compact ([Note:
    compact optimizer states]): the whole compact home read and written, and the update
    reads the high parts from a compute copy on NVMe. Gradients beyond the
    host budget's allowance ([Note: gradient spill]), where they wait for the norm or for
    more micro-steps: written and read back. Not modelled: an update that reads a resident
    device copy instead of the home ([Note: updates through the device copy]) and update
    fills, which make the real traffic smaller (tests/test_memory_placement.py bounds the
    difference)."""
    bandwidth = profile["bandwidth_bytes_per_second"]
    home_element_bytes = FP32_BYTES if layout.merged else layout.compute_element_bytes
    read = write = 0
    blocks = len(units) - 1
    for i, u in enumerate(units):
        if layout.compute_tier(i) == "nvme":
            home = u.home_numel * home_element_bytes
            refetched = i > 0 and i <= blocks - resident_units
            read += home * (2 if refetched else 1)
            if u.trainable:
                trainable = u.master_numel * home_element_bytes
                if layout.merged:
                    read += trainable
                if layout.compact_states:  # [Note: compact optimizer states] the high parts, read
                    trainable = u.low_numel * 2  # and written as the padded 16-bit prefix, and each
                    read += trainable + (compact_num_pieces(u) - 1) * PAGE_BYTES  # piece's next page ([Note: compact pieces])
                write += trainable
        if u.trainable and layout.compact_states:
            if layout.state_tier(i) == "nvme":  # the whole compact home, read and written
                read += compact_home_bytes(u, "nvme")
                write += compact_home_bytes(u, "nvme")
        elif u.trainable and layout.state_tier(i) == "nvme":
            state = u.moments_home_numel * FP32_BYTES  # [Note: per-entry state slots]
            if layout.split_master:
                state += u.low_numel * 2
                if layout.compute_tier(i) == "nvme":
                    read += u.low_numel * 2  # the high halves: the compute copy at home
            elif not layout.merged:
                state += u.state_numel * FP32_BYTES
            read += state
            write += state
    planned = host_bytes(units, layout)
    # Gradients pile up (and spill) only where they wait: for the norm (clipping, fp16,
    # skip_nonfinite_steps) or over micro-steps; early updates consume them as backward goes.
    waiting = layout.max_grad_norm is not None or layout.fp16 or layout.skip_nonfinite_steps or \
        layout.accumulation_steps > 1 or not layout.early_allowed
    budget = layout.state_host_budget  # [Note: activation host room]
    if waiting and layout.needs_nvme and budget is not None and planned.total > budget:
        # what budget.gradient_spill leaves beyond its allowance
        spilled = min(planned.gradients, planned.total - budget + spill_floor_bytes(units, layout)
                      - held_shared_bytes(units, layout))
        read += spilled
        write += spilled
    io = read / bandwidth["nvme_read"] + write / bandwidth["nvme_write"]
    if layout.delayed_update:
        return StepPrediction(read, write, io, compute_seconds, 0.0, DELAYED_IO_CPU_FRACTION)
    return StepPrediction(read, write, io, compute_seconds, EXPOSED_IO_FRACTION)
