"""``offload plan``: where each piece of training state would live, whether it fits, and how
long an optimizer step would take, for a model and a machine profile.

The bytes of each tier are those wrap checks its budgets against (offload/memory/budget.py),
for one process on the device ``--device`` names (``plan_device``: "auto" is the device wrap
resolves "auto" to; the CPU stand-in of CUDA, OFFLOAD_DEVICE_STANDIN=cuda, plans as CUDA,
as wrap runs there); tests wrap real models and check that the two agree. A
row fits a host budget below its host need as wrap does, down to minimum_host_budget where a
tier is on NVMe ([Note: gradient spill]: the gradients beyond the budget spilled, their
extents added to the swap; ``shortfalls``).
Per trainable parameter, with ``e`` the compute dtype's size (4 for fp32, 2 for bf16/fp16):

  compute copy   e B      home: param_tier. With fp32 compute and param_tier != "device" the
                          compute copy *is* the fp32 master ("merged"): 4 B, no master.
  fp32 master    4 B      home: optimizer_tier (0 when merged; 2 B, its low half, when
                          split: bf16, optimizer_tier "nvme", param_tier not "device")
  Adam moments   8 B      home: optimizer_tier (exp_avg and exp_avg_sq, fp32; another elementwise
                          optimizer: 4 B per state tensor, --optimizer-state-tensors)
  gradients      e B      home: host, as autograd made them ([Note: 16-bit gradients]);
                          4 B with fp32 compute or micro-steps to accumulate, and on a
                          device the host does not address (CUDA: pooled fp32 buffers)

plus, whenever a tier is "nvme", ``optimizer_pipeline_depth`` host staging slots of
4 B x (largest piece of a master: a unit's, at most OPTIMIZER_PIECE_NUMEL unless it is
updated whole) + 4 B x (the state slots the largest piece of an NVMe-homed moments home
moves: the optimizer's slots per element, with per-entry slots their spans, [Note: per-entry
state slots]) (+ e x largest piece of a compute copy when param_tier is "nvme" and not
merged; on CUDA also with param_tier "device" and 16-bit compute), and on CUDA with
param_tier "nvme" ``prefetch_units + 1`` pinned fetch staging buffers of the largest unit's
compute copy at home (budget.fetch_buffer_numels, what wrap allocates). Every buffer is
padded to whole 4 KiB pages. The device holds, with
param_tier="device", every unit's compute copy; otherwise the root unit plus the largest
other unit; in both cases plus one largest parameter's gradient on its way out.

With --optimizer-states compact ([Note: compact optimizer states]; bf16 and Adam only, as
wrap) the master is the bf16 compute copy plus an int8 low part (1 B) and the moments are
8-bit codes with an fp32 scale per block each (2 B + 8 B a block), every parameter padded to
whole blocks, a unit's compact home whole pages on NVMe (budget.unit_home_bytes); the step
reads and writes each NVMe-homed compact home once, in pieces ([Note: compact pieces]), and
reads the high parts from a compute copy on NVMe (a page more a piece boundary); a staging
slot holds one piece of a compact home and its high parts (budget.slot_shape).

[Note: step time model] The predicted time of one optimizer step (one micro-batch) is

  sum over links of (bytes moved on the link per step / the link's bandwidth)
  + trainable parameters / CPU Adam throughput (parameters per second)
  + compute FLOPs / --flops-per-second (only when given; 6 x params x tokens)

with no overlap between the terms, so it is an upper bound of what a perfect prefetcher
would reach (the lower bound is the largest single term; both are printed). Bytes moved per
step: with param_tier != "device" every unit's compute copy is fetched in forward and again
in backward (the root unit once): from NVMe, or host->device; gradients leave the device in
the compute dtype (e B/param device->host); the optimizer reads and writes the fp32 master
and moments that live on NVMe (12 B or 8 B/param each way), writes the new compute copy to
NVMe (e B/param, unless merged) or to the device (param_tier="device", host->device).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from offload._sizes import FP32_BYTES, PAGE_BYTES
from offload.config import OffloadConfig
from offload.memory.budget import (UnitSizes, compact_num_pieces, floor_prefetch_room, host_bytes, minimum_device_budget,
                                   minimum_host_budget, swap_bytes, unit_gradient_bytes, unit_home_bytes)
from offload.memory.compact_codec import BLOCK_NUMEL
from offload.memory.layout import DTYPE_NAMES, Layout
from offload.memory import placement as unit_placement
from offload import plan_shapes
from offload.plan_optimizers import OptimizerLayout, describe
from offload.units import padded_numel

# The machine profile's schema lives with the placement that weighs tiers by it; offload
# profile and the tests reach it here too.
PROFILE_SCHEMA, PROFILE_VERSION = unit_placement.PROFILE_SCHEMA, unit_placement.PROFILE_VERSION
LINKS, DEFAULT_PROFILE = unit_placement.LINKS, unit_placement.DEFAULT_PROFILE
validate_profile, load_profile = unit_placement.validate_profile, unit_placement.load_profile

_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# ---------------------------------------------------------------------------- model shape
# A model's shape as the plan sees it lives in offload.plan_shapes; offload plan's callers
# and the tests reach it here too.
UnitShape, ModelShape = plan_shapes.UnitShape, plan_shapes.ModelShape
shape_from_count, shape_from_model = plan_shapes.shape_from_count, plan_shapes.shape_from_model
shape_from_module = plan_shapes.shape_from_module


# ---------------------------------------------------------------------------- placement
@dataclass(frozen=True)
class Placement:
    """Bytes each tier holds, and bytes moved per optimizer step per link, for one
    (param_tier, optimizer_tier, dtype)."""

    param_tier: str
    optimizer_tier: str
    merged: bool
    device_bytes: int
    host_parts: Dict[str, int]
    nvme_bytes: int
    state_tier: Dict[str, str]          # state -> tier
    state_bytes: Dict[str, int]         # state -> bytes (padded)
    traffic: Dict[str, int]             # link -> bytes per step
    # [Note: gradient spill] the smallest host budget wrap takes (minimum_host_budget: with a
    # tier on NVMe, gradients beyond the budget are spilled), and the gradient extents a
    # spilling run adds to the swap; host_bytes and 0 where none can be spilled
    host_floor_bytes: int = 0
    spill_nvme_bytes: int = 0

    @property
    def host_bytes(self) -> int:
        return sum(self.host_parts.values())


NO_SWAP_DIR = "<offload plan: writes no swap files>"
CPU = torch.device("cpu")
DEVICE_CHOICES = ("auto", "cpu", "cuda")


def plan_device(name: str) -> torch.device:
    """The device ``offload plan --device`` models: "auto" is the one wrap resolves
    device="auto" to on this machine; "cuda" needs no GPU here (a plan for a GPU machine).
    The layout decides what the device takes: on the CPU stand-in of CUDA a "cpu" device
    plans as CUDA, as wrap runs there (``Layout.device_is_host``)."""
    if name not in DEVICE_CHOICES:
        raise ValueError(f"--device: expected one of {', '.join(DEVICE_CHOICES)}, got {name!r}")
    if name == "auto":
        return torch.device(OffloadConfig(device="auto").resolved_device().type)
    return torch.device(name)


def device_is_host(device: torch.device) -> bool:
    """Whether a run on ``device`` computes in host RAM the engine addresses directly (a CPU
    device as users run it), as ``Layout.device_is_host`` says for wrap."""
    return _layout("bf16", "nvme", "nvme", 2, True, device=device).device_is_host


def describe_device(device: torch.device) -> str:
    """What the report says of the device the plan models."""
    if device_is_host(device):
        return f"device: {device.type} (the host's RAM: reads from NVMe land in the device's slots)"
    standin = " (the CPU stand-in of CUDA)" if device.type == "cpu" else ""
    return (f"device: {device.type}{standin}: its host buffers pinned, reads from NVMe through fetch "
            "staging buffers, gradients held in fp32 on the host")


def _layout(dtype: str, param_tier: str, optimizer_tier: str, pipeline_depth: int,
            split_master: bool, optimizer_states: str = "exact", device: torch.device = CPU) -> Layout:
    """The Layout of a run of these settings on ``device`` and one process, the run the
    plan models (on CUDA and its CPU stand-in: fetch staging buffers, pooled fp32
    gradients, staging slots with a compute piece where param_tier is "device")."""
    config = OffloadConfig(device="cpu", dtype=dtype, param_tier=param_tier,
                           optimizer_tier=optimizer_tier, split_master=split_master,
                           optimizer_states=optimizer_states, swap_dir=NO_SWAP_DIR)
    # --pipeline-depth takes 1, which a config refuses (wrap needs two slots): set after it.
    # No host budget: the table sets each configuration's whole need against --host-budget.
    # (The config's device field plays no part in the layout: ``device`` is the device.)
    return dataclasses.replace(Layout.resolve(config, device, None),
                               optimizer_pipeline_depth=pipeline_depth, host_budget=None,
                               host_budget_default=False)


def optimizer_lines(layout: Optional[OptimizerLayout]) -> List[str]:
    """What the report says of --optimizer's state (nothing without it)."""
    if layout is None:
        return []
    names = ", ".join(n for slots in layout.slots for n in slots) or "none"
    side = ", ".join(n for names in layout.side for n in names)
    return [f"optimizer: {layout.name}: {describe(layout.name)}",
            f"  per-element state: {names}; a state home holds up to {layout.state_slots} fp32 "
            f"tensor{'' if layout.state_slots == 1 else 's'} per parameter, each parameter's those its own "
            "optimizer keeps (whole 4 KiB pages of each)"
            + (f"; per parameter in host RAM: {side}" if side else "")
            + ("; updates whole parameters (one piece per unit that holds one)" if layout.whole else "")]


def optimizer_json(layout: OptimizerLayout) -> dict:
    return {"name": layout.name, "description": describe(layout.name), "state_slots": layout.state_slots,
            "classes": list(layout.classes), "slots": [list(s) for s in layout.slots],
            "side": [list(s) for s in layout.side], "whole_step": layout.whole, "state_name": layout.state_name()}


def optimizer_state_name(state_slots: int, optimizer: Optional[OptimizerLayout] = None) -> str:
    """The plan's name for the optimizer's per-parameter state: with --optimizer what its
    optimizers keep, as probed (``OptimizerLayout.state_name``); else Adam's moments, or
    ``state_slots`` fp32 tensors of an optimizer the plan knows by that count alone
    (--optimizer-state-tensors, [Note: elementwise optimizers])."""
    if optimizer is not None:
        return optimizer.state_name()
    return "Adam moments" if state_slots == 2 else f"optimizer state ({state_slots} x fp32)"


# [Note: compact optimizer states] the plan's names of the compact homes' two parts: the int8
# low parts (the master's high part is the bf16 compute copy) and the moments' 8-bit codes
# with an fp32 scale per block each (budget.HomeBytes' master and moments)
COMPACT_MASTER_NAME = "master low parts (int8)"
COMPACT_MOMENTS_NAME = "Adam moments (8-bit)"


def check_optimizer_states(optimizer_states: str, dtype: str, state_slots: int, delayed_update: bool = False,
                           stage: int = 0) -> None:
    """A ValueError naming --optimizer-states where wrap would refuse the states for every
    configuration the plan shows, before anything is planned ([Note: compact optimizer
    states]: wrap's own config checks, check_compact_config; ``stage``: --stage with
    --ranks, refused in the words wrap's ranks are refused with, check_compact_stage; 0 for
    one process, which ignores the stage)."""
    from offload.memory.layout import check_compact_stage
    from offload.optim.compact import check_compact_config

    if optimizer_states != "compact":
        return
    if state_slots != 2:
        raise ValueError(f"--optimizer-states compact: keeps Adam's two moments only, not "
                         f"--optimizer-state-tensors {state_slots} (use --optimizer-states exact)")
    try:
        check_compact_config(OffloadConfig(dtype=dtype, delayed_update=delayed_update,
                                           optimizer_states=optimizer_states))
        check_compact_stage(stage)
    except ValueError as error:
        raise ValueError(f"--optimizer-states compact: {error}") from None


def place(shape: ModelShape, dtype: str, param_tier: str, optimizer_tier: str,
          pipeline_depth: int = 3, split_master: bool = True, state_slots: int = 2,
          optimizer_states: str = "exact", device: torch.device = CPU) -> Placement:
    """``state_slots``: fp32 optimizer state tensors per parameter (Adam's 2; an elementwise
    optimizer's own, 0 for plain SGD: [Note: elementwise optimizers]); ``optimizer_states``
    "compact": [Note: compact optimizer states] (bf16, Adam; check_optimizer_states);
    ``device``: the compute device (``plan_device``). A ValueError where wrap refuses the
    configuration on that device (compact states with param_tier "device" on CUDA)."""
    check_optimizer_states(optimizer_states, dtype, state_slots)
    e = _ELEMENT_BYTES[dtype]
    layout = _layout(dtype, param_tier, optimizer_tier, pipeline_depth, split_master, optimizer_states, device)
    merged = layout.merged
    # [Note: split master] (Config.split_master): the master at home is its low half
    split = layout.split_master
    compact = layout.compact_states
    units = shape.units
    sizes = [dataclasses.replace(u.sizes(e), state_slots=state_slots) for u in units]
    compute_numel = [u.compute_numel for u in sizes]
    master_numel = [u.master_numel for u in sizes]
    home_element = FP32_BYTES if merged else e
    trainable = [u.trainable for u in sizes]

    compute_bytes = sum(n * home_element for n in compute_numel)
    # the homes wrap allocates (budget.unit_home_bytes): the fp32 master (none when merged,
    # its low halves when split; compact: the int8 low parts) and the moments
    homes = [unit_home_bytes(u, layout, i) for i, u in enumerate(sizes)]
    master_bytes = sum(h.master for h in homes)
    moments_bytes = sum(h.moments for h in homes)
    prefix_bytes = sum(u.low_numel * 2 for u in sizes if u.trainable)  # trainable 16-bit prefixes
    grad_bytes = sum(u.trainable_numel for u in units) * layout.grad_element_bytes
    grads = f"{DTYPE_NAMES[layout.grad_dtype]} gradients"  # [Note: 16-bit gradients]

    device_bytes = minimum_device_budget(sizes, param_tier, e)
    device_compute = [n * e for n in compute_numel]
    host = host_bytes(sizes, layout)
    host_parts = host.parts()
    if layout.device_is_host:  # reads from NVMe land in the slots: never any
        del host_parts["fetch staging buffers"]
    if not compact:  # the moments under the name of what the optimizers keep (HostBytes says "Adam moments")
        host_parts = {optimizer_state_name(state_slots, shape.optimizer) if k == "Adam moments" else k: v
                      for k, v in host_parts.items()}
    nvme_bytes = swap_bytes(sizes, layout)

    if compact:
        master_name, moments = COMPACT_MASTER_NAME, COMPACT_MOMENTS_NAME
        master_tier = f"{optimizer_tier} (high part: compute copy)"
    else:
        master_name, moments = "fp32 master", optimizer_state_name(state_slots, shape.optimizer)
        master_tier = "merged with compute copy" if merged else \
            f"{optimizer_tier} (low half; high half: compute copy)" if split else optimizer_tier
    state_tier = {"compute copy": param_tier, grads: "host", master_name: master_tier, moments: optimizer_tier}
    state_bytes = {"compute copy": compute_bytes if param_tier != "device" else sum(device_compute),
                   grads: grad_bytes, master_name: master_bytes, moments: moments_bytes}

    # Traffic per optimizer step ([Note: step time model]).
    traffic = {link: 0 for link in LINKS}
    if param_tier != "device":
        fetched = compute_numel[0] * home_element + 2 * sum(n * home_element for n in compute_numel[1:])
        traffic["nvme_read" if param_tier == "nvme" else "host_to_device"] += fetched
    traffic["device_to_host"] += shape.num_trainable * e
    if compact:  # the whole compact home, read and written; the high parts: the compute copy
        optimizer_io = master_bytes + moments_bytes if optimizer_tier == "nvme" else 0
        if param_tier == "nvme":  # read by the update from the compute copy at home, a page
            # twice at each piece boundary ([Note: compact pieces])
            traffic["nvme_read"] += prefix_bytes + sum((compact_num_pieces(u) - 1) * PAGE_BYTES
                                                       for u in sizes if u.trainable)
    else:
        master_on_nvme = (param_tier == "nvme") if merged else (optimizer_tier == "nvme")
        trainable_master = sum(m for m, t in zip(master_numel, trainable) if t)
        # [Note: per-entry state slots] the staged step moves each home's slots whole
        trainable_moments = sum(u.moments_home_numel for u in sizes if u.trainable)
        optimizer_io = (trainable_master * FP32_BYTES if master_on_nvme and not split else 0) + \
            (trainable_moments * FP32_BYTES if optimizer_tier == "nvme" else 0)
        if split:  # the low halves, and the high ones: the compute copy, read from its home
            optimizer_io += prefix_bytes
            if param_tier == "nvme":
                traffic["nvme_read"] += prefix_bytes
    traffic["nvme_read"] += optimizer_io
    traffic["nvme_write"] += optimizer_io
    if param_tier == "nvme" and not merged:
        traffic["nvme_write"] += sum(padded_numel(u.trainable_numel, e) * e for u in units if u.trainable_numel)
    if param_tier == "device":
        traffic["host_to_device"] += shape.num_trainable * e
    floor = minimum_host_budget(sizes, layout)
    spill = sum(unit_gradient_bytes(u, layout) for u in sizes if u.trainable) if floor < host.total else 0
    return Placement(param_tier, optimizer_tier, merged, device_bytes, host_parts, nvme_bytes,
                     state_tier, state_bytes, traffic, floor, spill)


def auto_placement(shape: ModelShape, config: "OffloadConfig | dict", state_slots: int = 2,
                   device: torch.device = CPU) -> Tuple[unit_placement.Placement, Layout, List[UnitSizes]]:
    """The placement wrap makes under ``config`` (param_tier/optimizer_tier "auto") for a
    model of ``shape``, every parameter trainable, on one process with ``device`` as the
    compute device (``plan_device``; the config's device field plays no part): the
    same function as wrap's ([Note: placement by budget]); with it the Layout and the unit
    sizes (for ``unit_placement.predict_step``). ValueError as wrap raises it."""
    from offload.optim.compact import check_compact_config

    config = OffloadConfig.from_any(config)
    check_compact_config(config)  # [Note: compact optimizer states] wrap's refusals
    if config.optimizer_states == "compact" and state_slots != 2:
        raise ValueError("optimizer_states: 'compact' keeps Adam's two moments only, not "
                         f"{state_slots} fp32 state tensors per parameter")
    e = _ELEMENT_BYTES[config.dtype]
    sizes = [dataclasses.replace(u.sizes(e), state_slots=state_slots) for u in shape.units]
    layout = unit_placement.resolve_placement(config, device, None, sizes)
    return unit_placement.describe_units(sizes, layout), layout, sizes


_HOST_DEFAULT_NOTE = "default: 3/4 of the memory available now, as wrap's"


def auto_plan(shape: ModelShape, config: "OffloadConfig | dict", profile: dict,
              compute_seconds: Optional[float], state_slots: int = 2, device: torch.device = CPU) -> dict:
    """What `offload plan` reports for "auto" (its text and its --json both come from this):
    each unit's tiers, bytes per tier, NVMe bytes per step and the predicted step ([Note:
    step prediction]); ``possible`` False with ``error`` where wrap would refuse the config."""
    config = OffloadConfig.from_any(config)
    settings = {"host_budget": config.host_budget, "host_budget_default": False, "max_grad_norm": config.max_grad_norm,
                "delayed_update": config.delayed_update, "activation_host_bytes": config.activation_host_bytes}
    try:
        placement, layout, sizes = auto_placement(shape, config, state_slots, device)
    except ValueError as error:
        return {"possible": False, "error": str(error), **settings}
    prediction = unit_placement.predict_step(sizes, layout, profile, compute_seconds)
    if prediction.io_cpu_fraction:  # [Note: step prediction] delayed updates
        formula = f"max(compute + {prediction.io_cpu_fraction:g} x I/O, I/O)"
    else:
        formula = f"max(compute, I/O) + {prediction.exposed_fraction:g} x min(compute, I/O)"
    return {"possible": True, "error": None, **settings,
            "host_budget": layout.host_budget, "host_budget_default": layout.host_budget_default,
            "units": [dataclasses.asdict(u) for u in placement.units],
            "bytes_per_tier": placement.bytes_per_tier(),
            "nvme_read_bytes_per_step": prediction.nvme_read_bytes,
            "nvme_write_bytes_per_step": prediction.nvme_write_bytes,
            "io_seconds": prediction.io_seconds, "compute_seconds": compute_seconds,
            "predicted_step_seconds": prediction.seconds, "predicted_step_formula": formula}


def auto_report(auto: dict, host_budget_default: bool = False) -> List[str]:
    """The lines `offload plan` prints for "auto", from ``auto_plan``'s answer
    (``host_budget_default``: the caller took the host budget it gave as wrap's default)."""
    from offload.config import format_size

    if not auto["possible"]:
        return [f"auto placement: not possible: {auto['error']}"]
    budget = auto["host_budget"]
    lines = [f"auto placement (param_tier='auto', optimizer_tier='auto', host budget "
             f"{format_size(budget) if budget is not None else 'none'}"
             f"{' (' + _HOST_DEFAULT_NOTE + ')' if auto['host_budget_default'] or host_budget_default else ''}"
             f"{', max_grad_norm ' + format(auto['max_grad_norm'], 'g') if auto['max_grad_norm'] else ''}"
             f"{', delayed_update' if auto['delayed_update'] else ''}"
             + (f", of it {format_size(auto['activation_host_bytes'])} kept for activations"
                if auto.get("activation_host_bytes") else "") + "): "
             "what wrap places, per unit, root first"]
    placement = unit_placement.Placement(tuple(unit_placement.UnitPlacement(**u) for u in auto["units"]))
    lines += ["  " + line for line in placement.describe()]
    lines.append("  at home: " + ", ".join(f"{tier} {format_size(n)}" for tier, n in auto["bytes_per_tier"].items()))
    lines.append(f"  NVMe per step: read {format_size(auto['nvme_read_bytes_per_step'])}, written "
                 f"{format_size(auto['nvme_write_bytes_per_step'])}: {format_seconds(auto['io_seconds'])} at the "
                 "profile's bandwidths")
    if auto["predicted_step_seconds"] is not None:
        lines.append(f"  predicted step: {format_seconds(auto['predicted_step_seconds'])} (compute "
                     f"{format_seconds(auto['compute_seconds'])}; {auto['predicted_step_formula']})")
    else:
        lines.append("  predicted step: give --compute-seconds (a step with everything in RAM) or "
                     "--flops-per-second for a time including compute")
    return lines


@dataclass(frozen=True)
class Prediction:
    link_seconds: Dict[str, float]
    adam_seconds: float
    compute_seconds: Optional[float]

    @property
    def serial_seconds(self) -> float:
        return sum(self.link_seconds.values()) + self.adam_seconds + (self.compute_seconds or 0.0)

    @property
    def overlap_bound_seconds(self) -> float:
        return max(list(self.link_seconds.values()) + [self.adam_seconds, self.compute_seconds or 0.0])


def predict(placement: Placement, shape: ModelShape, profile: dict,
            flops_per_second: Optional[float], tokens_per_step: int) -> Prediction:
    bandwidth = profile["bandwidth_bytes_per_second"]
    link_seconds = {link: n / bandwidth[link] for link, n in placement.traffic.items() if n}
    adam_seconds = shape.num_trainable / profile["adam_params_per_second"]
    compute = None
    if flops_per_second:
        compute = 6.0 * shape.num_params * tokens_per_step / flops_per_second
    return Prediction(link_seconds, adam_seconds, compute)


CONFIGURATIONS = tuple((p, o) for p in ("device", "host", "nvme") for o in ("host", "nvme"))


def shortfalls(placement: Placement, device_budget: Optional[int], host_budget: Optional[int],
               nvme_budget: Optional[int]) -> List[str]:
    """What does not fit, by how much; empty when everything fits. [Note: gradient spill] A
    host budget below the host need but at least the floor fits by spilling gradients, whose
    extents the swap then holds too (the traffic leaves the spills out)."""
    from offload.config import format_size

    out = []
    host_need, nvme_need, spilled = placement.host_bytes, placement.nvme_bytes, ""
    if host_budget is not None and host_need > host_budget and placement.host_floor_bytes < host_need:
        spilled = f" with gradients spilled to NVMe ({format_size(host_need)} without)"
        host_need, nvme_need = placement.host_floor_bytes, nvme_need + placement.spill_nvme_bytes
    for tier, need, budget, note in (("device", placement.device_bytes, device_budget, ""),
                                     ("host", host_need, host_budget, spilled),
                                     ("nvme", nvme_need, nvme_budget, "")):
        if budget is not None and need > budget:
            out.append(f"{tier} needs {format_size(need)}{note}, budget {format_size(budget)} "
                       f"(short by {format_size(need - budget)})")
    return out


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms"


# ---------------------------------------------------------------------------- report
def _prefetch_room(shape: ModelShape, dtype: str) -> Optional[dict]:
    """[Note: prefetch room] at the smallest device budget of param_tier host or nvme; None
    for a model of fewer than two fetched units."""
    e = _ELEMENT_BYTES[dtype]
    sizes = [u.sizes(e) for u in shape.units]
    floor = minimum_device_budget(sizes, "nvme", e)
    room = floor_prefetch_room(sizes, e, floor)
    if room is None:
        return None
    return {"floor_device_bytes": floor, "units_ahead": room.units_ahead, "unit_bytes": room.unit_bytes,
            "device_budget_for_units_ahead": {k: max(floor, room.budget_for(k)) for k in (1, 2, 4)}}


def state_bytes_per_param(shape: ModelShape, state_slots: int) -> float:
    """Optimizer state bytes per trainable parameter, before page padding: what its optimizer
    keeps for each parameter of a model ([Note: per-entry state slots]) or of the composition
    shape_from_count assumes, or ``state_slots`` fp32 tensors for every parameter where the
    plan knows no optimizer."""
    if shape.optimizer is not None and shape.exact:
        return shape.optimizer.state_bytes_per_param()
    if shape.kept_state_numel is not None:  # synthesized: its assumed parameters' (shape_from_count)
        return shape.kept_state_numel * FP32_BYTES / shape.num_trainable
    return float(state_slots * FP32_BYTES)


def _gradient_element_bytes(dtype: str, device: torch.device) -> int:
    """Bytes per element of the gradients a run of one micro-step per step holds on the host
    ([Note: 16-bit gradients]: the compute dtype where they are adopted, else fp32)."""
    return _layout(dtype, "nvme", "nvme", 2, True, device=device).grad_element_bytes


def _bytes_per_param(element_bytes: int, state_slots: int, optimizer_states: str,
                     state_per_param: Optional[float] = None,
                     gradient_bytes: Optional[int] = None,
                     optimizer: Optional[OptimizerLayout] = None) -> Dict[str, float]:
    """Bytes of each state per trainable parameter, before padding (to pages; compact: each
    parameter to whole blocks). ``state_per_param``: the optimizer state's (default:
    ``state_slots`` fp32 tensors), named after ``optimizer`` where given; ``gradient_bytes``: a
    gradient element's (default: the compute dtype's, ``_gradient_element_bytes`` of a CPU
    device)."""
    grad = element_bytes if gradient_bytes is None else gradient_bytes
    if optimizer_states == "compact":  # [Note: compact optimizer states] two fp32 scales a block
        return {"compute copy": element_bytes, "gradients": grad, COMPACT_MASTER_NAME: 1,
                COMPACT_MOMENTS_NAME: 2 + 2 * FP32_BYTES / BLOCK_NUMEL}
    return {"compute copy": element_bytes, "gradients": grad, "fp32 master": FP32_BYTES,
            optimizer_state_name(state_slots, optimizer): state_slots * FP32_BYTES if state_per_param is None
            else state_per_param}


def as_json(shape: ModelShape, dtype: str, profile: dict, device_budget: Optional[int],
            host_budget: Optional[int], nvme_budget: Optional[int], pipeline_depth: int,
            flops_per_second: Optional[float], tokens_per_step: int, auto: dict,
            host_budget_default: bool = False, state_slots: int = 2, optimizer_states: str = "exact",
            device: torch.device = CPU) -> dict:
    """What `offload plan --json` writes: every number of the text report (``auto``:
    ``auto_plan``'s answer, made under the same host budget). A configuration wrap refuses
    on ``device`` is ``{"param_tier", "optimizer_tier", "fits": False, "refused": why}``."""
    configurations = []
    for param_tier, optimizer_tier in CONFIGURATIONS:
        p = _place_or_refusal(shape, dtype, param_tier, optimizer_tier, pipeline_depth, state_slots,
                              optimizer_states, device)
        if isinstance(p, str):
            configurations.append({"param_tier": param_tier, "optimizer_tier": optimizer_tier, "fits": False,
                                   "refused": p})
            continue
        pred = predict(p, shape, profile, flops_per_second, tokens_per_step)
        configurations.append({
            "param_tier": param_tier, "optimizer_tier": optimizer_tier, "merged": p.merged,
            "device_bytes": p.device_bytes, "host_bytes": p.host_bytes, "host_parts": p.host_parts,
            "host_floor_bytes": p.host_floor_bytes, "spill_nvme_bytes": p.spill_nvme_bytes,
            "nvme_bytes": p.nvme_bytes, "state_tier": p.state_tier, "state_bytes": p.state_bytes,
            "traffic_bytes_per_step": p.traffic,
            "fits": not shortfalls(p, device_budget, host_budget, nvme_budget),
            "shortfalls": shortfalls(p, device_budget, host_budget, nvme_budget),
            "predicted_step_seconds": pred.serial_seconds,
            "predicted_step_seconds_overlapped": pred.overlap_bound_seconds,
            "predicted_link_seconds": pred.link_seconds, "predicted_adam_seconds": pred.adam_seconds,
            "predicted_compute_seconds": pred.compute_seconds})
    e = _ELEMENT_BYTES[dtype]
    return {"model": shape.description, "num_params": shape.num_params, "num_trainable": shape.num_trainable,
            "exact": shape.exact, "dtype": dtype, "optimizer_states": optimizer_states, "device": device.type,
            "device_is_host": device_is_host(device),
            "profile_source": profile.get("source", "measured"),
            "bandwidth_bytes_per_second": dict(profile["bandwidth_bytes_per_second"]),
            "adam_params_per_second": profile["adam_params_per_second"],
            "budgets": {"device": device_budget, "host": host_budget, "nvme": nvme_budget},
            "host_budget_default": host_budget_default,
            "bytes_per_param": _bytes_per_param(e, state_slots, optimizer_states,
                                                state_bytes_per_param(shape, state_slots),
                                                _gradient_element_bytes(dtype, device), shape.optimizer),
            "optimizer": None if shape.optimizer is None else optimizer_json(shape.optimizer),
            "configurations": configurations,
            "any_fits": any(c["fits"] for c in configurations),
            "prefetch": _prefetch_room(shape, dtype),
            "auto": auto}


def _place_or_refusal(shape: ModelShape, dtype: str, param_tier: str, optimizer_tier: str, pipeline_depth: int,
                      state_slots: int, optimizer_states: str, device: torch.device) -> "Placement | str":
    """``place``'s answer for one row of the table, or why wrap refuses the row on
    ``device`` (compact states with param_tier "device" on CUDA)."""
    try:
        return place(shape, dtype, param_tier, optimizer_tier, pipeline_depth, state_slots=state_slots,
                     optimizer_states=optimizer_states, device=device)
    except ValueError as refused:
        return str(refused)


def report(shape: ModelShape, dtype: str, profile: dict, device_budget: Optional[int],
           host_budget: Optional[int], nvme_budget: Optional[int], pipeline_depth: int,
           flops_per_second: Optional[float], tokens_per_step: int,
           host_budget_default: bool = False, state_slots: int = 2,
           optimizer_states: str = "exact", device: torch.device = CPU) -> Tuple[str, bool]:
    """The text `offload plan` prints (the auto placement's lines come from auto_report),
    and whether any configuration fits."""
    from offload.config import format_size

    e = _ELEMENT_BYTES[dtype]
    g = _gradient_element_bytes(dtype, device)
    n = shape.num_trainable
    budgets = [f"{tier} {format_size(b) if b is not None else 'no limit'}"
               for tier, b in (("device", device_budget), ("host", host_budget), ("nvme", nvme_budget))]
    if host_budget_default and host_budget is not None:
        budgets[1] += f" ({_HOST_DEFAULT_NOTE})"
    lines = [f"model: {shape.description}", describe_device(device), f"dtype: {dtype} (compute copy {e} B/param)",
             f"optimizer states: {optimizer_states}",
             f"profile: {profile.get('source', 'measured')}",
             "budgets: " + ", ".join(budgets)] + optimizer_lines(shape.optimizer) + [
             "",
             "bytes per state (per trainable parameter, before 4 KiB page padding):",
             f"  compute copy    {e} B/param   {format_size(shape.num_params * e):>12}"
             "   (4 B and no separate master when fp32 and param_tier != device)",
             f"  gradients       {g} B/param   {format_size(n * g):>12}   (host"
             + ("; 4 B summed over micro-steps)" if g < FP32_BYTES else "; fp32)")]
    if optimizer_states == "compact":  # [Note: compact optimizer states]
        per_param = _bytes_per_param(e, state_slots, optimizer_states)
        low, moments = per_param[COMPACT_MASTER_NAME], per_param[COMPACT_MOMENTS_NAME]
        lines += [f"  master low part {low} B/param   {format_size(n * low):>12}"
                  "   (int8, optimizer_states compact: the high part is the bf16 compute copy)",
                  f"  Adam moments    {moments:.2f} B/param{format_size(int(n * moments)):>12}"
                  f"   (8-bit codes, an fp32 scale per {BLOCK_NUMEL} elements each; every parameter "
                  "padded to whole blocks)",
                  "  (compact with param_tier device: only where the device is the host, a CPU run; "
                  "an accelerator's is refused at wrap)"]
    else:
        per_param = state_bytes_per_param(shape, state_slots)  # [Note: per-entry state slots]
        lines += [f"  fp32 master     4 B/param   {format_size(n * 4):>12}" +
                  ("   (2 B, its low half, with optimizer_tier nvme: split_master)" if dtype == "bf16" else ""),
                  f"  {optimizer_state_name(state_slots, shape.optimizer) if shape.optimizer is not None or state_slots == 2 else 'optimizer state':<15} "
                  f"{per_param:g} B/param   {format_size(int(n * per_param)):>12}"
                  + ("   (each parameter's own optimizer's tensors)" if per_param != state_slots * 4 else "")]
    lines.append("")
    header = (f"{'param_tier':<11}{'opt_tier':<9}{'device':>12}{'host':>12}{'nvme':>12}  "
              f"{'fits':<5}{'step (serial)':>14}{'(overlap)':>11}  placement")
    lines.append(header)
    lines.append("-" * len(header))
    any_fits = False
    missing: List[str] = []
    placements = {}
    for param_tier, optimizer_tier in CONFIGURATIONS:
        p = _place_or_refusal(shape, dtype, param_tier, optimizer_tier, pipeline_depth, state_slots,
                              optimizer_states, device)
        if isinstance(p, str):
            lines.append(f"{param_tier:<11}{optimizer_tier:<9}refused: {p}")
            continue
        placements[param_tier, optimizer_tier] = p
        short = shortfalls(p, device_budget, host_budget, nvme_budget)
        fits = not short
        any_fits = any_fits or fits
        pred = predict(p, shape, profile, flops_per_second, tokens_per_step)
        where = ", ".join(f"{k}: {v}" for k, v in p.state_tier.items())
        lines.append(f"{param_tier:<11}{optimizer_tier:<9}{format_size(p.device_bytes):>12}"
                     f"{format_size(p.host_bytes):>12}{format_size(p.nvme_bytes):>12}  "
                     f"{'yes' if fits else 'NO':<5}{format_seconds(pred.serial_seconds):>14}"
                     f"{format_seconds(pred.overlap_bound_seconds):>11}  {where}")
        if short:
            missing.append(f"  {param_tier}/{optimizer_tier}: " + "; ".join(short))
    room = _prefetch_room(shape, dtype)
    if room is not None:  # [Note: prefetch room]
        ahead = room["units_ahead"]
        lines += ["", f"prefetch: the smallest device budget of param_tier host or nvme "
                      f"({format_size(room['floor_device_bytes'])}) leaves room for {ahead} "
                      f"unit{'' if ahead == 1 else 's'} ahead of the one in use; "
                      + ", ".join(f"{format_size(b)} for {k}" for k, b in room["device_budget_for_units_ahead"].items())
                      + f" (units of the median size, {format_size(room['unit_bytes'])})"]
    lines += ["", "bytes moved per optimizer step (one micro-batch):"]
    for (param_tier, optimizer_tier), p in placements.items():
        moved = ", ".join(f"{link} {format_size(b)}" for link, b in p.traffic.items() if b)
        lines.append(f"  {param_tier}/{optimizer_tier}: {moved}")
    bw = profile["bandwidth_bytes_per_second"]
    lines += ["",
              "step time model: sum over links of (bytes moved per step / link bandwidth) + "
              "trainable params / CPU Adam throughput"
              + (" + 6 x params x tokens / --flops-per-second" if flops_per_second else
                 "; compute not modelled (give --flops-per-second)")
              + ". 'serial' assumes no overlap (upper bound); 'overlap' is the largest single "
              "term (lower bound). Every unit is assumed fetched in forward and again in backward.",
              "bandwidths used: " + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in bw.items())
              + f", Adam {profile['adam_params_per_second'] / 1e6:.0f} M params/s"]
    if not any_fits:
        lines += ["", "NOTHING FITS. What is missing, per configuration:"] + missing
    elif missing:
        lines += ["", "configurations that do not fit:"] + missing
    return "\n".join(lines), any_fits
