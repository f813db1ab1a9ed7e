"""The optimizer step over staged pieces: units' states go through a ring of host staging
slots, piece by piece, read ahead from their homes, updated by Adam and written back
([Note: the piece ring]); a swap write that fails leaves the updated piece in host RAM
([Note: swap I/O failures]).

``PipelinedStep`` owns the staging slots and what the ring keeps between pieces and steps;
the engine builds it once at wrap and hands it the collaborators it talks to: the tiers
(``TierContext``), the homes (whole-home reads on the failure paths), Adam over a unit
(``UnitAdam``: step counts, pieces, the kernel; compact states in pieces, [Note: compact
pieces]), the gradients it gives back once a unit is updated, and the failure state a
failed step sets.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

from offload import faults
from offload.config import format_size
from offload._sizes import PAGE_BYTES
from offload.memory.compact_codec import CompactPiece, compact_home_layout, compact_padded_numel, compact_piece_regions
from offload.memory.layout import (FP32_BYTES, Layout, SpareHomes, StagingSlot, UnitState, available_memory_bytes, slot_views,
                                   on_nvme, sub_extent)
from offload.optim.compact import compact_range_over
from offload.memory.master_codec import join_master, split_master
from offload.memory.state_slots import PackedHome, staged_parts, staged_views
from offload.optim.adam_ranges import OutOfPlace, moment_views
from offload.stats import Stats
from offload.tiers.nvme import drain, wait_all
from offload.units import Residency, padded_numel

if TYPE_CHECKING:
    from offload.memory.homes import Homes
    from offload.optim.adam_ranges import UnitAdam
    from offload.optim.failure import FailureState
    from offload.optim.gradients import Gradients
    from offload.tiers.context import TierContext

__all__ = ["PipelinedStep", "piece_ring"]


def piece_ring(num_pieces: int, slots: List[int], start_reads: Callable[[int, int], List[Any]],
               update: Callable[[int, int], None], stats: Stats) -> None:
    """[Note: the piece ring] Pieces 0..num_pieces-1 of the optimizer step through the
    staging ``slots``, piece i in slots[i % len(slots)]: ``update(i, slot)`` runs once
    piece i's reads (``start_reads(i, slot)``, which first waits for the slot's previous
    writes) are done, and starts its writes. With S slots the reads run S-1 pieces
    ahead: piece i+S-1's go into the slot of piece i-1, whose writes update(i-1) started.
    With three slots or more they are started after update(i): the reads of i+1.. keep
    the disk busy during it, and the writes of i-1 get that time to drain. With two
    slots (the early updates' ring) nothing else would be read during update(i), so
    piece i+1's reads are started first, or the disk would idle through the update.
    With one slot, the next piece's reads wait for piece i's writes.
    Whatever way the loop ends, no read is left in flight into a slot (errors are
    reported by the caller). ``stats`` counts the waits. tools/train_replay.py replays a
    step's I/O through this same ring."""
    ahead = max(1, len(slots) - 1)
    reads_first = len(slots) == 2
    reads: Dict[int, List[Any]] = {}

    def start(i: int) -> None:
        reads[i] = start_reads(i, slots[i % len(slots)])

    try:
        for i in range(min(ahead, num_pieces)):
            start(i)
        for i in range(num_pieces):
            wait_all(reads.pop(i), stats)
            if reads_first and i + ahead < num_pieces:
                start(i + ahead)
            update(i, slots[i % len(slots)])
            if not reads_first and i + ahead < num_pieces:
                start(i + ahead)
    finally:
        for handles in reads.values():
            drain(handles, stats)


class PipelinedStep:
    """The staged optimizer step: the step's own pipeline over every unit's pieces
    (``staged_update``, main thread) and the early updates' ring (``update_early``, on the
    optimizer worker), both through ``slots``.

    Its part of [Note: threads] (memory/layout.py): no lock is taken here, the hand-offs are
    the update tickets the main thread waits for:
    - ``slots[0]``, ``_slot_writer[0]``, ``root_prestaged`` and ``_prestaged_root``: the main thread only (the
      root's first piece is read into slot 0 under backward; early updates never use it).
    - ``slots[1:]``, their ``_slot_writer`` entries and ``_next_slot``: the optimizer worker
      while it runs early, deferred or delayed updates (``update_early``); the main thread
      (``staged_update``, ``finish_slot_writes`` from UpdateScheduler.wait_optimizer) only
      after waiting for every update ticket, when the worker is idle. The worker runs one
      update at a time.
    - ``write_errors``, ``failed_spare_writes`` and ``dirty``: whichever thread finishes a slot's writes
      (``finish_slot_writes``). The main thread reads ``write_errors`` while the worker may
      still append to it (UpdateScheduler.settle_unit: a list append is atomic under the
      GIL, and one it misses is seen when the step settles); it reads, raises and clears
      both only once the worker is idle (wait_optimizer, settle_all, checkpoints).
    """

    def __init__(self, slots: List[StagingSlot], *, layout: Layout, tiers: TierContext, homes: Homes,
                 adam: UnitAdam, gradients: Gradients, failures: FailureState, host_planned_bytes: int) -> None:
        """``slots``: the staging slots (none without a staged step). ``homes``: whole-home
        reads when a failed write keeps a unit in host RAM. ``adam``: a unit's step counts
        and pieces, Adam over a range, where a separate compute copy is written, the compact
        step of a piece.
        ``gradients``: given back (``release``) once a unit's update is done. ``failures``:
        stops the engine after a step failed part-way (fatal) and records a failed write
        (not fatal). ``host_planned_bytes``: what the host budget check planned, which the
        dirty copies may not eat into. A staged step (``layout.staged_step``) with fewer than
        two slots is a ValueError here: slot 0 serves the step's first unit and the early
        updates' ring the others ([Note: the piece ring]), which would divide by zero."""
        if layout.staged_step and len(slots) < 2:
            raise ValueError(f"slots: the staged optimizer step (a state on NVMe) needs at least 2 staging slots "
                             f"(optimizer_pipeline_depth >= 2: slot 0 for the step's first unit, the others "
                             f"for the early updates' ring), got {len(slots)}; build them with "
                             "Homes.allocate_staging")
        self.slots = slots
        self._layout = layout
        self._device, self._host, self._nvme = tiers.device, tiers.host, tiers.nvme
        self._stats, self._timeline = tiers.stats, tiers.timeline
        self._homes = homes
        self._adam = adam
        self._gradients = gradients
        self._failures = failures
        self._host_planned_bytes = host_planned_bytes
        # the root's first piece, read into slot 0 under backward (prestage_root), and the root
        self.root_prestaged: Optional[List[Any]] = None
        self._prestaged_root: Optional[UnitState] = None
        # where the early updates' ring goes on (slots 1.., [Note: the piece ring])
        self._next_slot = 0
        # [Note: swap I/O failures] which piece each staging slot is writing back, and the
        # write failures of this step (kept in host RAM, reported when the step ends)
        # (unit, lo, hi, speculative: to the spare homes, [Note: speculative updates])
        self._slot_writer: List[Optional[Tuple[UnitState, int, int, bool]]] = [None] * len(slots)
        self.write_errors: List[Tuple[UnitState, OSError]] = []
        # [Note: delayed updates] spare-home writes of delayed updates that failed
        self.failed_spare_writes: List[Tuple[UnitState, OSError]] = []
        # [Note: swap I/O failures] unit index -> states whose swap write failed, in host RAM
        self.dirty: Dict[int, Dict[str, torch.Tensor]] = {}
        # [Note: compact pieces] unit index -> the high parts its last piece updated on the
        # next piece's first page; written and read by the thread that runs the unit's ring
        self._compact_carry: Dict[int, torch.Tensor] = {}

    def unit_values(self, u: UnitState) -> Dict[int, torch.Tensor]:
        """u's current values (``Homes.unit_values``): its homes', or where a swap write failed
        the host copy kept here, which is current ([Note: swap I/O failures])."""
        return self._homes.unit_values(u, self.dirty.get(u.index, {}))

    def master_home(self, homes: Any) -> Any:
        """Where the master lives in ``homes`` (a UnitState, or its SpareHomes)."""
        return homes.compute_home if self._layout.merged else homes.master_home

    def _issue_reads(self, u: UnitState, lo: int, hi: int, slot: StagingSlot,
                     in_device: bool = False, piece: Optional[CompactPiece] = None) -> List[Any]:
        """Start reading piece [lo, hi) of u's NVMe-homed master and moments into ``slot``
        (a merged master from u's device copy when ``in_device``; split, the low halves,
        and the high ones from the compute copy at home or, ``in_device``, on the device);
        with compact states, ``piece`` ([Note: compact pieces])."""
        if self._layout.compact_states:
            return self._issue_compact_reads(u, piece, slot, in_device)
        handles, n = [], hi - lo
        home = self.master_home(u)
        if self._layout.split_master:  # [Note: split master] the low halves, and the high ones
            end, extent = self._half_extent(u, u.master_home, lo, hi)
            handles.append(self._nvme.read(slot.low[:end - lo], extent, unit=u.name))
            if slot.compute is not None and in_device:  # [Note: updates through the device copy]
                end = min(hi, u.spec.trainable_numel)
                slot.compute[:end - lo].copy_(self._device.view(u.device_offset + lo, end - lo))
                self._stats.add_bytes("device_to_host", (end - lo) * 2)
            elif slot.compute is not None:
                end, extent = self._half_extent(u, u.compute_home, lo, hi)
                handles.append(self._nvme.read(slot.compute[:end - lo], extent, unit=u.name))
        elif in_device and self._layout.merged:  # [Note: updates through the device copy]
            slot.master[:n].copy_(self._device.view(u.device_offset + lo, n))
            self._stats.add_bytes("device_to_host", n * FP32_BYTES)
        elif on_nvme(home):
            handles.append(self._nvme.read(slot.master[:n], sub_extent(home, lo * FP32_BYTES, n * FP32_BYTES), unit=u.name))
        if on_nvme(u.moments_home):
            handles.extend(self._nvme.read(buf, ext, unit=u.name)
                           for buf, ext in self._moment_parts(u, lo, hi, slot, u.moments_home))
        return handles

    # ------------------------------------------------------------------ compact pieces
    def _compact_parts(self, u: UnitState, piece: CompactPiece, slot: StagingSlot,
                       home: Any) -> List[Tuple[torch.Tensor, Any]]:
        """[Note: compact pieces] (staging view, extent) pairs that move ``piece``'s part of
        u's NVMe-homed compact ``home`` (its own or its spare): the whole home for a unit of
        one piece, else each array's part of the piece."""
        layout = compact_home_layout(compact_padded_numel([e.numel for e in u.trainable]))
        if piece.lo == 0 and piece.hi == layout.numel:
            return [(slot.compact[:home.nbytes], home)]
        return [(slot.compact[at:at + n], sub_extent(home, start, n))
                for at, start, n in compact_piece_regions(layout, piece.lo, piece.hi).values()]

    def _compact_window(self, u: UnitState, piece: CompactPiece) -> Tuple[int, int, int]:
        """[Note: compact pieces] (first, write_end, read_end): the elements of u's compute
        copy a piece stages, whole pages: it reads [first, read_end) and writes [first,
        write_end) back; the last piece runs on to the trainable prefix's padded end."""
        page = PAGE_BYTES // self._layout.compute_element_bytes
        first = piece.compute_lo // page * page
        if piece.compute_hi == u.spec.trainable_numel:
            end = padded_numel(u.spec.trainable_numel, self._layout.compute_element_bytes)
            return first, end, end
        write_end = piece.compute_hi // page * page
        return first, write_end, write_end + page

    def _issue_compact_reads(self, u: UnitState, piece: CompactPiece, slot: StagingSlot, in_device: bool) -> List[Any]:
        """[Note: compact pieces] Start reading ``piece`` of u's compact home into ``slot``
        where it is on NVMe, and its window of the compute copy (the high parts,
        _compact_window) where that is on NVMe: from NVMe, or from the resident device copy
        (``in_device``, [Note: updates through the device copy])."""
        handles = []
        if on_nvme(u.compact_home):
            handles.extend(self._nvme.read(buf, ext, unit=u.name)
                           for buf, ext in self._compact_parts(u, piece, slot, u.compact_home))
        if on_nvme(u.compute_home):
            first, _, read_end = self._compact_window(u, piece)
            if in_device:
                end = min(read_end, u.spec.trainable_numel)
                slot.compute[:end - first].copy_(self._device.view(u.device_offset + first, end - first))
                self._stats.add_bytes("device_to_host", (end - first) * slot.compute.element_size())
            else:
                size = slot.compute.element_size()
                handles.append(self._nvme.read(slot.compute[:read_end - first],
                                               sub_extent(u.compute_home, first * size, (read_end - first) * size),
                                               unit=u.name))
        return handles

    def _update_compact(self, u: UnitState, piece: CompactPiece, slot: StagingSlot, steps: List[int],
                        grad_factor: float, groups: Optional[List[Dict[str, Any]]], spare: Optional[SpareHomes]) -> None:
        """[Note: compact pieces] ``piece`` of u's update on its compact states: those at
        home (host), or the copies read into ``slot`` (NVMe); the high parts in the compute
        copy at home (host, or the slot of a CPU device) or its window in ``slot``, whose
        first elements (the previous piece's, on the page this piece starts in) are taken
        from ``_compact_carry`` first and whose last ones (the next piece's page) go there.
        With ``spare`` ([Note: speculative updates]) host-homed parts are copied to the
        spare homes first (whole, at the first piece) and stepped there, and the slot's are
        written to the spare homes; u's homes and step counts are left as they are."""
        homes = u if spare is None else spare
        if piece.lo == 0:
            self._compact_carry.pop(u.index, None)  # a ring that failed part-way left it
            if spare is not None:
                if not on_nvme(u.compact_home):
                    spare.compact_home.copy_(u.compact_home)
                if not on_nvme(u.compute_home):  # a host home (speculation never has a device-homed copy)
                    t = u.spec.trainable_numel
                    spare.compute_home[:t].copy_(u.compute_home[:t])
        layout = compact_home_layout(compact_padded_numel([e.numel for e in u.trainable]))
        if on_nvme(u.compact_home):
            whole = piece.lo == 0 and piece.hi == layout.numel
            states = compact_range_over(slot.compact, layout, piece.lo, piece.hi, staged_piece=not whole)
        else:
            states = compact_range_over(homes.compact_home, layout, piece.lo, piece.hi)
        if on_nvme(u.compute_home):
            first, write_end, _ = self._compact_window(u, piece)
            if piece.compute_lo > first:  # the previous piece updated these
                carried = self._compact_carry.pop(u.index)
                assert carried.numel() == piece.compute_lo - first
                slot.compute[:carried.numel()].copy_(carried)
            high = slot.compute[piece.compute_lo - first:]
        else:
            compute = homes.compute_home if spare is not None else self._adam.compute_target(u)
            high = compute[piece.compute_lo:]
        self._adam.compact_piece_step(u, piece, states, high, steps, grad_factor, groups)
        if on_nvme(u.compute_home) and piece.compute_hi > write_end:  # on the next piece's first page
            self._compact_carry[u.index] = slot.compute[write_end - first:piece.compute_hi - first].clone()

    def _compact_writes(self, u: UnitState, piece: CompactPiece, slot: StagingSlot, homes: Any) -> List[Any]:
        """[Note: compact pieces] Start writing ``piece`` of u's updated compact states and
        its compute window from ``slot`` to ``homes`` (u's, or its spare ones) on NVMe."""
        writes = []
        if on_nvme(homes.compact_home):
            writes.extend(self._nvme.write(buf, ext, unit=u.name)
                          for buf, ext in self._compact_parts(u, piece, slot, homes.compact_home))
        if on_nvme(homes.compute_home):
            first, write_end, _ = self._compact_window(u, piece)
            size = slot.compute.element_size()
            writes.append(self._nvme.write(slot.compute[:write_end - first],
                                           sub_extent(homes.compute_home, first * size, (write_end - first) * size),
                                           unit=u.name))
        return writes

    @staticmethod
    def _half_extent(u: UnitState, home: Any, lo: int, hi: int) -> Tuple[int, Any]:
        """(end, extent) of piece [lo, hi) of a 16-bit home that starts with u's trainable
        prefix (the compute copy; split, the master's low halves): the last piece runs on
        to the prefix's padded end, so that every request covers whole pages."""
        end = padded_numel(u.spec.trainable_numel, 2) if hi == u.master_numel else hi
        return end, sub_extent(home, lo * 2, (end - lo) * 2)

    @staticmethod
    def _moment_parts(u: UnitState, lo: int, hi: int, slot: StagingSlot,
                      home: Any) -> List[Tuple[torch.Tensor, Any]]:
        """(staging view, extent range) pairs that move exp_avg[lo:hi] and exp_avg_sq[lo:hi]
        (each of u's state_slots) of u's moments ``home`` (its own or its spare): one request
        when the piece is the whole unit (the slots are adjacent on disk); with per-entry slots
        one per slot holding any of the piece ([Note: per-entry state slots]: the slots' spans
        one after another in the staging buffer, staged_parts)."""
        n, k = hi - lo, u.state_slots
        if isinstance(home, PackedHome):  # [Note: per-entry state slots] each slot's span of the piece
            return [(slot.moments[start:start + b - a], sub_extent(home.home, a * FP32_BYTES, (b - a) * FP32_BYTES))
                    for start, a, b in staged_parts(home.slots, lo, hi) if b > a]
        if n == u.master_numel:
            return [(slot.moments[:k * n], home)]
        return [(slot.moments[i * n:(i + 1) * n], sub_extent(home, (i * u.master_numel + lo) * FP32_BYTES,
                                                              n * FP32_BYTES)) for i in range(k)]

    def _update_staged(self, u: UnitState, lo: int, hi: int, steps: List[int], slot: StagingSlot,
                       grad_factor: float, groups: Optional[List[Dict[str, Any]]] = None,
                       spare: Optional[SpareHomes] = None, piece: Optional[CompactPiece] = None) -> None:
        """Adam over piece [lo, hi) of u, read into ``slot``; host-homed states are updated
        in place, or ([Note: speculative updates]) read from u's homes and written to
        ``spare``'s ([Note: out-of-place Adam]). Staged states are updated in the slot.
        With compact states, ``piece`` ([Note: compact pieces])."""
        if self._layout.compact_states:
            self._update_compact(u, piece, slot, steps, grad_factor, groups, spare)
            return
        n = hi - lo
        home = self.master_home(u)
        master = slot.master[:n] if on_nvme(home) else home[lo:hi]
        master_out = master if spare is None or on_nvme(home) else self.master_home(spare)[lo:hi]
        high = None
        if self._layout.split_master:  # [Note: split master] the master from its halves
            assert on_nvme(home), "a split master lives on NVMe"
            if slot.compute is not None:  # the compute copy on NVMe: staged
                high = high_out = slot.compute[:n]
            else:  # at home
                high = u.compute_home[lo:hi]
                high_out = high if spare is None else spare.compute_home[lo:hi]
            join_master(high, slot.low[:n], master)
        k = u.state_slots
        if on_nvme(u.moments_home) or k == 0:
            exp_avg, exp_avg_sq = slot_views(slot.moments, k, n, 0, n) if u.state_pages is None else \
                staged_views(u.state_pages, slot.moments, lo, hi)  # [Note: per-entry state slots]
            exp_avg_out, exp_avg_sq_out = exp_avg, exp_avg_sq
        else:
            exp_avg, exp_avg_sq = moment_views(u.moments_home, u, lo, hi)
            exp_avg_out, exp_avg_sq_out = (exp_avg, exp_avg_sq) if spare is None else \
                moment_views(spare.moments_home, u, lo, hi)
        compute_in = None
        if high is not None:  # split again below, not rounded by the kernel
            compute_out, staging = None, False
        elif slot.compute is not None and (on_nvme(u.compute_home) or u.compute_home is None):
            # [Note: placement by budget] on its way to NVMe, or to a slot the host does not
            # address (a unit that lives on the device: adam_range copies it there)
            compute_out, staging = slot.compute[:n], True
        else:
            target = self._adam.compute_target(u)
            if target is not None and spare is not None:
                assert target is u.compute_home  # a host home ([Note: speculative updates]: no device copy)
                compute_in, compute_out = target[lo:hi], spare.compute_home[lo:hi]
            else:
                compute_out = None if target is None else target[lo:hi]
            staging = False
        out = None
        if spare is not None:  # host-homed states are read at home and written to the spares
            out = OutOfPlace(master_out, exp_avg_out, exp_avg_sq_out, compute_in)
        start = time.perf_counter()
        self._adam.adam_range(u, lo, hi, steps, master, exp_avg, exp_avg_sq, compute_out, staging, grad_factor,
                         copy_to_device=high is None, groups=groups, out=out)
        if high is not None:
            split_master(master, high_out, slot.low[:n])
        self._timeline.span("adam", f"adam {u.name}[{lo}:{hi}]", start, time.perf_counter())

    def device_copy_updatable(self, u: UnitState) -> bool:
        """[Note: updates through the device copy] On a CPU device with the compute copies
        on NVMe, a unit whose device copy is resident when its Adam runs need not have it
        read again: with fp32 the master pieces are copied from the device copy instead of
        read from NVMe, and (any dtype) the new compute copy is written into the device
        copy as well as home. The device copy then holds the updated unit and stays (the
        optimizer step keeps it; the next pass needs no fetch), where otherwise it is
        stale and dropped. An early update does this only once the pass needs no other
        unit, so the slot is not wanted meanwhile; ``_release`` of such a unit waits for
        the optimizer worker first, and a failed update drops the copy. The optimizer
        step's own updates (main thread, nothing else running) do it for every resident
        unit. [zero] Not with several ranks."""
        return self._layout.device_copy_updates and on_nvme(u.compute_home) and \
            u.compute_state == Residency.LOADED and u.device_offset is not None

    def _write_through(self, u: UnitState, lo: int, hi: int, slot: StagingSlot,
                       piece: Optional[CompactPiece] = None) -> None:
        """Copy the new compute copy of piece [lo, hi) (trainable elements) into u's device
        copy ([Note: updates through the device copy]); with compact states, ``piece``'s
        window as it is written home ([Note: compact pieces])."""
        if piece is not None:
            lo, hi, _ = self._compact_window(u, piece)
        end = min(hi, u.spec.trainable_numel)
        if end > lo:
            src = slot.master if self._layout.merged else slot.compute
            self._device.view(u.device_offset + lo, end - lo).copy_(src[:end - lo])
            self._stats.add_bytes("host_to_device", (end - lo) * src.element_size())

    def _issue_writes(self, u: UnitState, lo: int, hi: int, slot: StagingSlot,
                      spare: Optional[SpareHomes] = None, piece: Optional[CompactPiece] = None) -> None:
        """Start writing piece [lo, hi) of u's updated states from ``slot`` back to NVMe: to
        u's homes, or ([Note: speculative updates]) to its ``spare`` ones; with compact
        states, ``piece`` ([Note: compact pieces])."""
        faults.hit("optim.write_back", unit=u.name, lo=lo, hi=hi)
        writes, n = [], hi - lo
        homes = u if spare is None else spare
        home = self.master_home(homes)
        if self._layout.compact_states:
            slot.pending_writes = self._compact_writes(u, piece, slot, homes)
            return
        if self._layout.split_master:  # [Note: split master] the high halves go with the compute copy
            end, extent = self._half_extent(u, home, lo, hi)
            writes.append(self._nvme.write(slot.low[:end - lo], extent, unit=u.name))
        elif on_nvme(home):
            writes.append(self._nvme.write(slot.master[:n], sub_extent(home, lo * FP32_BYTES, n * FP32_BYTES), unit=u.name))
        if on_nvme(homes.moments_home):
            writes.extend(self._nvme.write(buf, ext, unit=u.name)
                          for buf, ext in self._moment_parts(u, lo, hi, slot, homes.moments_home))
        if slot.compute is not None and on_nvme(homes.compute_home):  # [Note: placement by budget]
            size = slot.compute.element_size()
            end = padded_numel(u.spec.trainable_numel, size) if hi == u.master_numel else hi
            end = min(end, lo + slot.compute.numel())
            writes.append(self._nvme.write(slot.compute[:end - lo],
                                           sub_extent(homes.compute_home, lo * size, (end - lo) * size), unit=u.name))
        slot.pending_writes = writes

    def staged_update(self, units: List[UnitState], grad_factor: float, micro_step: int) -> None:
        """The pipeline over pieces of units: piece i+1's states are read while Adam updates
        piece i and piece i-1 is written back; ``optimizer_pipeline_depth`` slots in a ring.

        [Note: swap I/O failures] A failed write does not stop the step: the unit's updated
        states are kept in ``self.dirty`` (host RAM, bounded by ``_dirty_limit_bytes``;
        the unit's pieces already on disk are read back, its later pieces copied in as they
        pass), the other units are updated, and the step then raises. The engine holds a
        complete, consistent step; forward and step refuse (a swap home may be half-written)
        while ``save_checkpoint`` reads the dirty copies. A failed read (or too many dirty
        bytes) leaves some units updated and others not: the engine refuses everything and
        says to resume from the last checkpoint. Either way nothing is left in flight into a
        slot."""
        pieces = [(u, lo, hi, piece) for u in units for lo, hi, piece in self._pieces(u)]
        steps: Dict[int, List[int]] = {}
        # [Note: updates through the device copy]: units resident now
        in_device = {u.index for u in units if self.device_copy_updatable(u)}

        def start_reads(i: int, index: int) -> List[Any]:
            u, lo, hi, piece = pieces[i]
            if i == 0 and u is self._prestaged_root and self.root_prestaged is not None:  # read under backward
                handles, self.root_prestaged = self.root_prestaged, None
                return handles
            self.finish_slot_writes(index)
            return self._issue_reads(u, lo, hi, self.slots[index], u.index in in_device, piece)

        def update(i: int, index: int) -> None:
            nonlocal num_updated
            u, lo, hi, piece = pieces[i]
            slot = self.slots[index]
            if lo == 0:
                steps[u.index] = self._adam.next_steps(u)
            self._update_staged(u, lo, hi, steps[u.index], slot, grad_factor, piece=piece)
            if u.index in in_device:
                self._write_through(u, lo, hi, slot, piece)
            self._slot_writer[index] = (u, lo, hi, False)
            self._issue_writes(u, lo, hi, slot, piece=piece)
            if hi == u.master_numel:
                u.steps = steps.pop(u.index)
                u.update.in_device = u.index in in_device  # the whole unit went through
                self._gradients.release(u)
            num_updated += 1

        num_updated = 0  # pieces[num_updated] is the one being read or updated
        try:
            self._piece_ring(len(pieces), list(range(len(self.slots))), start_reads, update)
            for s in range(len(self.slots)):
                self.finish_slot_writes(s)
        except BaseException as error:
            self.drain_root_reads()
            for slot in self.slots:
                drain(slot.pending_writes, self._stats)
            where = f"unit {pieces[num_updated][0].name!r}" if num_updated < len(pieces) else "a unit"
            self._failures.fail_step(error, f"in the optimizer step at micro-step {micro_step} while working on {where}")
        self.raise_write_errors(micro_step)

    def update_early(self, u: UnitState, groups: List[Dict[str, Any]], grad_factor: float,
                     into_spare: bool = False) -> None:
        """The pieces of u through the staging slots other than slot 0 (kept for the root
        unit's first piece, see prestage_root), in a ring that goes on where the last unit's
        update left it ([Note: the piece ring]). A speculative update ([Note: speculative
        updates]) or a delayed one (``into_spare``, [Note: delayed updates]) writes u's spare
        homes and step counts and keeps u's gradients."""
        spare = u.spare if u.update.speculative or into_spare else None
        assert spare is not None or not into_spare, f"{u.name}: no spare homes to write"
        steps = self._adam.next_steps(u)
        pieces = self._pieces(u)
        num_slots = len(self.slots) - 1
        ring = [1 + (self._next_slot + j) % num_slots for j in range(num_slots)]
        self._next_slot += len(pieces)
        in_device, fill = u.update.in_device, u.update.fill
        writes: List[Any] = []
        if not into_spare:  # [Note: deferred updates] what a fetch of u waits for
            u.update.home_writes = writes

        def start_reads(i: int, index: int) -> List[Any]:
            self.finish_slot_writes(index)  # the slot's previous piece is on disk first
            lo, hi, piece = pieces[i]
            return self._issue_reads(u, lo, hi, self.slots[index], in_device and not fill, piece)

        def update(i: int, index: int) -> None:
            lo, hi, piece = pieces[i]
            self._update_staged(u, lo, hi, steps, self.slots[index], grad_factor, groups, spare, piece)
            if in_device:
                self._write_through(u, lo, hi, self.slots[index], piece)
            self._slot_writer[index] = (u, lo, hi, spare is not None)
            self._issue_writes(u, lo, hi, self.slots[index], spare, piece)
            writes.extend(self.slots[index].pending_writes)

        self._piece_ring(len(pieces), ring, start_reads, update)
        if spare is not None:
            spare.steps = steps
            return
        u.steps = steps
        self._gradients.release(u)

    def prestage_root(self, root: UnitState) -> None:
        """Start reading the ``root`` unit's first piece into slot 0 under backward: the root
        is updated last (its embedding gradients come last), so its states cannot change
        before then, and staged_update gives slot 0 to the first unit, the root (early
        updates use the others)."""
        wait_all(self.slots[0].pending_writes, self._stats)
        lo, hi, piece = self._pieces(root)[0]
        self._prestaged_root = root
        self.root_prestaged = self._issue_reads(root, lo, hi, self.slots[0], self.device_copy_updatable(root), piece)

    def wait_root_reads(self) -> None:
        """Wait for the root's prestaged reads, if any (a skipped step), raising their error."""
        if self.root_prestaged is not None:
            wait_all(self.root_prestaged, self._stats)
            self.root_prestaged = None

    def drain_root_reads(self) -> None:
        """Drop the root's prestaged reads, if any (the root got no gradient this step, or
        the step failed), once they are no longer in flight."""
        if self.root_prestaged is not None:
            drain(self.root_prestaged, self._stats)
            self.root_prestaged = None

    def _pieces(self, u: UnitState) -> List[Tuple[int, int, Optional[CompactPiece]]]:
        """u's pieces (UnitAdam.pieces), each with its CompactPiece with compact states
        ([Note: compact pieces]), else None."""
        if not self._layout.compact_states:
            return [(lo, hi, None) for lo, hi in self._adam.pieces(u)]
        return [(lo, hi, piece) for (lo, hi), piece in zip(self._adam.pieces(u), self._adam.compact_pieces(u))]

    def _piece_ring(self, num_pieces: int, slots: List[int], start_reads: Callable[[int, int], List[Any]],
                    update: Callable[[int, int], None]) -> None:
        piece_ring(num_pieces, slots, start_reads, update, self._stats)

    def finish_slot_writes(self, s: int) -> None:
        """Wait for slot s's write-back; a failed write keeps the piece in host RAM."""
        slot, piece = self.slots[s], self._slot_writer[s]
        self._slot_writer[s] = None
        failed: Optional[OSError] = None
        try:
            wait_all(slot.pending_writes, self._stats)
        except OSError as error:
            if piece is None:
                raise
            failed = error
        if piece is not None and piece[3]:
            # [Note: speculative updates] a spare home half-written: u's homes are intact,
            # step() redoes the update from them; [Note: delayed updates] the next step()
            # cannot commit it: fatal there
            if failed is not None and piece[0].update.speculative:
                piece[0].update.speculation_failed = True
                self._stats.count("failed_speculative_writes")
            elif failed is not None:
                self.failed_spare_writes.append((piece[0], failed))
            return
        if piece is not None and (failed is not None or piece[0].index in self.dirty):
            self._keep_dirty(*piece[:3], slot, failed)
        if failed is not None:
            self.write_errors.append((piece[0], failed))

    def raise_write_errors(self, micro_step: int) -> None:
        if self.write_errors:
            write_errors, self.write_errors = self.write_errors, []
            held = sum(t.numel() * t.element_size() for d in self.dirty.values() for t in d.values())
            left = self._budget_left_bytes()
            over = "" if left is None or held <= left else f", {format_size(held - left)} past host_budget"
            first = write_errors[0][1]
            names = ", ".join(sorted({repr(u.name) for u, _ in write_errors}))
            failure = {"fatal": False, "message": (
                f"swap writes failed in the optimizer step at micro-step {micro_step} "
                f"(units {names}; first error: {first}). The step completed: the updated states "
                f"of those units are held in host RAM ({format_size(held)}{over}), so "
                "engine.save_checkpoint(DIR) on a filesystem with room saves a consistent "
                "checkpoint of this step; forward and step refuse until a checkpoint is loaded "
                "(engine.load_checkpoint(DIR) or a new process)")}
            self._failures.set(failure)
            raise OSError(first.errno, failure["message"]) from first

    def _budget_left_bytes(self) -> Optional[int]:
        """Host bytes host_budget leaves beside the engine's plan (None: no budget)."""
        if self._layout.host_budget is None:
            return None
        # the plan reserves every gradient buffer even while the pool holds fewer
        return max(self._layout.host_budget - max(self._host_planned_bytes, self._host.used_bytes), 0)

    def _dirty_limit_bytes(self) -> int:
        """Host bytes the dirty copies may take: half of the RAM the kernel reports
        available, or what host_budget leaves when that is more. Past host_budget when it
        leaves less (at the smallest budgets, where gradients spill, it leaves none): the
        copies are the run's only current states, and without them the run is lost back to
        its last checkpoint; the failure says by how much the budget is exceeded."""
        available = available_memory_bytes()
        half = 0 if available is None else available // 2
        left = self._budget_left_bytes()
        return half if left is None else max(left, half)

    def _keep_dirty(self, u: UnitState, lo: int, hi: int, slot: StagingSlot, error: Optional[OSError]) -> None:
        """[Note: swap I/O failures] Hold piece [lo, hi) of u's updated states in host RAM
        (the first failed piece of a unit brings the rest of the unit from disk), or raise.
        Compact states are not held: the failed write is fatal ([Note: compact optimizer states])."""
        if self._layout.compact_states:
            raise OSError(error.errno, f"{error}; the compact states of unit {u.name!r} are not held in host RAM "
                          "after a failed swap write: resume from the last checkpoint")
        master_on_nvme = on_nvme(self.master_home(u))
        moments_on_nvme = on_nvme(u.moments_home)
        dirty = self.dirty.get(u.index)
        if dirty is None:
            held = sum(t.numel() * t.element_size() for d in self.dirty.values() for t in d.values())
            need = (master_on_nvme + u.state_slots * moments_on_nvme) * u.master_numel * FP32_BYTES
            if held + need > self._dirty_limit_bytes():
                raise OSError(error.errno, f"{error}; holding the states of unit {u.name!r} in host "
                              f"RAM would take {format_size(held + need)}, more than the host can spare")
            dirty = {}
            if master_on_nvme:
                dirty["master"] = self._homes.read_master(u)
            if moments_on_nvme:
                dirty["moments"] = self._homes.load(u.moments_home, u.state_slots * u.master_numel, torch.float32)
            self.dirty[u.index] = dirty
        n = hi - lo
        if "master" in dirty:
            dirty["master"][lo:hi].copy_(slot.master[:n])
        if "moments" in dirty and u.state_pages is not None:  # [Note: per-entry state slots] to the virtual layout
            for i, view in enumerate(staged_views(u.state_pages, slot.moments, lo, hi)[:u.state_slots]):
                for a, b in u.state_pages.owned_parts(i, lo, hi):
                    dirty["moments"][i * u.master_numel + a:i * u.master_numel + b].copy_(view[a - lo:b - lo])
        elif "moments" in dirty:
            for i in range(u.state_slots):
                dirty["moments"][i * u.master_numel + lo:i * u.master_numel + hi].copy_(slot.moments[i * n:(i + 1) * n])
