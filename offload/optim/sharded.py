"""[zero] The optimizer step at stage >= 1: Adam over this rank's shard of every unit.

Each unit's shard is updated whole at stages 1-2 (then the other ranks' parts are
all-gathered) and piece by piece at stage 3 (no all-gather: the next fetch gathers the
chunks). NVMe-homed states go through two sets of update buffers owned here, so that the
next piece's reads are in flight while one piece is updated and the previous one's writes
drain meanwhile.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from offload.memory.budget import low_numel
from offload.memory.layout import FP32_BYTES, Layout, UnitState, on_nvme, sub_extent
from offload.memory.master_codec import join_master, split_master
from offload.optim.adam_ranges import OutOfPlace
from offload.tiers.nvme import drain, wait_all
from offload.zero.partition import Partition

if TYPE_CHECKING:
    from offload.optim.adam_ranges import UnitAdam
    from offload.optim.failure import FailureState
    from offload.optim.gradients import Gradients
    from offload.tiers.context import TierContext


class ShardedStep:
    """[zero] Stage >= 1: the shard updates of one optimizer step (``run``) and the update
    buffers they read NVMe-homed states into.

    Collaborators: the run's ``layout``; the ``tiers`` (their nvme None when nothing is
    homed there; the waits for swap I/O counted in their stats, an "adam" span per update in
    their timeline); the ``partition`` whose ``all_gather_shards`` brings in the other
    ranks' parts. ``piece_numel``: the elements of one piece at stage 3, the size the update
    buffers were budgeted for, so the engine passes the one it budgets with.
    ``update_buffer_bytes``: bytes of one update buffer per role, the budget that wrap
    checked (offload/memory/budget.py's update_buffer_bytes). The engine's other update
    loops share the rest: ``adam`` (UnitAdam: a unit's step counts after the update, Adam
    over a range of its trainable prefix, where a separate 16-bit compute copy that is not
    staged is written), ``gradients`` (given back once a unit is updated) and ``failures``
    ([Note: swap I/O failures]: the engine refuses to go on after an update loop stopped
    part-way; ``fail_step`` raises).
    """

    def __init__(self, *, layout: Layout, tiers: TierContext, partition: Partition, piece_numel: int,
                 update_buffer_bytes: Dict[str, int], adam: UnitAdam, gradients: Gradients,
                 failures: FailureState) -> None:
        assert partition.shards_state
        self._layout = layout
        self._device, self._host, self._nvme = tiers.device, tiers.host, tiers.nvme
        self._stats, self._timeline = tiers.stats, tiers.timeline
        self._partition = partition
        self._piece_numel = piece_numel
        self._update_buffer_bytes = update_buffer_bytes
        self._adam = adam
        self._gradients = gradients
        self._failures = failures
        # role + buffer set (0 or 1) -> host buffer, made at the first update that needs it
        self._update_buffers: Dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def run(self, units: List[UnitState], grad_factor: float, micro_step: int,
            groups: Optional[List[Dict[str, Any]]] = None, speculative: bool = False, early: bool = False,
            updated_early: Sequence[UnitState] = (), lane: str = "main") -> None:
        """[zero] Stage >= 1: the units' shard updates in order, piece by piece at stage 3
        (see _shard_pieces), over two sets of update buffers: the next piece's NVMe reads
        are in flight while this one is updated (and, stages 1-2, gathered), and the
        previous one's writes drain meanwhile. A swap I/O error leaves some units updated
        and others not: the engine refuses to go on, as after a failed read in its
        _staged_update. ``micro_step``: for the failure's message; ``groups``: the
        hyperparameters taken when an early update was queued (None: the optimizer's now).
        [Note: early updates across ranks] ``early``: an update on the optimizer worker,
        which runs no collective (stages 1-2: Adam alone, its gather owed to the step);
        ``updated_early``: units whose Adam ran so (stages 1-2: only their gathers, at
        their place in unit order, so every rank gathers every unit in one order whichever
        ran early). ``speculative`` ([Note: speculative updates]): read the units' homes,
        write their spare homes and step counts, keep their gradients (stages 1-2: gathered
        into the spare compute copy). ``lane``: the Partition lane of the stage 1-2 gathers
        ("param": a delayed update on the optimizer worker, [Note: delayed updates across ranks])."""
        assert not speculative or all(u.spare is not None for u in units)
        owed = {u.index: u for u in updated_early if u.param_shard is None}  # stage 3: nothing to gather
        work = [(u, lo, hi, u.index not in owed) for u in sorted(list(units) + list(owed.values()),
                                                                  key=lambda u: u.index)
                for lo, hi in (self._shard_pieces(u) if u.index not in owed else [(0, 0)])]
        writes: List[List[Any]] = [[], []]  # per buffer set
        reads: Tuple[Dict[str, torch.Tensor], List[Any]] = ({}, [])
        current: Optional[UnitState] = None
        steps: List[int] = []

        def start_reads(i: int) -> Tuple[Dict[str, torch.Tensor], List[Any]]:
            u, lo, hi, adam = work[i]
            return self._start_shard_reads(u, lo, hi, i % 2) if adam else ({}, [])
        try:
            if work:
                reads = start_reads(0)
            for i, (u, lo, hi, adam) in enumerate(work):
                current = u
                views, handles = reads
                wait_all(handles, self._stats)
                if i + 1 < len(work):
                    wait_all(writes[(i + 1) % 2], self._stats)
                    reads = start_reads(i + 1)
                if not adam:
                    writes[i % 2] = []
                    self._gather_owed(u)
                    continue
                if lo == 0:
                    steps = self._adam.next_steps(u)
                if u.param_shard is not None:
                    self._update_param_piece(u, lo, hi, steps, grad_factor, views, groups, speculative)
                else:
                    self._update_shard(u, steps, grad_factor, views, groups, speculative, gather=not early,
                                       lane=lane)
                writes[i % 2] = self._start_shard_writes(u, lo, hi, views, u.spare if speculative else u)
                if hi == u.shard.state_numel:
                    if speculative:  # the gradients wait for the norm: kept for a redo
                        u.spare.steps = steps
                    else:
                        u.steps = steps
                        self._gradients.release(u)
            current = None
            for handles in writes:
                wait_all(handles, self._stats)
        except BaseException as error:
            drain(reads[1], self._stats)
            for handles in writes:
                drain(handles, self._stats)
            where = f"unit {current.name!r}" if current is not None else "a unit"
            self._failures.fail_step(error, f"in the optimizer step at micro-step {micro_step} while working on {where}")

    # ------------------------------------------------------------------ pieces and their I/O
    def _shard_pieces(self, u: UnitState) -> List[Tuple[int, int]]:
        """[zero] The ranges of u's shard (in shard coordinates) updated one at a time: page-
        aligned pieces at stage 3, where every state of the shard starts on a page at home;
        the whole shard at stages 1-2 (its compute copy is whole and gathered at once)."""
        n = u.shard.state_numel
        if u.param_shard is None:
            return [(0, n)]
        return [(lo, min(lo + self._piece_numel, n)) for lo in range(0, n, self._piece_numel)]

    def _shard_homes(self, u: UnitState, lo: int, hi: int, homes: Any = None) -> List[Tuple[str, Any, torch.dtype]]:
        """[zero] (role, swap extent, dtype) of each NVMe-homed buffer that the update of
        elements [lo, hi) of u's shard reads and writes; in ``homes`` (u's spare ones, say;
        the same sizes and tiers), by default u's own."""
        layout = self._layout
        homes = u if homes is None else homes
        found = []
        n, state_numel = hi - lo, u.shard.state_numel
        if homes.compute_home is not None and on_nvme(homes.compute_home) and \
                (layout.merged or layout.compute_dtype != torch.float32):
            dtype = torch.float32 if layout.merged else layout.compute_dtype
            size = torch.empty(0, dtype=dtype).element_size()
            if u.param_shard is None:  # stages 1-2: the whole compute copy
                found.append(("compute", homes.compute_home, dtype))
            elif lo < u.param_shard.trainable_chunk_numel:  # stage 3: the rank's chunk
                end = min(hi, u.param_shard.trainable_chunk_numel)
                found.append(("compute", sub_extent(homes.compute_home, lo * size, (end - lo) * size), dtype))
        if layout.split_master:  # [Note: split master] the low halves, to whole pages
            end = low_numel(u.shard.numel) if hi == state_numel else hi
            found.append(("low", sub_extent(homes.master_home, lo * 2, (end - lo) * 2), torch.int16))
        elif not layout.merged and on_nvme(homes.master_home):
            found.append(("master", sub_extent(homes.master_home, lo * FP32_BYTES, n * FP32_BYTES), torch.float32))
        if on_nvme(homes.moments_home):
            found.append(("exp_avg", sub_extent(homes.moments_home, lo * FP32_BYTES, n * FP32_BYTES), torch.float32))
            found.append(("exp_avg_sq", sub_extent(homes.moments_home, (state_numel + lo) * FP32_BYTES,
                                                   n * FP32_BYTES), torch.float32))
        return found

    def _start_shard_reads(self, u: UnitState, lo: int, hi: int,
                           buffer_set: int) -> Tuple[Dict[str, torch.Tensor], List[Any]]:
        """[zero] Start reading elements [lo, hi) of u's NVMe-homed shard states into buffer
        set ``buffer_set`` (0 or 1) of the update buffers: made at the first update (fresh
        memory is slow to touch on some machines, so never per step), then reused."""
        views: Dict[str, torch.Tensor] = {}
        handles = []
        for role, extent, dtype in self._shard_homes(u, lo, hi):
            views[role] = self._update_buffer(role, buffer_set)[:extent.nbytes].view(dtype)
            handles.append(self._nvme.read(views[role], extent, unit=u.name))
        if self._layout.split_master:  # [Note: split master] the master is joined here, not read
            views["master"] = self._update_buffer("master", buffer_set).view(torch.float32)[:hi - lo]
        return views, handles

    def _update_buffer(self, role: str, buffer_set: int) -> torch.Tensor:
        buf = self._update_buffers.get(f"{role}{buffer_set}")
        if buf is None:  # both sets at once (wrap budgeted two): made at the first update whichever
            # set it uses, never later ([Note: early updates across ranks]: a unit updated early uses one)
            for other in (0, 1):
                self._update_buffers[f"{role}{other}"] = self._host.allocate(self._update_buffer_bytes[role],
                                                                             torch.uint8)
            buf = self._update_buffers[f"{role}{buffer_set}"]
        return buf

    def _start_shard_writes(self, u: UnitState, lo: int, hi: int, views: Dict[str, torch.Tensor],
                            homes: Any) -> List[Any]:
        return [self._nvme.write(views[role], extent, unit=u.name)
                for role, extent, _ in self._shard_homes(u, lo, hi, homes)]

    # ------------------------------------------------------------------ Adam over shards
    def _update_shard(self, u: UnitState, steps: List[int], grad_factor: float, views: Dict[str, torch.Tensor],
                      groups: Optional[List[Dict[str, Any]]] = None, speculative: bool = False,
                      gather: bool = True, lane: str = "main") -> None:
        """[zero] Stages 1-2: Adam on this rank's shard ``u.shard`` of u's trainable prefix,
        then (with ``gather``) the other ranks' parts are all-gathered. The moments and a
        separate master are shard-sized (element ``shard.lo`` at index 0); a merged master
        and the compute copy are in full coordinates. ``views``: the NVMe-homed buffers,
        read whole by run (a shard starts anywhere in the compute copy, so it cannot be cut
        into page-aligned pieces), which also writes them back (to the spare homes when
        ``speculative``: then the host-homed ones are read at home and written to the
        spares, [Note: early updates across ranks]; a gather then fills the spare compute
        copy on ``lane``: [Note: delayed updates across ranks])."""
        layout = self._layout
        s = u.shard
        n = s.numel
        start = time.perf_counter()
        full = self._full_copy(u, views)

        def states(homes: Any, full: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Any, Any]:
            moments = homes.moments_home
            return (full[s.lo:s.lo + s.state_numel] if layout.merged else views.get("master", homes.master_home),
                    views.get("exp_avg", moments[:s.state_numel] if not on_nvme(moments) else None),
                    views.get("exp_avg_sq", moments[s.state_numel:] if not on_nvme(moments) else None))
        master, exp_avg, exp_avg_sq = states(u, full)
        compute_in = compute_out = None if layout.merged or full is None else full[s.lo:s.hi]
        out = None
        if speculative:
            # a host spare copy; on NVMe the buffer the home was read into, updated in place
            # there and written to the spare extent by run ([Note: delayed updates across ranks])
            spare_full = full if on_nvme(u.spare.compute_home) else u.spare.compute_home
            assert full is not None and isinstance(spare_full, torch.Tensor), "not a device compute copy"
            master_out, exp_avg_out, exp_avg_sq_out = states(u.spare, spare_full)
            compute_out = None if compute_in is None else spare_full[s.lo:s.hi]
            out = OutOfPlace(master_out[:n], exp_avg_out[:n], exp_avg_sq_out[:n],
                             None if layout.split_master or compute_in is None else compute_in)
        if layout.split_master and n:  # [Note: split master] the high halves are the shard's compute copy
            join_master(compute_in, views["low"][:n], master[:n])
        if n:
            self._adam.adam_range(u, s.lo, s.hi, steps, master[:n], exp_avg[:n], exp_avg_sq[:n],
                             None if layout.split_master else compute_out, False, grad_factor,
                             copy_to_device=False, groups=groups, out=out)
        if layout.split_master and n:  # the master the update wrote (a view: in place)
            split_master(master[:n], compute_out, views["low"][:n])
        self._timeline.span("adam", f"adam {u.name} (shard)", start, time.perf_counter())
        if gather and speculative:  # [Note: delayed updates across ranks] the spare copy, whole
            self._partition.all_gather_shards(u, spare_full, in_full_coordinates=True, lane=lane)
        elif gather:
            self._gather_shards(u, full, master)

    def _full_copy(self, u: UnitState, views: Dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """[zero] Stages 1-2: the full-coordinate buffer that receives u's gathered
        parameters: the compute copy (the master too when merged), or None when the
        compute copy is a separate fp32 buffer on the device (then the fp32 master is
        gathered and copied there)."""
        layout = self._layout
        if not (layout.merged or layout.compute_dtype != torch.float32):
            return None
        full = self._adam.compute_target(u) if not layout.merged else None
        if full is not None:
            return full
        if layout.param_tier == "device":  # a slot the host does not address: update a host copy
            return self._device.view(u.device_offset, u.compute_numel).to("cpu", copy=True)
        return views.get("compute", u.compute_home)

    def _gather_shards(self, u: UnitState, full: Optional[torch.Tensor], master: torch.Tensor) -> None:
        """[zero] Stages 1-2: every rank's updated part of u into ``full`` (see _full_copy;
        None: the gathered master into the device copy)."""
        layout = self._layout
        if full is not None:
            self._partition.all_gather_shards(u, full, in_full_coordinates=True)
        else:
            gathered = self._partition.all_gather_shards(u, master, in_full_coordinates=False)
            self._device.view(u.device_offset, u.spec.trainable_numel).copy_(gathered)
        if full is not None and layout.param_tier == "device" and not layout.device_is_host:
            self._device.view(u.device_offset, u.compute_numel).copy_(full)

    def _gather_owed(self, u: UnitState) -> None:
        """[Note: early updates across ranks] Stages 1-2: the all-gather that u, updated
        early (Adam alone, on the optimizer worker), still owes; its compute copy is a host
        home, which that update wrote."""
        full = self._full_copy(u, {})
        assert isinstance(full, torch.Tensor), "early stage 1-2 updates need host compute copies"
        self._partition.all_gather_shards(u, full, in_full_coordinates=True)

    @torch.no_grad()
    def _update_param_piece(self, u: UnitState, lo: int, hi: int, steps: List[int], grad_factor: float,
                            views: Dict[str, torch.Tensor], groups: Optional[List[Dict[str, Any]]] = None,
                            speculative: bool = False) -> None:
        """[zero] Stage 3: Adam on elements [lo, hi) of this rank's shard (shard coordinates);
        the new values of the rank's trainable chunk of the compute copy go home (merged:
        the chunk is the master itself). No all-gather: the next fetch gathers every rank's
        chunk. ``views``: the NVMe-homed states of the piece, written back by run (to the
        spare homes when ``speculative``: [Note: speculative updates]; a host-homed state
        is then read at home and written to its spare, [Note: out-of-place Adam])."""
        layout = self._layout
        s = u.shard
        numel = min(hi, s.numel) - lo  # elements the rank owns in this piece
        if numel <= 0:
            return
        start = time.perf_counter()

        def host_or_view(role: str, home: Any, begin: int) -> torch.Tensor:
            return views[role] if role in views else home[begin:begin + numel]

        def pieces(homes: Any) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            chunk = host_or_view("compute", homes.compute_home, lo)
            master = chunk if layout.merged else host_or_view("master", homes.master_home, lo)
            return (chunk, master, host_or_view("exp_avg", homes.moments_home, lo),
                    host_or_view("exp_avg_sq", homes.moments_home, s.state_numel + lo))
        chunk, master, exp_avg, exp_avg_sq = pieces(u)
        chunk_out, out = chunk, None
        if speculative:  # an entry that is a view is updated in place there and written to the spare
            chunk_out, master_out, exp_avg_out, exp_avg_sq_out = pieces(u.spare)
            out = OutOfPlace(master_out[:numel], exp_avg_out[:numel], exp_avg_sq_out[:numel],
                             None if layout.merged or layout.split_master else chunk[:numel])
        if layout.split_master:  # [Note: split master] the high halves are the chunk
            join_master(chunk[:numel], views["low"][:numel], master[:numel])
        self._adam.adam_range(u, s.lo + lo, s.lo + lo + numel, steps, master[:numel], exp_avg[:numel],
                         exp_avg_sq[:numel], None if layout.merged or layout.split_master else chunk_out[:numel],
                         False, grad_factor, copy_to_device=False, groups=groups, out=out)
        if layout.split_master:  # the master the update wrote (in place: it is a view)
            split_master(master[:numel], chunk_out[:numel], views["low"][:numel])
        self._timeline.span("adam", f"adam {u.name}[{lo}:{hi}] (shard)", start, time.perf_counter())
