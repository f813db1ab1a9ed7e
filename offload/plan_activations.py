"""``offload plan --seq-len N --batch B``: the bytes autograd saves in one forward of a model,
per unit, and where ``activation_offload`` would put them, predicted without running it.

The model is built, and one forward of a batch of zeros run, under torch's FakeTensorMode:
tensors with shapes, strides and dtypes but no memory, whose device is the CPU, so that each
op picks the kernel a CPU run picks (on the meta device scaled_dot_product_attention takes
its math path and saves other tensors than on the CPU). The trace groups the saved tensors
as ``ActivationStore`` does ([Note: saved activations] in memory/activations.py): the
root's, then one group per unit call; a unit's tensor inputs go through the engine's own
``hooks.wrap_unit_inputs``, saved views of parameters are references, a tensor saved twice
is one record, records end when autograd drops them. What leaves is decided by the store's
rules: "host" and "nvme" send every complete group away, "auto" the earliest ones while the
kept would pass ``budget.activation_room_bytes``; beyond the host room
(``budget.activation_host_room_bytes``) the earliest in RAM go on to NVMe, and a group larger
than the room even then goes there in pieces ([Note: activation pieces]). The plan also
gives the host RAM the groups take at their peak with no bound on it, and the share of
host_budget (``activation_host_bytes``) that keeps them there ([Note: activation host room]
in memory/budget.py). ``tests/test_plan_activations.py`` checks
each group's bytes and destination against the store's counters of a real forward.

What the trace cannot see, as the store cannot: tensors saved under other saved-tensor
hooks (torch's non-reentrant checkpoint) and those a backward recomputes.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from offload.config import OffloadConfig
from offload.hooks import wrap_unit_inputs
from offload.memory.saved_bytes import (PAGE_BYTES as _PAGE_BYTES, buffer_layout, dense, movable, reach,
                                        same_reading, view_spans)
from offload.memory.budget import (activation_host_room_bytes, activation_room_bytes, check_device_budget,
                                   check_host_budget, model_unit_sizes)
from offload.memory.layout import Layout
from offload.memory.placement import minimum_state_host_bytes, resolve_placement
from offload.units import split_into_units

_CPU = torch.device("cpu")  # the device a plan models where none is given

__all__ = ["GroupPlan", "ActivationPlan", "trace_activations", "plan_activations", "activation_host_share",
           "activation_report"]


@dataclass(frozen=True)
class GroupPlan:
    """One group: a unit call's saved tensors (or the root's, before the first unit), as
    ``stats()["activations"]["units"]`` reports them."""

    unit: str
    saved_bytes: int   # every tensor saved while the group was open, kept or not
    moved_bytes: int   # those that leave the device with the group
    where: str         # "keep" (nothing leaves), "host" or "nvme"


@dataclass(frozen=True)
class ActivationPlan:
    mode: str
    seq_len: int
    batch: int
    room_bytes: Optional[int]  # "auto": what the kept may hold (None: no bound)
    host_room_bytes: Optional[int]  # what the host buffers may hold (None: no host_budget)
    groups: Tuple[GroupPlan, ...]
    host_peak_bytes: int = 0   # the host buffers' peak within host_room_bytes (the store's host_peak_bytes)
    # [Note: activation host room] their peak with no bound on their room: every group that
    # leaves in RAM ("nvme": the two staged), what activation_host_bytes keeps them all there with
    host_needed_bytes: int = 0
    # host_needed_bytes, or less where host_budget cannot hold that beside the engine's least
    # own needs: the activation_host_bytes `offload plan --seq-len` gives a run
    host_share_bytes: int = 0

    @property
    def saved_bytes(self) -> int:
        return sum(g.saved_bytes for g in self.groups)

    def moved_bytes(self, where: str) -> int:
        return sum(g.moved_bytes for g in self.groups if g.where == where)

    @property
    def kept_bytes(self) -> int:
        return self.saved_bytes - self.moved_bytes("host") - self.moved_bytes("nvme")

    def as_json(self) -> Dict[str, Any]:
        """``offload plan --json``'s "activations"."""
        return {"mode": self.mode, "seq_len": self.seq_len, "batch": self.batch, "room_bytes": self.room_bytes,
                "host_room_bytes": self.host_room_bytes, "host_peak_bytes": self.host_peak_bytes,
                "host_needed_bytes": self.host_needed_bytes, "host_share_bytes": self.host_share_bytes,
                "saved_bytes": self.saved_bytes, "kept_bytes": self.kept_bytes,
                "to_host_bytes": self.moved_bytes("host"), "to_nvme_bytes": self.moved_bytes("nvme"),
                "units": [dataclasses.asdict(g) for g in self.groups]}


class _Record:
    __slots__ = ("trace", "num_bytes", "lo", "hi", "dense", "storage", "dtype", "on_device", "tensor", "source",
                 "version", "__weakref__")

    def __init__(self, trace: "_Trace", t: torch.Tensor, storage: Any) -> None:
        self.trace = trace
        self.num_bytes = t.numel() * t.element_size()
        self.lo, self.hi = reach(t)  # as ActivationStore's records: what leaves, by view_spans
        self.dense = dense(t)
        self.storage, self.dtype = storage, t.dtype
        self.on_device = True
        self.tensor: Optional[torch.Tensor] = t.detach()  # held while on the device, as the store's record
        self.source = weakref.ref(t)
        self.version = t._version

    def __del__(self) -> None:
        if self.on_device:
            self.trace.device_bytes -= self.num_bytes


class _Group:
    def __init__(self, unit: str) -> None:
        self.counts = {"unit": unit, "saved_bytes": 0, "moved_bytes": 0, "where": "keep"}
        self.records: List["weakref.ref[_Record]"] = []
        self.num_bytes = 0     # its host buffer
        self.in_ram = False    # its host buffer is held


class _Trace:
    """The store's grouping and decisions over one fake forward ([Note: saved activations])."""

    def __init__(self, mode: str, room_bytes: Optional[int], host_room_bytes: Optional[int], has_nvme: bool,
                 parameter_storages: set, compute_dtype: torch.dtype, plain_type: type) -> None:
        self.mode, self.room_bytes = mode, room_bytes if mode == "auto" else None
        self.host_room_bytes, self.has_nvme = host_room_bytes, has_nvme
        self.host_bytes = 0        # host buffers of groups in RAM, and of "nvme"'s staged one
        self.host_peak_bytes = 0
        self.staged: Optional[_Group] = None
        self.destination = "nvme" if mode == "nvme" else "host"
        self.parameter_storages, self.compute_dtype, self.plain_type = parameter_storages, compute_dtype, plain_type
        self.device_bytes = 0
        self.groups: List[_Group] = [_Group("root")]
        self.resident: List[_Group] = []
        self.seen: Dict[Tuple[Any, ...], "weakref.ref[_Record]"] = {}

    def begin_unit(self, unit: str) -> None:
        previous = self.groups[-1]
        self.groups.append(_Group(unit))
        if self.mode == "auto":
            self.resident.append(previous)
        else:
            self._send_away(previous)

    def pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()._cdata
        if t.dtype == self.compute_dtype and storage in self.parameter_storages:
            return t  # [Note: saved parameters] a reference, not an activation
        key = (storage, t.storage_offset(), tuple(t.size()), t.stride(), t.dtype)
        found = self.seen.get(key)
        record = found() if found is not None else None
        if record is not None and record.version == t._version and \
                (record.source() is t or (record.on_device and same_reading(record.tensor, t))):
            return record  # ActivationStore.pack: the same tensor, or the same bytes still on the device
        num_bytes = t.numel() * t.element_size()
        while self.resident and self.room_bytes is not None and self.device_bytes + num_bytes > self.room_bytes:
            self._send_away(self.resident.pop(0))
        record = _Record(self, t, storage)
        self.device_bytes += num_bytes
        group = self.groups[-1]
        if movable(t, self.plain_type):
            group.records.append(weakref.ref(record))
        group.counts["saved_bytes"] += num_bytes
        self.seen[key] = weakref.ref(record)
        return record

    def _host_fits(self, num_bytes: int) -> bool:
        return self.host_room_bytes is None or self.host_bytes + num_bytes <= self.host_room_bytes

    def _send_away(self, group: _Group) -> None:
        live = [r for r in (ref() for ref in group.records) if r is not None and r.on_device]
        # ActivationStore._spans_of: dense records each, views with gaps by view_spans
        views = [r for r in live if not r.dense]
        spans = [[r] for r in live if r.dense]
        moving = view_spans([(r.storage, r.dtype, r.lo, r.hi, r.num_bytes) for r in views])
        spans += [[views[i] for i in indices] for indices, _, _ in moving]
        records = [r for span in spans for r in span]
        if not records:
            return
        sizes = [r.hi - r.lo for r in live if r.dense] + [hi - lo for _, lo, hi in moving]
        group.num_bytes = buffer_layout(sizes)[1]
        # ActivationStore._make_host_room: the staged write finished, then the earliest
        # groups in RAM on to NVMe
        if not self._host_fits(group.num_bytes):
            self._finish_write()
            while not self._host_fits(group.num_bytes) and self.has_nvme:
                earliest = next((g for g in self.groups if g.counts["where"] == "host" and g.in_ram), None)
                if earliest is None:
                    break
                earliest.in_ram = False
                earliest.counts["where"] = "nvme"
                self.host_bytes -= earliest.num_bytes
            if not self._host_fits(group.num_bytes) and self.has_nvme:
                # [Note: activation pieces] straight to NVMe through what the room has free
                piece = min(group.num_bytes, (self.host_room_bytes - self.host_bytes) // _PAGE_BYTES * _PAGE_BYTES)
                if piece > 0:
                    for r in records:
                        r.on_device, r.tensor = False, None
                        self.device_bytes -= r.num_bytes
                    group.counts.update(moved_bytes=sum(r.num_bytes for r in records), where="nvme")
                    self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes + piece)
                    return
            if not self._host_fits(group.num_bytes):
                raise ValueError(
                    f"host_budget: the saved activations of unit {group.counts['unit']!r} ({group.num_bytes} bytes) "
                    f"do not fit in host RAM beside {self.host_bytes} bytes of activations there, within the "
                    f"{self.host_room_bytes} bytes host_budget leaves beside the engine's plan"
                    + ("" if self.has_nvme else " (set swap_dir so that activations beyond it go on to NVMe)"))
        for r in records:
            r.on_device, r.tensor = False, None
            self.device_bytes -= r.num_bytes
        group.counts.update(moved_bytes=sum(r.num_bytes for r in records), where=self.destination)
        self.host_bytes += group.num_bytes
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
        group.in_ram = True
        if self.destination == "nvme":
            self._finish_write()  # at most two staged: the one before and this one
            self.staged = group

    def _finish_write(self) -> None:
        if self.staged is not None:
            self.staged.in_ram = False
            self.host_bytes -= self.staged.num_bytes
            self.staged = None


def _unpack(saved: Any) -> torch.Tensor:
    raise AssertionError("offload plan's activation trace runs no backward")


def trace_activations(model: nn.Module, units: Sequence[Tuple[str, nn.Module]], forward: Callable[[], Any],
                      mode: str, room_bytes: Optional[int], compute_dtype: torch.dtype,
                      host_room_bytes: Optional[int] = None, has_nvme: bool = False,
                      plain_type: type = torch.Tensor) -> Tuple[Tuple[GroupPlan, ...], int]:
    """The groups of one ``forward()`` of ``model`` (under grad mode, in training mode) whose
    units (name, module; the root excluded) are ``units``, as ``ActivationStore`` in
    ``mode`` ("host", "nvme", "auto") would form and send them (``room_bytes``: "auto"'s
    room on the device; ``host_room_bytes``: the host buffers' room, beyond which the
    earliest groups go on to NVMe where ``has_nvme``, else a ValueError), and the peak of
    their host buffers. Parameters are those of ``compute_dtype`` sharing a storage with
    ``model``'s (the engine's arena views)."""
    parameter_storages = {p.untyped_storage()._cdata for p in model.parameters()}
    trace = _Trace(mode, room_bytes, host_room_bytes, has_nvme, parameter_storages, compute_dtype, plain_type)

    def pre_forward(name: str, module: nn.Module, args: Any) -> Any:
        trace.begin_unit(name)
        return wrap_unit_inputs(args, lambda: None)

    handles = [module.register_forward_pre_hook(lambda m, a, name=name: pre_forward(name, m, a))
               for name, module in units]
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(trace.pack, _unpack):
            output = forward()
        groups = tuple(GroupPlan(**g.counts) for g in trace.groups)
        del output
    finally:
        for h in handles:
            h.remove()
    return groups, trace.host_peak_bytes


def _call_forward(model: nn.Module, tokens: torch.Tensor) -> Any:
    """A training forward of ``tokens`` ([batch, seq_len] token ids): Hugging Face models as
    ``model(input_ids=, labels=)``, others as ``model(tokens, targets)`` when forward takes
    a second argument (offload.gpt.GPT), else ``model(tokens)``."""
    parameters = inspect.signature(model.forward).parameters
    if "input_ids" in parameters:
        return model(input_ids=tokens, labels=tokens) if "labels" in parameters else model(input_ids=tokens)
    positional = [p for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return model(tokens, tokens) if len(positional) >= 2 else model(tokens)


def _factory(spec: str) -> Callable[[], nn.Module]:
    if ":" not in spec:
        raise ValueError(f"--model: expected module:factory (e.g. mypkg.models:build), got {spec!r}")
    module_name, factory_name = spec.split(":", 1)
    try:
        return getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--model: cannot load {spec!r}: {e}") from None


def plan_activations(build: "Callable[[], nn.Module] | str", config: "OffloadConfig | dict", seq_len: int,
                     batch: int, unit_classes: Sequence[str] = (), device: torch.device = _CPU) -> ActivationPlan:
    """[Note: saved activations] What a run of ``config`` (its activation_offload, dtype,
    device_budget, tiers; one process on ``device``, plan.plan_device's: the config's
    device field plays no part) does with the activations of one
    forward of ``batch`` sequences of ``seq_len`` tokens, the model built by ``build()``
    (or ``"module:factory"``) without memory. ValueError for a bad argument, for a config
    wrap refuses, or a model that cannot run without values, and where the run's forward
    would raise one (activations beyond their host room without a swap_dir)."""
    return _plan(build, config, seq_len, batch, unit_classes, bounded=True, device=device)


def activation_host_share(build: "Callable[[], nn.Module] | str", config: "OffloadConfig | dict", seq_len: int,
                          batch: int, unit_classes: Sequence[str] = (), device: torch.device = _CPU) -> int:
    """[Note: activation host room] The activation_host_bytes that keeps the host buffers of
    one forward (as ``plan_activations``) in RAM beside the engine's own host needs:
    their peak with no bound, or as much as host_budget holds beside those needs at their
    least (on ``device``, as plan_activations). ``config``'s own activation_host_bytes plays no part."""
    config = dataclasses.replace(OffloadConfig.from_any(config), activation_host_bytes=None)
    return _plan(build, config, seq_len, batch, unit_classes, bounded=False, device=device).host_share_bytes


def _plan(build: "Callable[[], nn.Module] | str", config: "OffloadConfig | dict", seq_len: int, batch: int,
          unit_classes: Sequence[str], bounded: bool, device: torch.device) -> ActivationPlan:
    """The plan; with ``bounded`` False the groups as if the host room had no bound."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    config = OffloadConfig.from_any(config)
    if config.activation_offload is None:
        raise ValueError("activation_offload: offload plan --seq-len predicts where activations go; "
                         "give 'host', 'nvme' or 'auto'")
    for name, value in (("seq_len", seq_len), ("batch", batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    factory = _factory(build) if isinstance(build, str) else build
    layout_dtype = Layout.resolve(config, device, None).compute_dtype
    with FakeTensorMode():
        try:
            model = factory()
        except Exception as e:  # the user's code: report it as a bad model, not a crash
            raise ValueError(f"--model: building the model without memory failed: {type(e).__name__}: {e}") from None
        if not isinstance(model, nn.Module):
            raise ValueError(f"--model: the factory returned {type(model).__name__}, not an nn.Module")
        for p in model.parameters():
            if p.is_floating_point():  # the engine's compute copies are of the compute dtype
                p.data = p.data.to(layout_dtype)
        model.train()
        element_bytes = torch.empty(0, dtype=layout_dtype).element_size()
        sizes = model_unit_sizes(model, element_bytes, unit_classes or config.unit_classes, config.unit_predicate)
        layout = resolve_placement(config, device, None, sizes)
        room = activation_room_bytes(sizes, layout, check_device_budget(sizes, layout))
        host_room = activation_host_room_bytes(layout, check_host_budget(sizes, layout).total)
        # [Note: activation host room] what host_budget can give the activations at most
        share_cap = None if layout.host_budget is None else \
            max(0, layout.host_budget - minimum_state_host_bytes(config, device, None, sizes))
        # the engine's activations have swap space beyond the host room where swap_dir is set
        # (offload plan without --swap-dir sets a placeholder: it writes nothing)
        from offload.plan import NO_SWAP_DIR
        has_nvme = bool(config.swap_dir) and config.swap_dir != NO_SWAP_DIR
        specs = split_into_units(model, {p: 0 for p in model.parameters() if p.requires_grad}, element_bytes,
                                 unit_classes or config.unit_classes, config.unit_predicate)
        units = [(s.name, s.module) for s in specs if s.module is not None]
        tokens = torch.zeros(batch, seq_len, dtype=torch.long)

        def trace(host_room_bytes: Optional[int]) -> Tuple[Tuple[GroupPlan, ...], int]:
            try:
                return trace_activations(model, units, lambda: _call_forward(model, tokens),
                                         config.activation_offload, room, layout_dtype, host_room_bytes, has_nvme,
                                         plain_type=FakeTensor)
            except ValueError:
                raise
            except Exception as e:
                raise ValueError(f"--model: its forward cannot run without values (under FakeTensorMode): "
                                 f"{type(e).__name__}: {e}") from None

        unbounded, needed = trace(None)
        fits = not bounded or host_room is None or needed <= host_room
        groups, peak = (unbounded, needed) if fits else trace(host_room)
    share = needed if share_cap is None else min(needed, share_cap)
    return ActivationPlan(config.activation_offload, seq_len, batch, room, host_room, groups, peak, needed, share)


def activation_report(plan: ActivationPlan) -> List[str]:
    """The lines `offload plan --seq-len` prints."""
    from offload.config import format_size

    room = "no bound" if plan.room_bytes is None else format_size(plan.room_bytes)
    lines = [f"activations (activation_offload={plan.mode!r}, batch {plan.batch} x {plan.seq_len} tokens"
             + (f", room for those kept on the device {room}" if plan.mode == "auto" else "")
             + (f", host room {format_size(plan.host_room_bytes)}" if plan.host_room_bytes is not None else "")
             + "): saved by one forward, per unit call, root first"]
    width = max(len(g.unit) for g in plan.groups)
    for g in plan.groups:
        lines.append(f"  {g.unit:<{width}}  saved {format_size(g.saved_bytes):>10}  "
                     + (f"-> {g.where} {format_size(g.moved_bytes)}" if g.where != "keep" else "kept"))
    lines.append(f"  total: saved {format_size(plan.saved_bytes)}, kept on the device {format_size(plan.kept_bytes)}, "
                 f"to host {format_size(plan.moved_bytes('host'))}, to NVMe {format_size(plan.moved_bytes('nvme'))}")
    if plan.host_needed_bytes:
        lines.append(f"  in host RAM at once: {format_size(plan.host_peak_bytes)} ({plan.host_peak_bytes} bytes); "
                     f"all of them there would take {plan.host_needed_bytes} bytes: "
                     f"activation_host_bytes={plan.host_share_bytes} keeps "
                     + ("them" if plan.host_share_bytes == plan.host_needed_bytes else "as much as host_budget can")
                     + " beside the engine's own host needs, placement included")
    return lines
