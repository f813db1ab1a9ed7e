"""The tensors autograd saves in forward (activations), moved off the device between a unit's
forward and its backward (``OffloadConfig(activation_offload=...)``).

[Note: saved activations] With activation_offload set, the saved-tensor hooks of a forward
(hooks.py; parameters are references already, [Note: saved parameters]) hand every other
saved tensor on the engine's device to ``ActivationStore.pack``, which keeps it in a record
(``SavedActivation``) that autograd holds in its place:

- Groups. A forward's saved tensors fall into groups in the order they are saved: the
  root's (before the first unit's forward starts), then one per unit call, holding what
  that unit saves and what the model saves after it until the next unit's forward starts
  (a reentrant checkpoint's inputs, which torch saves once the checkpointed unit has run,
  fall into that unit's group). When a unit's forward starts, the group before it is
  complete and leaves the device: "host" copies it into one host buffer (page-locked on
  CUDA, through the device-to-host stream), "nvme" copies it into a host buffer and
  writes that to a swap extent (the host buffer is let go once the write is done, at the
  latest when the next group leaves: at most two groups are staged on the host). The last
  group of a forward stays on the device: its backward comes first.
- "auto": a complete group leaves only when a saved tensor would take the activations kept
  past their room, ``activation_room_bytes`` (memory/budget.py): the device arena less the
  compute copies wrap's budget check guarantees (every unit with param_tier "device", else
  the root and the largest other unit); the earliest groups of the forward first (backward
  needs them last), to host RAM. The rule reads sizes only, never what the residency
  happens to hold, so that ``offload plan`` predicts it from a meta-device trace
  (offload/plan_activations.py). With device_budget None (no limit) nothing moves; with a
  budget that holds everything, nothing moves either.
- Spans. What leaves is storage bytes, copied as they lie, so that a tensor comes back with
  its strides and every backward kernel sees the same layout, bit for bit: a dense tensor
  its own bytes; the tensors with gaps of one storage and dtype in a group (the GPT's q, k
  and v, views into one fused projection's output) together, once, as the span from the
  least to the most byte they reach, where that span holds no more bytes than they do
  (``view_spans``); they come back as views of one fresh storage, each at its own offset
  in it (``Span``). ``views_moved_bytes`` counts those spans' bytes.
- What stays. Tensors under ``ACTIVATION_MIN_BYTES`` (their bookkeeping costs more than
  their bytes), tensors with gaps whose span holds bytes none of them reads (one view of
  a larger storage, an expanded tensor among others: moving the span would move more than
  they hold and free nothing the rest of the storage keeps; ``views_kept_bytes``), tensors
  of a subclass or another device, and the last group. They are counted as kept.
- Once. A tensor saved twice (by two ops, or by one unit and again by the next) is one
  record while it lives: found again by its storage, offset, shape, strides and version
  and checked to be the same tensor (a weak reference), never by ``id``. So is another
  tensor object over the same bytes (the same storage, offset, shape, strides and dtype,
  its version unchanged: views share their base's counter; not a lazy conjugate or
  negation of it: ``same_reading``) while the first record still
  holds its tensor on the device, which keeps that storage alive so that its address
  names no other (each Linear of q, k and v saves its own 2-D view of one input). Views
  of one storage that differ in offset, shape or strides are copied each.
- Back. When a unit's backward starts (``Hooks._pre_backward``), its own group and the one
  before it in this forward's order come back (the next one backward needs, one group
  ahead, as the parameter prefetcher does from the recorded trace): host buffers copied
  into fresh device tensors on the copy stream, swap extents read first. A record unpacked
  before its group came back brings the whole group back then (the ops between two units
  run their backward before the next unit's hook fires; a recompute of a checkpoint). The
  bytes come back exactly as they left.
- Accounting. ``DeviceTier.activation_bytes`` counts every saved tensor a record holds on
  the device, from its pack to its leaving or to the record's end (autograd drops a record
  once the backward that used it has run, or with the graph); slots and activations share
  the arena's capacity (``DeviceTier.allocate``). A saved tensor that does not fit first
  evicts compute copies not in use (``DeviceResidency.evict_one``: those fetched ahead,
  fetched again when needed; a prefetch in flight lands first, and a fetch that finds the
  rest taken by activations does the same); one that does not fit even then (with "auto", after the
  earlier groups have left) is a RuntimeError naming device_budget, the unit and the
  bytes. Host buffers are counted by the host tier as unplanned bytes (their
  size is known only once a forward has run) and held within the host room,
  ``budget.activation_host_room_bytes``: host_budget less what wrap planned, at least the
  activations' share, activation_host_bytes ([Note: activation host room] in budget.py).
  A group that would pass it first waits for the swap writes in flight,
  then the earliest groups of the forward in host RAM are written on to NVMe (the store has
  an NVMe tier wherever swap_dir is set, whatever the mode), so within a forward the groups
  on NVMe come before those in RAM and backward reads them back once the later ones have
  let go of their buffers; a group that does not fit even so goes to NVMe in pieces through
  what the room has free ([Note: activation pieces]), and without a swap_dir is a ValueError
  naming host_budget, before it moves. "nvme" stages at most two groups there. So host_budget bounds the
  activations too, and on a CPU device ([Note: device pages follow the slots] in
  tiers/device.py) the process's RAM adds up to host_budget + device_budget + the runtime's
  own. Swap extents come from an NVMe tier of the store's own
  (``ActivationStore.nvme``: its I/O counters are the activations' alone) and are reused
  (the smallest free one that holds a group), so the swap space grows with the most bytes
  away at once, not with the number of steps or of batch shapes.
- Cycles. A record holds its tensor detached (same bytes, version counter and conj/neg
  bits, no grad_fn): a saved output's grad_fn is the node that holds the record, a cycle
  through autograd's C++ graph that Python's collector cannot see, so a graph dropped
  without backward (an evaluation under grad mode, a forward that raised) would keep its
  records, their device bytes and host buffers, for good. Autograd rebuilds the unpacked
  tensor's grad_fn itself, as for the fresh tensors a group comes back as.
- Failures. A swap read that fails raises an OSError naming the unit and the swap file
  from the unpack, inside backward: the engine's rule for a failed backward applies
  (``Engine.backward``, [Note: failures inside a step]).

What is not seen: tensors saved under other saved-tensor hooks (torch's non-reentrant
checkpoint keeps its inputs in its own closure and recomputes the rest) stay where the
model put them, uncounted; tensors a backward recomputes are not packed (the forward's
hooks are gone by then).
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, Tuple

import torch

from offload.config import format_size
from offload.errors import warn_at_caller
from offload.io.swap import Extent
from offload.memory.layout import sub_extent
from offload.memory.saved_bytes import (ACTIVATION_MIN_BYTES, PAGE_BYTES, Span, buffer_layout, dense, movable, reach,
                                        same_reading, view_spans)
from offload.tiers import NvmeTier

if TYPE_CHECKING:
    from offload.tiers.context import TierContext

# buffer_layout .. PAGE_BYTES: from memory/saved_bytes.py, where offload plan takes them too
__all__ = ["ActivationStore", "SavedActivation", "buffer_layout", "dense", "movable", "reach", "same_reading",
           "view_spans", "ACTIVATION_MIN_BYTES", "ACTIVATIONS_SWAP_SUBDIR", "PAGE_BYTES"]

# "nvme": the store's swap space lives in this directory under swap_dir (or under a rank's
# directory in it), beside the engine's own run directory: one directory holds one run's lock.
ACTIVATIONS_SWAP_SUBDIR = "activations"


# [Note: activation pieces] A group whose host buffer does not fit in the host room (even
# once the earlier groups in RAM went on to NVMe) goes to its swap extent in pieces through
# one buffer of what the room has free, whole pages, at most the group (``_piece_bytes``): each
# piece's bytes copied off the device, written, then the next; backward reads it back the
# same way into fresh device tensors, at its first unpack (never ahead: ahead of need only
# whole groups that fit move). The extent holds the same bytes at the same offsets as a whole
# group's buffer would, so the tensors come back bit for bit. Where activations may reach
# NVMe, Layout keeps at least ACTIVATION_PIECE_BYTES of host_budget for them whatever "auto"
# placement takes ([Note: activation host room] in memory/budget.py), so no forward stops for
# want of host room after wrap accepted the config; ``offload plan`` mirrors the rule
# (plan_activations). Slower than whole groups (each piece waits for its copy and its I/O),
# it is the fallback, not the way: activation_host_bytes keeps whole groups in RAM.


class Evictor(Protocol):
    """What makes room on the device for saved activations: DeviceResidency."""

    def evict_one(self) -> bool:
        """Drop one unit's device copy that is not in use; False when there is none."""


# A group's states and the moves between them (``_Group.to`` checks each).
_GROUP_MOVES = {
    "open": ("host", "nvme", "back"),  # on the device, filling or the last; "back": nothing to move
    "host": ("returning", "nvme"),     # in its host buffer; "nvme": written on for room in RAM
    "nvme": ("returning", "failed"),   # in its swap extent; "failed": the write did not complete
    "returning": ("back", "nvme"),     # on its way back; "nvme": the read failed, read again at the next unpack
    "back": (),                        # on the device again, its buffer and extent let go
    "failed": (),                      # nothing holds its bytes: its graph cannot run backward
}


class _Group:
    """The saved tensors of one unit call (or the root's), moved together (``state``: a
    key of ``_GROUP_MOVES``)."""

    def __init__(self, store: "ActivationStore", unit_name: str) -> None:
        self.store = store
        self.unit_name = unit_name
        self.records: List["weakref.ref[SavedActivation]"] = []
        self.spans: List["Span"] = []  # what left, as laid out in its host buffer and extent
        self.state = "open"
        self.host_buffer: Optional[torch.Tensor] = None
        self.extent: Optional[Extent] = None
        self.num_bytes = 0       # host buffer and extent size
        self.read: Any = None    # the swap read in flight ("nvme", coming back)
        self.return_started = 0.0
        self.event: Any = None   # the last copy of its way back
        self.counts: Dict[str, Any] = {}  # its entry of the pass's per-group counters

    def to(self, state: str) -> None:
        assert state in _GROUP_MOVES[self.state], f"activations of {self.unit_name}: {self.state} -> {state}"
        self.state = state

    def live(self) -> List["SavedActivation"]:
        return [r for r in (ref() for ref in self.records) if r is not None]

    def away(self) -> List["Span"]:
        """Its spans with a live record still away."""
        return [span for span in self.spans if span.away()]

    def __del__(self) -> None:
        # Every record is gone (the graph was dropped, or backward used them all); a group
        # whose write is in flight is held by the store until the write is done.
        self.store._let_go(self)


class SavedActivation:
    """What autograd holds for one saved tensor ([Note: saved activations])."""

    __slots__ = ("store", "group", "size", "stride", "dtype", "numel", "num_bytes", "lo", "hi", "dense",
                 "storage", "tensor", "source", "version", "__weakref__")

    def __init__(self, store: "ActivationStore", t: torch.Tensor, group: Optional[_Group]) -> None:
        self.store = store
        self.group = group       # None: kept on the device whatever happens
        self.size, self.stride, self.dtype = t.size(), t.stride(), t.dtype
        self.numel = t.numel()
        self.num_bytes = t.numel() * t.element_size()
        self.lo, self.hi = reach(t)  # the storage bytes it reaches
        self.dense = dense(t)
        self.storage = t.untyped_storage().data_ptr()  # while the record holds ``tensor``
        # on the device (as saved, or back), None while away; detached ([Note: saved activations], cycles)
        self.tensor: Optional[torch.Tensor] = t.detach()
        self.source = weakref.ref(t)
        self.version = t._version

    def __del__(self) -> None:
        if self.tensor is not None:
            self.store._dropped(self.num_bytes)


class ActivationStore:
    """[Note: saved activations] The saved tensors of forward passes under grad mode, for
    activation_offload "host", "nvme" or "auto" (``mode``; None: ``pack`` returns every
    tensor as it is). Main thread, except that a record may end on the thread where autograd drops it."""

    def __init__(self, mode: Optional[str], *, tiers: "TierContext",
                 nvme: Optional[NvmeTier], room_bytes: Optional[int] = None,
                 host_room_bytes: Optional[int] = None, warn_room_spill: bool = False,
                 remove_dir: Optional[str] = None) -> None:
        """``tiers``: the engine's device and host tiers and its timeline (the store's NVMe
        tier is ``nvme``). ``room_bytes``: "auto"'s bound on the activations kept on the device
        (``budget.activation_room_bytes``; None: no bound). ``host_room_bytes``: what the
        host buffers may hold (``budget.activation_host_room_bytes``; None: no bound).
        ``warn_room_spill``: no activation_host_bytes was set, so the first forward whose
        groups go on to NVMe for want of host room warns, once ([Note: activation host
        room] in budget.py: without a share "auto" placement may take that room).
        ``nvme``: the store's own NVMe tier, for "nvme" and, where swap_dir is set, for
        groups beyond the host room. ``remove_dir``: the directory
        made for ``nvme``'s swap space, removed (when empty) at close."""
        assert mode in (None, "host", "nvme", "auto") and (nvme is not None or mode != "nvme")
        self.mode = mode
        # where a group that leaves goes: "auto" moves groups to the host only as needed
        self._destination = "nvme" if mode == "nvme" else "host"
        self._room_bytes = room_bytes if mode == "auto" else None
        self._host_room_bytes = host_room_bytes
        self._warn_room_spill = warn_room_spill
        self._device = tiers.device
        self.host = tiers.host
        self.nvme = nvme  # the store's own: its counters are the activations' bytes
        self._remove_dir = remove_dir
        self._timeline = tiers.timeline  # the "activations" lane: each group's way out and back
        self._evictor: Optional[Evictor] = None
        self._lock = threading.RLock()  # records end on whichever thread drops them
        # free swap extents, reused (the smallest that holds a group), so that the swap space
        # grows only with the most bytes ever away at once, whatever the shapes of the batches
        self._free_extents: List[Extent] = []
        # the forward open now
        self._open = False
        self._current: Optional[_Group] = None
        self._groups: List["weakref.ref[_Group]"] = []  # this forward's, in order
        self._unit_groups: Dict[str, List[int]] = {}    # unit name -> its groups' indices, backward pops
        self._seen: Dict[Tuple[Any, ...], "weakref.ref[SavedActivation]"] = {}
        self._staged: List[Tuple[_Group, Any]] = []     # "nvme": groups whose write is in flight
        self._resident: List[_Group] = []  # "auto": this forward's complete groups still on the device, in order
        # [Note: streams] the last copy out of the device: copies back wait for it, so that
        # they read a host buffer after the copies that filled it (or an earlier one there)
        self._last_sent: Any = None
        # counters ([Note: saved activations]; Engine.stats()["activations"])
        self._pass_packed = 0
        self._pass_moved = {"host": 0, "nvme": 0}
        self._pass_written_on: List[Tuple[str, int]] = []  # (unit, bytes) gone on to NVMe for host room
        self.last_pass = {"kept_bytes": 0, "to_host_bytes": 0, "to_nvme_bytes": 0}
        # per group of the forward open now, in order: {"unit", "saved_bytes", "moved_bytes",
        # "where": "keep" | "host" | "nvme"}; the last one's, once it is over (what
        # ``offload plan`` predicts: offload/plan_activations.py)
        self._pass_units: List[Dict[str, Any]] = []
        self.last_pass_units: List[Dict[str, Any]] = []
        self.moved_bytes = {"host": 0, "nvme": 0}
        # views with gaps ([Note: saved activations], view_spans): the span bytes that left
        # since wrap, and the bytes of those the last forward kept (no span of theirs left)
        self.views_moved_bytes = 0
        self._pass_views_kept = 0
        self.views_kept_bytes = 0
        self.returned_bytes = 0
        self.written_bytes = 0  # to swap: the groups' buffers, whole pages
        self.host_bytes = 0
        self.host_peak_bytes = 0
        self.nvme_bytes = 0
        self.nvme_peak_bytes = 0
        self.closed = False

    def connect(self, evictor: Evictor) -> None:
        """The device residency, once it is built (after this store)."""
        self._evictor = evictor

    @property
    def enabled(self) -> bool:
        return self.mode is not None

    # ------------------------------------------------------------------ forward
    def begin_pass(self) -> None:
        """A forward under grad mode starts: the root's group opens."""
        if not self.enabled:
            return
        self._open = True
        self._groups, self._unit_groups, self._seen, self._resident = [], {}, {}, []
        self._pass_packed, self._pass_moved = 0, {"host": 0, "nvme": 0}
        self._pass_units, self._pass_written_on = [], []
        self._pass_views_kept = 0
        self._current = self._new_group("root")

    def begin_unit(self, unit_name: str) -> None:
        """A unit's forward starts: the group before it is complete and leaves the device."""
        if not self._open:
            return
        previous, self._current = self._current, self._new_group(unit_name)
        if self.mode == "auto":
            self._resident.append(previous)  # leaves only when room is needed
        else:
            self._send_away(previous)

    def end_pass(self, abandoned: bool = False) -> None:
        """The forward is over (or ``abandoned``: it raised, and warns of nothing): its last
        group stays on the device."""
        if not self._open:
            return
        self._open = False
        self._current = None
        self._seen, self._resident = {}, []
        self._finish_writes()
        moved = self._pass_moved
        self.last_pass = {"kept_bytes": self._pass_packed - moved["host"] - moved["nvme"],
                          "to_host_bytes": moved["host"], "to_nvme_bytes": moved["nvme"]}
        self.last_pass_units = self._pass_units
        self.views_kept_bytes = self._pass_views_kept
        if self._pass_written_on and self._warn_room_spill and not abandoned:
            self._warn_room_spill = False  # once
            self._warn_written_on()

    def _warn_written_on(self) -> None:
        """[Note: activation host room] This forward's groups that went to NVMe for want of
        host room, with no activation_host_bytes set: say so, naming the setting."""
        moved = sum(num_bytes for _, num_bytes in self._pass_written_on)
        units = ", ".join(repr(unit) for unit, _ in self._pass_written_on[:4]) + \
            (", ..." if len(self._pass_written_on) > 4 else "")
        warn_at_caller(
            f"offload: {moved} bytes of this forward's saved activations ({format_size(moved)}, of units {units}) "
            f"went to NVMe because host RAM had no room for them: host_budget left the activations "
            f"{self._host_room_bytes} bytes beside the engine's own host needs, which 'auto' placement fills "
            "with states, and activation_host_bytes (the activations' share of host_budget) is not set. Set "
            "activation_host_bytes to keep them in RAM (offload plan --model M --seq-len N --batch B prints the "
            "bytes one forward needs), or raise host_budget. Warned once.")

    def _new_group(self, unit_name: str) -> _Group:
        group = _Group(self, unit_name)
        group.counts = {"unit": unit_name, "saved_bytes": 0, "moved_bytes": 0, "where": "keep"}
        self._pass_units.append(group.counts)
        self._unit_groups.setdefault(unit_name, []).append(len(self._groups))
        self._groups.append(weakref.ref(group))
        return group

    def pack(self, t: torch.Tensor) -> Any:
        """A saved tensor of the open forward: its record (or ``t`` itself, where the store
        is off or ``t`` is not on the device)."""
        if not self._open or t.device != self._device.device:
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.size()), t.stride(), t.dtype)
        found = self._seen.get(key)
        record = found() if found is not None else None
        if record is not None and record.version == t._version and \
                (record.source() is t or (record.tensor is not None and same_reading(record.tensor, t))):
            return record  # [Note: saved activations] once
        group = self._current if movable(t) else None
        self._hold(t.numel() * t.element_size(), self._current.unit_name)
        record = SavedActivation(self, t, group)
        if group is not None:
            group.records.append(weakref.ref(record))
        self._pass_packed += record.num_bytes
        self._pass_units[-1]["saved_bytes"] += record.num_bytes
        self._seen[key] = weakref.ref(record)
        return record

    def _hold(self, num_bytes: int, unit_name: str) -> None:
        self._make_room(num_bytes, unit_name)
        with self._lock:
            self._device.hold_activations(num_bytes)

    def _make_room(self, num_bytes: int, unit_name: str) -> None:
        """Room for ``num_bytes`` more on the device, or a RuntimeError naming device_budget
        before anything changed."""
        # "auto": the earliest complete groups leave first (backward needs them last) while the
        # kept would pass their room; then compute copies not in use make room (fetched
        # ahead: they are fetched again when needed)
        while self._resident and self._room_bytes is not None \
                and self._device.activation_bytes + num_bytes > self._room_bytes:
            self._send_away(self._resident.pop(0))
        while not self._device.activations_fit(num_bytes) and self._evictor is not None \
                and self._evictor.evict_one():
            pass
        if not self._device.activations_fit(num_bytes):
            device = self._device
            raise RuntimeError(
                f"device_budget: the saved activations of unit {unit_name!r} do not fit: {num_bytes} bytes "
                f"more beside {device.activation_bytes} bytes of activations and {device.slot_bytes} bytes of "
                f"compute copies, within {device.capacity_bytes} bytes (device_budget "
                f"{device.budget_bytes} less the reserve for gradients, with every unit not in use "
                "evicted); raise device_budget or make the units smaller")

    def _dropped(self, num_bytes: int) -> None:
        """A record on the device ended (or left): its bytes are free."""
        with self._lock:
            self._device.drop_activations(num_bytes)

    def _send_away(self, group: _Group) -> None:
        """[Note: saved activations] Copy ``group`` off the device ("host", "nvme")."""
        group.spans = self._spans_of([r for r in group.live() if r.tensor is not None])
        if not group.spans:
            group.to("back")
            return
        offsets, group.num_bytes = buffer_layout([span.num_bytes for span in group.spans])
        for span, offset in zip(group.spans, offsets):
            span.offset = offset
        if not self._make_host_room(group):  # a ValueError naming host_budget before anything moved
            self._send_in_pieces(group)
            return
        started = time.perf_counter()
        buffer = self._host_buffer(group.num_bytes)
        event, moved = None, 0
        for span in group.spans:
            records = [r for r in (ref() for ref in span.records) if r is not None]
            event = self._device.streams.copy_out(self._view(buffer, span), span.source(records[0]),
                                                  what=f"activations of {group.unit_name}")
            moved += self._left(records)
        group.counts.update(moved_bytes=moved, where=self._destination)
        self._pass_moved[self._destination] += moved
        self.moved_bytes[self._destination] += moved
        group.host_buffer, group.event = buffer, event
        self._last_sent = event
        group.to(self._destination)
        if self._destination == "nvme":
            self._finish_writes()  # at most two groups staged: the one before and this one
            group.extent = self._take_extent(group.num_bytes)
            event.synchronize()  # the host buffer holds the bytes
            self._staged.append((group, self.nvme.write(buffer, sub_extent(group.extent, 0, group.num_bytes),
                                                        unit=group.unit_name)))
            self._count_nvme(group.num_bytes)
        self._timeline.span("activations", f"out {group.unit_name} ({moved >> 10} KiB)", started,
                            time.perf_counter())

    def _spans_of(self, records: List[SavedActivation]) -> List[Span]:
        """[Note: saved activations] What of a group's ``records`` on the device leaves: each
        dense one as its own span, the views with gaps by ``view_spans`` (the others stay,
        counted in ``views_kept_bytes``)."""
        spans = [Span([r], r.lo, r.hi) for r in records if r.dense]
        views = [r for r in records if not r.dense]
        moving = view_spans([(r.storage, r.dtype, r.lo, r.hi, r.num_bytes) for r in views])
        for indices, lo, hi in moving:
            spans.append(Span([views[i] for i in indices], lo, hi))
            self.views_moved_bytes += hi - lo
        staying = set(range(len(views))) - {i for indices, _, _ in moving for i in indices}
        self._pass_views_kept += sum(views[i].num_bytes for i in staying)
        return spans

    def _left(self, records: List[SavedActivation]) -> int:
        """``records``' tensors have left the device: their bytes, now free there."""
        for r in records:
            r.tensor = None
            self._dropped(r.num_bytes)
        return sum(r.num_bytes for r in records)

    def _host_fits(self, num_bytes: int) -> bool:
        return self._host_room_bytes is None or self.host_bytes + num_bytes <= self._host_room_bytes

    def _make_host_room(self, group: _Group) -> bool:
        """[Note: saved activations] Room in the host room for ``group``'s buffer: the swap
        writes in flight finished, then the earliest groups of this forward in host RAM
        written on to NVMe (where the store has an NVMe tier: swap_dir). False where even
        then only a piece fits (it goes to NVMe in pieces, ``_send_in_pieces``); else a
        ValueError naming host_budget."""
        if self._host_fits(group.num_bytes):
            return True
        self._finish_writes()
        while not self._host_fits(group.num_bytes) and self.nvme is not None:
            earliest = next((g for g in (ref() for ref in self._groups)
                             if g is not None and g is not group and g.state == "host"), None)
            if earliest is None:
                break
            self._write_on(earliest)
        if self._host_fits(group.num_bytes):
            return True
        if self.nvme is not None and self._piece_bytes(group.num_bytes) > 0:
            return False
        raise ValueError(
            f"host_budget: the saved activations of unit {group.unit_name!r} ({group.num_bytes} bytes) do not "
            f"fit in host RAM beside {self.host_bytes} bytes of activations there, within the "
            f"{self._host_room_bytes} bytes host_budget leaves beside the engine's plan; raise host_budget "
            "or activation_host_bytes, the activations' share of it, which 'auto' placement leaves free "
            "(offload plan --seq-len prints what a forward needs)"
            + (" (not a page of it is free for their pieces on the way to NVMe)"
               if self.nvme is not None else
               ", or set swap_dir so that activations beyond it go on to NVMe"))

    def _piece_bytes(self, num_bytes: int) -> int:
        """[Note: activation pieces] The bytes of a group of ``num_bytes`` moved at once
        through host RAM: what the room has free, in whole pages, at most the group."""
        free = self._host_room_bytes - self.host_bytes
        return min(num_bytes, free // PAGE_BYTES * PAGE_BYTES)

    @staticmethod
    def _overlaps(spans: List[Span], start: int, end: int):
        """[Note: activation pieces] (index, span, [lo, hi) of its bytes) of each span whose
        bytes in the group's layout overlap [start, end)."""
        for i, span in enumerate(spans):
            lo, hi = max(start, span.offset), min(end, span.offset + span.num_bytes)
            if lo < hi:
                yield i, span, lo - span.offset, hi - span.offset

    def _send_in_pieces(self, group: _Group) -> None:
        """[Note: activation pieces] ``group`` straight to its swap extent through one host
        buffer of ``_piece_bytes``, a piece at a time; the records let go of their device
        tensors once every piece is written (a failed write leaves them on the device)."""
        started = time.perf_counter()
        piece = self._piece_bytes(group.num_bytes)
        group.extent = self._take_extent(group.num_bytes)
        staging = self._host_buffer(piece)
        records = [[r for r in (ref() for ref in span.records) if r is not None] for span in group.spans]
        try:
            for start in range(0, group.num_bytes, piece):
                end = min(start + piece, group.num_bytes)
                events = []
                for i, span, lo, hi in self._overlaps(group.spans, start, end):
                    src = span.source(records[i][0])[lo:hi]  # as they lie
                    at = span.offset + lo - start
                    events.append(self._device.streams.copy_out(staging[at:at + hi - lo], src,
                                                                what=f"activations of {group.unit_name}"))
                for event in events:  # [Note: streams] the piece is in the buffer, each copy seen done
                    event.synchronize()
                self.nvme.write(staging[:end - start], sub_extent(group.extent, start, end - start),
                                unit=group.unit_name).wait()
        except OSError as error:  # nothing left the device; the extent is free again
            extent, group.extent = group.extent, None
            with self._lock:
                self._free_extents.append(extent)
            raise OSError(error.errno, f"writing the saved activations of unit {group.unit_name!r} to "
                                       f"{extent.path}: {error}") from error
        finally:
            self._release_buffer(staging)
        moved = sum(self._left(span_records) for span_records in records)
        group.counts.update(moved_bytes=moved, where="nvme")
        self._pass_moved["nvme"] += moved
        self.moved_bytes["nvme"] += moved
        if self._destination != "nvme":
            self._pass_written_on.append((group.unit_name, moved))  # for want of host room
        self._count_nvme(group.num_bytes)
        group.to("nvme")
        self._timeline.span("activations", f"out in pieces {group.unit_name} ({moved >> 10} KiB)", started,
                            time.perf_counter())

    def _return_in_pieces(self, group: _Group, spans: List[Span]) -> None:
        """[Note: activation pieces] ``group`` back from its swap extent through one host
        buffer of ``_piece_bytes``, a piece at a time, into fresh device tensors; a failed
        read leaves it on NVMe (a later unpack tries again)."""
        streams = self._device.streams
        piece = self._piece_bytes(group.num_bytes)
        held = sum(r.num_bytes for span in spans for r in span.away())
        self._make_room(held, group.unit_name)  # all of them, or none
        flats = []
        for span in spans:
            for r in span.away():
                self._hold(r.num_bytes, group.unit_name)
            flat = self._fresh(span)
            streams.compute_access(flat, write=True, what="an allocation", check=False)  # [Note: streams]
            flats.append(flat)
        staging = self._host_buffer(piece)
        try:
            for start in range(0, group.num_bytes, piece):
                end = min(start + piece, group.num_bytes)
                self.nvme.read(staging[:end - start], sub_extent(group.extent, start, end - start),
                               unit=group.unit_name).wait()
                events = []
                for i, span, lo, hi in self._overlaps(spans, start, end):
                    at = span.offset + lo - start
                    events.append(streams.copy(flats[i].view(torch.uint8)[lo:hi], staging[at:at + hi - lo],
                                               after=[streams.record_compute()],
                                               what=f"activations of {group.unit_name}"))
                for event in events:  # [Note: streams] before compute reads them, and before the
                    streams.compute_wait(event)  # buffer takes the next piece
                    event.synchronize()
        except OSError as error:
            self._dropped(held)
            raise OSError(error.errno, f"reading the saved activations of unit {group.unit_name!r} from "
                                       f"{group.extent.path} (offset {group.extent.offset}): {error}") from error
        finally:
            self._release_buffer(staging)
        for span, flat in zip(spans, flats):
            self.returned_bytes += sum(r.num_bytes for r in span.restore(flat))
        self._give_back_extent(group)

    def _write_on(self, group: _Group) -> None:
        """A group in host RAM goes on to a swap extent, for room (``_make_host_room``)."""
        if group.event is not None:
            group.event.synchronize()  # its copies out landed in the buffer
            group.event = None
        group.extent = self._take_extent(group.num_bytes)
        started = time.perf_counter()
        try:
            self.nvme.write(group.host_buffer, sub_extent(group.extent, 0, group.num_bytes),
                            unit=group.unit_name).wait()
        except OSError as error:  # the group stays in host RAM, its extent free again
            extent, group.extent = group.extent, None
            with self._lock:
                self._free_extents.append(extent)
            raise OSError(error.errno, f"writing the saved activations of unit {group.unit_name!r} to "
                                       f"{extent.path}: {error}") from error
        self._count_nvme(group.num_bytes)
        self._release_host(group)
        moved = group.counts["moved_bytes"]
        group.counts["where"] = "nvme"
        self._pass_written_on.append((group.unit_name, moved))
        self._pass_moved["host"] -= moved
        self._pass_moved["nvme"] += moved
        self.moved_bytes["host"] -= moved
        self.moved_bytes["nvme"] += moved
        group.to("nvme")
        self._timeline.span("activations", f"on to NVMe {group.unit_name}", started, time.perf_counter())

    def _finish_writes(self) -> None:
        """Wait for the swap writes in flight and let go of their host buffers."""
        staged, self._staged = self._staged, []
        first_error: Optional[BaseException] = None
        for group, handle in staged:
            try:
                handle.wait()
            except OSError as error:
                first_error = first_error or OSError(
                    error.errno, f"writing the saved activations of unit {group.unit_name!r} to "
                                 f"{group.extent.path}: {error}")
                group.to("failed")
            self._release_host(group)
        if first_error is not None:
            raise first_error

    # ------------------------------------------------------------------ backward
    def before_backward(self, unit_name: str) -> None:
        """[Note: saved activations] A unit's backward starts: its group, and the one before
        it in this forward's order (needed next), come back."""
        if not self.enabled:
            return
        indices = self._unit_groups.get(unit_name)
        if not indices:
            return
        index = indices.pop()
        for i, needed in ((index, True), (index - 1, False)):
            group = self._groups[i]() if i >= 0 else None
            if group is not None and group.state in ("host", "nvme"):
                self._start_return(group, needed)

    def unpack(self, record: SavedActivation) -> torch.Tensor:
        """The tensor of ``record`` on the device, its group brought back first if away."""
        group = record.group
        if group is not None and group.state == "failed":
            raise OSError(f"the saved activations of unit {group.unit_name!r} were not written to "
                          f"{group.extent.path}: this graph cannot run its backward")
        if group is not None and group.state in ("host", "nvme"):
            self._start_return(group, needed=True)
        if group is not None and group.state == "returning":
            self._finish_return(group)
        assert record.tensor is not None
        return record.tensor

    def _start_return(self, group: _Group, needed: bool) -> None:
        """Start bringing ``group`` back: its swap read, or its copies to the device. Not
        ``needed`` (ahead of need): only where its bytes fit, else at its first unpack."""
        spans = group.away()
        num_bytes = sum(r.num_bytes for span in spans for r in span.away())
        if not needed and not self._device.activations_fit(num_bytes):
            return
        group.event = None  # the copies out: those back wait for them on the device ([Note: streams])
        group.return_started = time.perf_counter()
        if group.state == "nvme":
            self._finish_writes()
            if not self._host_fits(group.num_bytes):
                if not needed:
                    return  # at its first unpack
                if self._piece_bytes(group.num_bytes) > 0:  # [Note: activation pieces]
                    group.to("returning")
                    try:
                        self._return_in_pieces(group, spans)
                    except OSError:
                        group.to("nvme")  # still there; a later unpack tries again
                        raise
                    group.to("back")
                    self._timeline.span("activations", f"back in pieces {group.unit_name}", group.return_started,
                                        time.perf_counter())
                    return
                raise RuntimeError(
                    f"host_budget: reading the saved activations of unit {group.unit_name!r} back needs "
                    f"{group.num_bytes} bytes of host RAM beside {self.host_bytes} bytes of activations there, "
                    f"within {self._host_room_bytes} bytes; raise host_budget")
            group.host_buffer = self._host_buffer(group.num_bytes)
            group.read = self.nvme.read(group.host_buffer, sub_extent(group.extent, 0, group.num_bytes),
                                        unit=group.unit_name)
        group.to("returning")
        if group.read is None:
            self._copies_in(group, spans)

    def _copies_in(self, group: _Group, spans: List[Span]) -> None:
        streams = self._device.streams
        self._make_room(sum(r.num_bytes for span in spans for r in span.away()), group.unit_name)  # all, or none
        for span in spans:
            for r in span.away():
                self._hold(r.num_bytes, group.unit_name)
            flat = self._fresh(span)
            # [Note: streams] the copy stream writes memory the compute stream's allocator
            # just handed out (after its last use there: the stand-in is told so), and reads
            # a host buffer the copies out filled
            streams.compute_access(flat, write=True, what="an allocation", check=False)
            after = [streams.record_compute()] + ([self._last_sent] if self._last_sent is not None else [])
            group.event = streams.copy(flat.view(torch.uint8), self._view(group.host_buffer, span), after=after,
                                       what=f"activations of {group.unit_name}")
            self.returned_bytes += sum(r.num_bytes for r in span.restore(flat))

    def _finish_return(self, group: _Group) -> None:
        """``group`` is back: its copies landed, its host buffer and extent let go."""
        if group.read is not None:
            read, group.read = group.read, None
            try:
                read.wait()
            except OSError as error:
                group.to("nvme")  # still there; a later unpack tries again
                self._release_host(group)
                raise OSError(error.errno, f"reading the saved activations of unit {group.unit_name!r} from "
                                           f"{group.extent.path} (offset {group.extent.offset}): {error}") from error
            self._copies_in(group, group.away())
        if group.event is not None:
            self._device.streams.compute_wait(group.event)
            group.event.synchronize()  # before the host buffer is let go
            group.event = None
        self._release_host(group)
        self._give_back_extent(group)
        group.to("back")
        self._timeline.span("activations", f"back {group.unit_name}", group.return_started, time.perf_counter())

    # ------------------------------------------------------------------ buffers
    @staticmethod
    def _view(buffer: torch.Tensor, span: Span) -> torch.Tensor:
        return buffer[span.offset:span.offset + span.num_bytes]

    def _fresh(self, span: Span) -> torch.Tensor:
        """Device memory for ``span``'s bytes, of its dtype."""
        return torch.empty(span.num_bytes // torch.empty(0, dtype=span.dtype).element_size(), dtype=span.dtype,
                           device=self._device.device)

    def _host_buffer(self, num_bytes: int) -> torch.Tensor:
        buffer = self.host.allocate(num_bytes, torch.uint8, planned=False)
        with self._lock:
            self.host_bytes += num_bytes
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
        return buffer

    def _release_host(self, group: _Group) -> None:
        buffer, group.host_buffer = group.host_buffer, None
        if buffer is not None:
            if group.event is not None and group.read is None:
                group.event.synchronize()  # no copy still reads or writes it
                group.event = None
            self._release_buffer(buffer)

    def _release_buffer(self, buffer: torch.Tensor) -> None:
        self.host.release(buffer)
        with self._lock:
            self.host_bytes -= buffer.numel()

    def _take_extent(self, num_bytes: int) -> Extent:
        with self._lock:
            fitting = [e for e in self._free_extents if e.nbytes >= num_bytes]
            if fitting:
                extent = min(fitting, key=lambda e: e.nbytes)
                self._free_extents.remove(extent)
                return extent
        return self.nvme.allocate(num_bytes)

    def _give_back_extent(self, group: _Group) -> None:
        extent, group.extent = group.extent, None
        if extent is not None:
            with self._lock:
                self._free_extents.append(extent)
                self.nvme_bytes -= group.num_bytes

    def _count_nvme(self, num_bytes: int) -> None:
        with self._lock:
            self.written_bytes += num_bytes
            self.nvme_bytes += num_bytes
            self.nvme_peak_bytes = max(self.nvme_peak_bytes, self.nvme_bytes)

    def _let_go(self, group: _Group) -> None:
        """Every record of ``group`` ended: its host buffer and extent are free."""
        if group.read is not None:
            try:
                group.read.wait()
            except OSError:
                pass  # nothing will read these bytes
            group.read = None
        self._release_host(group)
        self._give_back_extent(group)

    # ------------------------------------------------------------------ stats
    def stats(self) -> Dict[str, Any]:
        """Engine.stats()["activations"]: bytes of the last forward under grad mode (kept on
        the device, moved to host, written to NVMe), totals since wrap, and peaks per tier."""
        return {
            "mode": self.mode,
            **self.last_pass,
            "units": [dict(u) for u in self.last_pass_units],
            "host_room_bytes": self._host_room_bytes,
            "moved_to_host_bytes": self.moved_bytes["host"],
            "moved_to_nvme_bytes": self.moved_bytes["nvme"],
            "returned_bytes": self.returned_bytes,
            "views_moved_bytes": self.views_moved_bytes,
            "views_kept_bytes": self.views_kept_bytes,
            "written_to_nvme_bytes": self.written_bytes,
            "device_bytes": self._device.activation_bytes,
            "device_peak_bytes": self._device.activation_peak_bytes,
            "host_bytes": self.host_bytes,
            "host_peak_bytes": self.host_peak_bytes,
            "nvme_bytes": self.nvme_bytes,
            "nvme_peak_bytes": self.nvme_peak_bytes,
            "nvme_bytes_written": self.nvme.bytes_written if self.nvme is not None else 0,
            "nvme_bytes_read": self.nvme.bytes_read if self.nvme is not None else 0,
        }

    def close(self) -> None:
        """The engine closes: swap writes finish, the NVMe tier goes. Records that outlive
        it (a graph the user keeps) let go of host buffers as they end."""
        try:
            self._finish_writes()
        except OSError:
            pass
        finally:
            self.closed = True
            if self.nvme is not None:
                self.nvme.close()
            if self._remove_dir is not None:
                try:
                    os.rmdir(self._remove_dir)
                except OSError:
                    pass  # not empty: something else put files there
