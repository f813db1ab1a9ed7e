"""The device tier: one arena allocated once and carved into unit slots.

On a machine without CUDA the device is the CPU and the arena is ordinary RAM; the budget is
enforced by this accounting alone. Allocating the arena once matters there too: memory
touched for the first time is several times slower than memory reused (the VM hands freed
pages back to its host), so the runtime never allocates per fetch.
"""
from __future__ import annotations

import bisect
from typing import List, Optional, Tuple

import torch

from offload.io.engine import HUGE_PAGE_BYTES
from offload.tiers.host import mapped_empty, release_pages
from offload.tiers.streams import CudaStreams, Event, HostStreams, StandInStreams, Streams


class DeviceTier:
    """Byte-accounted slots inside one preallocated arena of the compute dtype.

    ``used_bytes`` counts slots handed out, gradient bytes passing through the runtime
    (``hold_transient``), [zero] the gradient buckets of the reduce-scatters
    (``hold_buckets``: [Note: gradient buckets in the device budget] in memory/budget.py;
    bounded by ``bucket_room_bytes`` unless that is None, device_budget None) and the saved
    activations the engine keeps on the device (``hold_activations``: only with
    activation_offload set, [Note: saved activations] in memory/activations.py);
    ``peak_bytes`` is its maximum, never above ``budget_bytes``.
    Slots and activations share the arena's capacity (the budget less the reserve for
    gradients on their way out): a slot is refused while activations fill it, and the
    other way round; unless ``bounds_activations`` is False (device_budget None: no limit
    beyond the model's own size), when activations are counted but bound nothing.
    """

    #: [Note: streams] a fill waits for the compute stream's last reads of its bytes; False
    #: only in the test that shows the CPU stand-in catching the fill that does not
    fills_wait_for_reads = True

    def __init__(self, device: torch.device, dtype: torch.dtype, capacity_numel: int,
                 budget_bytes: int, host_addressable: bool = True, bounds_activations: bool = True,
                 pages_follow_slots: bool = False, bucket_room_bytes: Optional[int] = None) -> None:
        """``host_addressable``: on a CPU device, False makes it the stand-in of CUDA
        ([Note: streams], ``Layout.device_is_host``). ``pages_follow_slots``: a CPU device
        whose saved activations share the capacity ([Note: device pages follow the slots])."""
        self.bounds_activations = bounds_activations
        self.device = device
        self.dtype = dtype
        self.element_bytes = torch.empty(0, dtype=dtype).element_size()
        self.budget_bytes = budget_bytes
        # Touched once here. On the CPU the arena is page aligned, like every slot in it (a
        # unit's buffers are whole pages): the I/O engine reads swap files straight into a
        # slot, where an unaligned one would go through a bounce buffer, synchronously and
        # behind every request in flight.
        # [Note: device pages follow the slots] On a CPU device whose saved activations
        # count in the arena's capacity (activation_offload set), the arena's RAM is only
        # what its slots hold: untouched at first, the pages of a freed slot given back. The
        # activations the capacity counts are the model's own allocations, so the process's
        # RAM for the device is then slots + activations <= device_budget, not the arena
        # beside them. Pages of arenas under 2 MiB (shared mappings) stay: a rounding.
        self.pages_follow_slots = pages_follow_slots and device.type == "cpu" and host_addressable \
            and capacity_numel * self.element_bytes >= HUGE_PAGE_BYTES
        if device.type == "cpu" and self.pages_follow_slots:
            self.arena = mapped_empty(capacity_numel * self.element_bytes, dtype)  # fresh zero pages
        elif device.type == "cpu":
            self.arena = mapped_empty(capacity_numel * self.element_bytes, dtype).zero_()
        else:
            self.arena = torch.zeros(capacity_numel, dtype=dtype, device=device)
        # A huge-page arena starts inside its mapping (aligned from within): views of the
        # arena are recognized and rebuilt by offsets in its storage, not in the arena.
        self._storage_ptr = self.arena.untyped_storage().data_ptr()
        self._storage_offset = self.arena.storage_offset()
        self._free: List[Tuple[int, int]] = [(0, capacity_numel)] if capacity_numel else []
        self.capacity_bytes = capacity_numel * self.element_bytes
        self.slot_bytes = 0
        self.transient_bytes = 0
        # [Note: gradient buckets in the device budget] None: counted, bounding nothing
        self.bucket_room_bytes = bucket_room_bytes
        self.bucket_bytes = 0
        self.activation_bytes = 0  # [Note: saved activations]
        self.activation_peak_bytes = 0
        self.peak_bytes = 0
        self._borrowed: Optional[Tuple[int, int]] = None  # see borrow
        # [Note: streams] the one place that decides how work on the device is ordered
        self.streams: Streams = CudaStreams(device) if device.type == "cuda" else \
            HostStreams() if host_addressable else StandInStreams(self.arena)
        # Element ranges [lo, hi) of the arena with the event of the compute stream's last
        # reads of them (reads_done); a copy into an overlapping range waits for the latest.
        self._reads: List[Tuple[int, int, int, Event]] = []
        self._num_reads = 0

    @property
    def host_addressable(self) -> bool:
        """Whether the arena is host RAM the engine and the I/O engine address directly (a
        CPU device as users run it), not memory reached only through copies."""
        return self.streams.host_addressable

    @property
    def used_bytes(self) -> int:
        return self.slot_bytes + self.transient_bytes + self.bucket_bytes + self.activation_bytes

    def _note_peak(self) -> None:
        unbounded = (0 if self.bounds_activations else self.activation_bytes) + \
            (self.bucket_bytes if self.bucket_room_bytes is None else 0)
        assert self.used_bytes - unbounded <= self.budget_bytes, \
            f"device budget exceeded: {self.used_bytes} > {self.budget_bytes} bytes"
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def allocate(self, numel: int) -> Optional[int]:
        """Element offset of a free slot of ``numel`` elements (first fit), or None."""
        assert self._borrowed is None, "a slot handed out while wrap borrows the arena (see borrow)"
        held = self._held_bytes()
        if held and self.slot_bytes + held + numel * self.element_bytes > self.capacity_bytes:
            # [Note: saved activations], [Note: gradient buckets in the device budget] they
            # hold the rest of the capacity
            return None
        for i, (start, length) in enumerate(self._free):
            if length >= numel:
                if length == numel:
                    del self._free[i]
                else:
                    self._free[i] = (start + numel, length - numel)
                self.slot_bytes += numel * self.element_bytes
                self._note_peak()
                return start
        return None

    def free(self, offset: int, numel: int) -> None:
        """Return a slot; neighbours coalesce."""
        self.slot_bytes -= numel * self.element_bytes
        if self.pages_follow_slots:
            release_pages(self.arena[offset:offset + numel])
        i = bisect.bisect_left(self._free, (offset, 0))
        self._free.insert(i, (offset, numel))
        if i + 1 < len(self._free) and offset + numel == self._free[i + 1][0]:
            self._free[i] = (offset, numel + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]

    def borrow(self, nbytes: int) -> Optional[torch.Tensor]:
        """[Note: wrap scratch in the arena] ``nbytes`` of a CPU arena's free bytes, page
        aligned, as uint8, or None (CUDA: the arena is not host memory; no free run that
        long). Wrap writes every unit home through buffers the size of the largest unit's
        compute copy and master (or, split, its low halves: [Note: split master]); on a CPU
        device the arena is RAM already touched, idle until the first fetch
        (offload/memory/homes.py takes the compute copy's in the root unit's slot, the rest
        here): the scratch adds nothing to wrap's peak host memory, and wrap pays no first
        touch of fresh pages for it. No slot is handed out while borrowed (``allocate``
        asserts it); ``give_back`` zeroes the bytes again, as the arena starts (where the
        arena's pages follow its slots, it gives them back: the scratch is RAM only while
        wrap writes through it)."""
        assert self._borrowed is None, "the arena is borrowed already"
        if not self.host_addressable:
            return None
        numel = -(-nbytes // self.element_bytes)
        start = next((start for start, length in self._free if length >= numel), None)
        if start is None:
            return None
        self._borrowed = (start, numel)
        return self.arena[start:start + numel].view(torch.uint8)[:nbytes]

    def give_back(self) -> None:
        """The end of a ``borrow``: its bytes are zeros and free again."""
        if self._borrowed is not None:
            start, numel = self._borrowed
            if self.pages_follow_slots:
                release_pages(self.arena[start:start + numel])  # zeros, and not resident
            else:
                self.arena[start:start + numel].zero_()
            self._borrowed = None

    @property
    def free_bytes(self) -> int:
        """Bytes of the arena not handed out (possibly in several pieces)."""
        return sum(length for _, length in self._free) * self.element_bytes

    def view(self, offset: int, numel: int) -> torch.Tensor:
        return self.arena[offset:offset + numel]

    def offset_of(self, t: torch.Tensor) -> Optional[int]:
        """The arena element where ``t``'s data starts, or None when t does not view the arena."""
        if t.untyped_storage().data_ptr() != self._storage_ptr:
            return None
        return t.storage_offset() - self._storage_offset

    def strided_view(self, size: torch.Size, stride: Tuple[int, ...], offset: int) -> torch.Tensor:
        """A view of the arena from element ``offset`` (the inverse of ``offset_of``)."""
        return self.arena.as_strided(size, stride, self._storage_offset + offset)

    def hold_transient(self, num_bytes: int) -> None:
        """Count bytes the runtime holds on the device briefly (a gradient on its way out)."""
        self.transient_bytes += num_bytes
        self._note_peak()

    def drop_transient(self, num_bytes: int) -> None:
        self.transient_bytes -= num_bytes

    def bucket_overflow_bytes(self, extra: int = 0) -> int:
        """[Note: gradient buckets in the device budget] Bytes of gradient buckets (with
        ``extra`` more) past their room: they hold arena capacity, as saved activations do."""
        if self.bucket_room_bytes is None:
            return 0
        return max(0, self.bucket_bytes + extra - self.bucket_room_bytes)

    def _held_bytes(self, extra_buckets: int = 0) -> int:
        """Arena capacity held outside the slots: bounded saved activations and gradient
        buckets past their room."""
        return (self.activation_bytes if self.bounds_activations else 0) + self.bucket_overflow_bytes(extra_buckets)

    def buckets_fit(self, num_bytes: int) -> bool:
        """[Note: gradient buckets in the device budget] Whether ``num_bytes`` more of
        gradient buckets fit: in their room, or past it in the arena capacity the slots in
        use and the saved activations leave."""
        return self.bucket_overflow_bytes(num_bytes) == 0 or \
            self.slot_bytes + self._held_bytes(num_bytes) <= self.capacity_bytes

    def hold_buckets(self, num_bytes: int) -> None:
        """[Note: gradient buckets in the device budget] Count gradient buckets made on the
        device (the caller checked ``buckets_fit``)."""
        assert self.buckets_fit(num_bytes), "gradient buckets past their room and the arena's free capacity"
        self.bucket_bytes += num_bytes
        self._note_peak()

    def drop_buckets(self, num_bytes: int) -> None:
        self.bucket_bytes -= num_bytes

    def activations_fit(self, num_bytes: int) -> bool:
        """Whether ``num_bytes`` more of saved activations fit beside the slots handed out."""
        return not self.bounds_activations or \
            self.slot_bytes + self._held_bytes() + num_bytes <= self.capacity_bytes

    def hold_activations(self, num_bytes: int) -> None:
        """[Note: saved activations] Count saved tensors the engine keeps on the device (the
        caller checked ``activations_fit``)."""
        assert self.activations_fit(num_bytes), "saved activations past the device's capacity"
        self.activation_bytes += num_bytes
        self.activation_peak_bytes = max(self.activation_peak_bytes, self.activation_bytes)
        self._note_peak()

    def drop_activations(self, num_bytes: int) -> None:
        self.activation_bytes -= num_bytes

    def reads_done(self, offset: int, numel: int, what: str) -> None:
        """[Note: streams] The compute stream is done reading elements [offset, offset +
        numel) once the work queued so far has run (the slot is released, or its unit's
        update is queued): a later copy into them waits for an event recorded now."""
        self.streams.compute_access(self.view(offset, numel), write=False, what=what, check=False)
        if self.streams.host_addressable:
            return
        lo, hi = offset, offset + numel
        self._num_reads += 1
        self._reads = [r for r in self._reads if not lo <= r[0] < r[1] <= hi]
        self._reads.append((lo, hi, self._num_reads, self.streams.record_compute()))

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, what: str = "") -> Event:
        """Queue the copy of ``src`` into ``dst`` (a view of the arena) on the copy stream,
        after the compute stream's last reads of ``dst`` ([Note: streams]); its event. The
        caller keeps ``src`` unchanged until the event completes."""
        offset = self.offset_of(dst)
        after: List[Event] = []
        if offset is not None and self._reads and self.fills_wait_for_reads:
            lo, hi = offset, offset + dst.numel()
            overlapping = [r for r in self._reads if r[0] < hi and lo < r[1]]
            if overlapping:  # compute events are ordered: the latest implies the others
                after.append(max(overlapping, key=lambda r: r[2])[3])
        return self.streams.copy(dst, src, after=after, what=what)

    def wait_for_reads(self, dst: torch.Tensor) -> None:
        """Block the calling thread until the compute stream's last reads of ``dst`` (a view
        of the arena) have run: before bytes are written there other than by ``copy_in``
        (a collective into a slot, [Note: collectives on the device])."""
        offset = self.offset_of(dst)
        if offset is not None and self._reads and self.fills_wait_for_reads:
            lo, hi = offset, offset + dst.numel()
            overlapping = [r for r in self._reads if r[0] < hi and lo < r[1]]
            if overlapping:
                max(overlapping, key=lambda r: r[2])[3].synchronize()

    def compute_uses(self, offset: int, numel: int, event: Optional[Event], what: str) -> None:
        """The compute stream is about to read elements [offset, offset + numel): it waits
        for ``event`` (the fill that brought them) first."""
        if event is not None:
            self.streams.compute_wait(event)
        self.streams.compute_access(self.view(offset, numel), write=False, what=what)

    def pin(self, t: torch.Tensor) -> None:
        """[Note: pinned buffers] Page-lock host tensor ``t`` in place (CUDA and its stand-in)."""
        self.streams.pin(t)

    def unpin(self, t: torch.Tensor) -> None:
        self.streams.unpin(t)

    def close(self) -> None:
        """Every queued copy has run; the copy stream stops."""
        self.streams.close()
