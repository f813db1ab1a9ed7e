"""Per-entry state slots: a unit's moments home holds, for each parameter, only the slots its
own optimizer keeps.

[Note: per-entry state slots]
A unit's moments home has ``UnitState.state_slots`` *slots* (Adam's exp_avg and exp_avg_sq;
an elementwise or whole-parameter optimizer's own, [Note: elementwise optimizers]), each of
them laid out like the unit's fp32 master. A parameter uses the slots its own optimizer keeps
for it (``slot_indices``: Adam two, Muon's matrices one, Adafactor's matrices none, its vectors
one). Slot s keeps only the master's *pages* (``PAGE_NUMEL`` elements, 4 KiB) that hold an
element of a parameter using it, in master order (``StateSlots``): element x of slot s is
physical element ``offset(s) + 1024 * (kept pages of s before x's page) + x % 1024`` of the
home. So
- the master range [lo, hi) of a piece whose bounds are on pages (every piece: the pieces cut
  at OPTIMIZER_PIECE_NUMEL, a whole unit ends on a page) is one contiguous, page-aligned range
  of each slot, and two pieces never share a page: the staged step reads and writes one
  request per slot per piece, as with whole slots (optim/step.py ``_moment_parts``), into a
  staging buffer that holds the piece's spans one after another (``staged_parts``), so a
  staging slot needs only what the largest piece moves (``StateSlots.largest_piece_numel``,
  ``UnitSizes.staged_moments_numel``, ``budget.slot_shape``);
- a parameter's elements are contiguous in every slot it uses (all its pages are kept);
- a page partly held by parameters that do not use the slot is kept whole: its other elements
  are never read as state; the virtual layout below reads zeros there and drops what is
  written there (``StateSlots.unpack``, ``pack``, ``owned_parts``).
A unit whose slots keep every page (every parameter uses every slot) has the layout before
(slot s at ``s * state_numel``) and its home is a plain home (``StateSlots.of`` gives None).
Otherwise the home is a ``PackedHome``: the tier's buffer and its StateSlots. Code that steps
states works on the physical slots (``StateSlots.span``, ``PackedSlot``); checkpoints and the
failed-write copies (``PipelinedStep.dirty``) see the *virtual* layout, every slot whole as
before, through ``Homes.load``, ``load_range``, ``store``, ``store_range`` (zeros where a
parameter does not use a slot, as the whole slots held), so their format is unchanged. The
budgets, "auto" placement and ``offload plan --optimizer`` count the physical bytes
(``UnitSizes.moments_numel``: ``StateSlots.numel``). Only one process or ZeRO stage 0
has such homes: stages >= 1 run Adam alone, whose parameters use both slots.
"""
from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch

from offload._sizes import FP32_BYTES, PAGE_BYTES
from offload.units import piece_ranges

__all__ = ["PAGE_NUMEL", "PackedHome", "PackedSlot", "StateSlots", "home_views", "slot_indices",
           "staged_parts", "staged_views"]

PAGE_NUMEL = PAGE_BYTES // FP32_BYTES  # fp32 elements of a page


def slot_indices(rule: Any, group_index: int, ndim: int) -> Tuple[int, ...]:
    """The moments-home slots a parameter uses ([Note: per-entry state slots]): both for the
    Adam kernel (``rule`` None), else those of the names its optimizer keeps for a parameter
    of its group (``group_index`` inside that optimizer) and dimensionality."""
    if rule is None:
        return (0, 1)
    names = rule.group_slots[group_index]
    if isinstance(names, dict):  # [Note: whole-parameter optimizers] names per dimensionality
        names = names[ndim]
    return tuple(sorted(rule.slots.index(name) for name in names))


class StateSlots:
    """Which master pages each slot of one unit's moments home keeps, and where ([Note:
    per-entry state slots]). ``entries``: (offset, numel, slot indices) of each trainable
    parameter in the master."""

    def __init__(self, num_slots: int, state_numel: int, entries: Sequence[Tuple[int, int, Sequence[int]]]) -> None:
        assert state_numel % PAGE_NUMEL == 0, "the master fills whole pages"
        num_pages = state_numel // PAGE_NUMEL
        self.num_slots = num_slots
        self.state_numel = state_numel
        # owned[s]: the master ranges of parameters using slot s, in order
        self.owned: List[List[Tuple[int, int]]] = [[] for _ in range(num_slots)]
        kept = [[False] * num_pages for _ in range(num_slots)]
        for offset, numel, slots in entries:
            for s in slots:
                assert s < num_slots, "a parameter uses a slot the home does not have"
                if numel:
                    self.owned[s].append((offset, offset + numel))
                    for page in range(offset // PAGE_NUMEL, (offset + numel - 1) // PAGE_NUMEL + 1):
                        kept[s][page] = True
        # before[s][p]: kept pages of slot s before page p (p = num_pages: all of them)
        self._before: List[List[int]] = []
        for flags in kept:
            counts, n = [], 0
            for flag in flags:
                counts.append(n)
                n += flag
            counts.append(n)
            self._before.append(counts)
        self._kept = kept
        self.slot_numel = [counts[-1] * PAGE_NUMEL for counts in self._before]
        self.slot_offset = [sum(self.slot_numel[:s]) for s in range(num_slots)]
        self.numel = sum(self.slot_numel)

    @classmethod
    def of(cls, num_slots: int, state_numel: int,
           entries: Sequence[Tuple[int, int, Sequence[int]]]) -> Optional["StateSlots"]:
        """The unit's StateSlots, or None where every slot keeps every page (the plain layout)."""
        if all(len(k) == num_slots for _, _, k in entries):  # every parameter uses every slot
            return None
        slots = cls(num_slots, state_numel, entries)
        return None if slots.numel == num_slots * state_numel else slots

    def physical(self, s: int, x: int) -> int:
        """Element of the home holding master element x of slot s (x on a kept page, or a
        page boundary: then where the next kept page starts)."""
        page, within = divmod(x, PAGE_NUMEL)
        if within:
            assert self._kept[s][page], f"master element {x} of slot {s} is not kept"
        return self.slot_offset[s] + self._before[s][page] * PAGE_NUMEL + within

    def span(self, s: int, lo: int, hi: int) -> Tuple[int, int]:
        """Elements [a, b) of the home that hold slot s of master range [lo, hi), whose bounds
        are on pages (or hi the master's end): contiguous and page-aligned."""
        assert lo % PAGE_NUMEL == 0 and hi % PAGE_NUMEL == 0, "a piece starts and ends on pages"
        return self.physical(s, lo), self.physical(s, hi)

    def piece_numel(self, lo: int, hi: int) -> int:
        """Elements of the home that piece [lo, hi) moves: its span of every slot."""
        return sum(b - a for a, b in (self.span(s, lo, hi) for s in range(self.num_slots)))

    def largest_piece_numel(self, piece_numel: int, whole: bool) -> int:
        """The most elements of the home one piece of the staged step moves, the unit's
        pieces cut as ``units.piece_ranges`` cuts them (``whole``: one piece)."""
        return max((self.piece_numel(lo, hi) for lo, hi in piece_ranges(self.state_numel, piece_numel, whole)),
                   default=0)

    def pack(self, virtual: torch.Tensor) -> torch.Tensor:
        """The home's contents for ``virtual`` (every slot whole, ``state_numel`` apart)."""
        physical = torch.zeros(self.numel, dtype=torch.float32)
        for s in range(self.num_slots):
            base = s * self.state_numel
            for a, b in self.owned[s]:
                start = self.physical(s, a)
                physical[start:start + b - a].copy_(virtual[base + a:base + b])
        return physical

    def unpack(self, physical: torch.Tensor) -> torch.Tensor:
        """The virtual layout of the home's contents ``physical`` (zeros where a parameter
        does not use a slot)."""
        virtual = torch.zeros(self.num_slots * self.state_numel, dtype=torch.float32)
        for s in range(self.num_slots):
            base = s * self.state_numel
            for a, b in self.owned[s]:
                start = self.physical(s, a)
                virtual[base + a:base + b].copy_(physical[start:start + b - a])
        return virtual

    def owned_parts(self, s: int, lo: int, hi: int) -> List[Tuple[int, int]]:
        """The parts of master range [lo, hi) held by parameters using slot s."""
        return [(max(a, lo), min(b, hi)) for a, b in self.owned[s] if max(a, lo) < min(b, hi)]


class PackedHome(NamedTuple):
    """A moments home in the per-entry layout ([Note: per-entry state slots]): the tier's
    buffer (host tensor or swap extent) and its StateSlots."""
    home: Any
    slots: StateSlots

    @property
    def nbytes(self) -> int:
        return self.slots.numel * FP32_BYTES


class PackedSlot:
    """Slot s of master range [lo, hi) of a per-entry home, indexed as a master slice is
    (element ``lo + i`` at ``[i]``): ``buffer`` holds the slot's span (``StateSlots.span``).
    ``[a:b]`` is a view; a slice must lie on kept pages (a parameter using the slot)."""

    def __init__(self, slots: StateSlots, s: int, lo: int, buffer: torch.Tensor) -> None:
        self.slots, self.s, self.lo, self.buffer = slots, s, lo, buffer
        self._base = slots.physical(s, lo)

    def __getitem__(self, r: slice) -> torch.Tensor:
        a, b = self.lo + r.start, self.lo + r.stop
        if a == b:
            return self.buffer[:0]
        start = self.slots.physical(self.s, a) - self._base
        assert self.slots.physical(self.s, b - 1) - self._base == start + (b - a - 1), \
            "a slice crosses a page the slot does not keep"
        return self.buffer[start:start + b - a]

    def data_ptr(self) -> int:
        return self.buffer.data_ptr()

    def copy_owned(self, src: "PackedSlot", a: int, b: int) -> None:
        """Copy the elements of parameters using the slot in [a, b) (relative to lo) from
        ``src``, the same slot of the same range elsewhere."""
        for x, y in self.slots.owned_parts(self.s, self.lo + a, self.lo + b):
            self[x - self.lo:y - self.lo].copy_(src[x - self.lo:y - self.lo])


def home_views(home: PackedHome, lo: int, hi: int) -> Tuple[Optional[PackedSlot], Optional[PackedSlot]]:
    """Slots 0 and 1 of master range [lo, hi) of a host PackedHome (None: a slot it does not
    have), indexed from lo."""
    slots = home.slots
    views: List[Optional[PackedSlot]] = []
    for s in range(2):
        if s >= slots.num_slots:
            views.append(None)
            continue
        a, b = slots.span(s, lo, hi)
        views.append(PackedSlot(slots, s, lo, home.home[a:b]))
    return views[0], views[1]


def staged_views(slots: StateSlots, buffer: torch.Tensor, lo: int, hi: int
                 ) -> Tuple[Optional[PackedSlot], Optional[PackedSlot]]:
    """Slots 0 and 1 of piece [lo, hi) read into a staging buffer that holds the piece's span
    of each slot, one after another (``staged_parts``)."""
    views: List[Optional[PackedSlot]] = []
    for s, (start, a, b) in enumerate(staged_parts(slots, lo, hi)):
        views.append(PackedSlot(slots, s, lo, buffer[start:start + b - a]))
    views += [None] * (2 - len(views))
    return views[0], views[1]


def staged_parts(slots: StateSlots, lo: int, hi: int) -> List[Tuple[int, int, int]]:
    """(start in the staging buffer, span in the home) of each slot of piece [lo, hi): the
    spans one after another, ``StateSlots.piece_numel`` elements in all."""
    parts, start = [], 0
    for s in range(slots.num_slots):
        a, b = slots.span(s, lo, hi)
        parts.append((start, a, b))
        start += b - a
    return parts
