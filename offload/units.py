"""Cutting a model into units, the flat layout of a unit's tensors, and residency states.

A *unit* is the group of parameters that moves together: by default each child of every
``nn.ModuleList`` (a transformer block), plus one *root* unit holding every parameter left
over (embeddings, final norm, head). A unit's tensors live in flat buffers, one per role:

  compute copy   all parameters, compute dtype          home: param_tier
  master         trainable parameters, fp32              home: optimizer_tier (with fp32
                                                          compute the compute copy is the
                                                          master: one buffer serves both)
  moments        exp_avg then exp_avg_sq, fp32           home: optimizer_tier
  grad           trainable parameters, fp32              host (accumulates micro-steps)

Inside every flat buffer the parameters sit at the same element offsets: trainable ones
first, ordered by optimizer param group so that one kernel call covers a group, then the
frozen ones. Buffers are padded to whole 4 KiB pages so that O_DIRECT can move them.

[Note: shared parameters] A parameter reachable from two units (tied embeddings used by a
block and the head, say) cannot belong to either: the unit that does not own it would run
without it. Such parameters move to the root unit, which stays on the device from the start
of forward to the end of backward.
"""
from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from offload._sizes import PAGE_BYTES
# The optimizer pipeline moves states in pieces of at most this many elements (a multiple of
# 4096, so that every piece starts on a page in fp32 and 16-bit buffers alike): staging
# memory is then a few pieces, not a few of the largest unit (an embedding can be huge).
# 1 Mi elements: a slot of master + moments is 12 MiB, and requests of 4 MiB still keep the
# I/O engine's queue full; larger pieces only add idle host memory.
OPTIMIZER_PIECE_NUMEL = 1 << 20


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def piece_ranges(numel: int, piece_numel: int, whole: bool) -> List[Tuple[int, int]]:
    """The staged step's pieces of a trainable prefix of ``numel`` fp32 elements (whole
    pages): ranges [lo, hi) of ``piece_numel`` elements, the last one the rest; one piece for a
    unit updated whole ([Note: whole-parameter optimizers])."""
    if whole:
        return [(0, numel)] if numel else []
    return [(lo, min(lo + piece_numel, numel)) for lo in range(0, numel, piece_numel)]


def padded_numel(numel: int, element_bytes: int) -> int:
    """Elements in a buffer of at least ``numel`` elements that fills whole pages."""
    return round_up(numel * element_bytes, PAGE_BYTES) // element_bytes


class Residency(enum.Enum):
    """Where a buffer's working copy stands relative to its home copy.

    A buffer whose home is the tier it is used on (optimizer states on the host, say) sits in
    LOADED or IN_USE for its whole life.
    """

    HOME = "home"          # only the home copy is valid; nothing on the working tier
    LOADING = "loading"    # a copy to the working tier is in flight
    LOADED = "loaded"      # the working copy is valid and equals the home copy
    IN_USE = "in_use"      # pinned: compute or Adam is reading or changing the working copy


LEGAL_TRANSITIONS: Dict[Residency, Tuple[Residency, ...]] = {
    Residency.HOME: (Residency.LOADING,),
    Residency.LOADING: (Residency.LOADED, Residency.HOME),  # HOME: the transfer failed
    Residency.LOADED: (Residency.IN_USE, Residency.HOME),
    Residency.IN_USE: (Residency.LOADED,),
}


class ResidencyState:
    """A residency value that only moves along LEGAL_TRANSITIONS."""

    __slots__ = ("what", "value")

    def __init__(self, what: str, value: Residency) -> None:
        self.what = what
        self.value = value

    def to(self, new: Residency) -> None:
        assert new in LEGAL_TRANSITIONS[self.value], \
            f"{self.what}: illegal residency transition {self.value.name} -> {new.name}"
        self.value = new

    def __eq__(self, other: object) -> bool:
        return self.value == other

    def __repr__(self) -> str:
        return f"{self.what}:{self.value.name}"


class UpdateState(enum.Enum):
    """Where a unit's optimizer update of this step stands ([Note: update states])."""

    IDLE = "idle"        # no early or deferred update this step (the step's own may run)
    QUEUED = "queued"    # on the optimizer worker's queue; its ticket not done
    RUNNING = "running"  # the worker has taken it; a fill can no longer be attached
    DONE = "done"        # its ticket was waited for: this step's gradients are consumed


LEGAL_UPDATE_TRANSITIONS: Dict[UpdateState, Tuple[UpdateState, ...]] = {
    UpdateState.IDLE: (UpdateState.QUEUED,),
    UpdateState.QUEUED: (UpdateState.RUNNING, UpdateState.IDLE),
    UpdateState.RUNNING: (UpdateState.DONE,),
    UpdateState.DONE: (UpdateState.IDLE,),
}


class UnitUpdate:
    """One unit's early or deferred optimizer update: its state, which only moves along
    LEGAL_UPDATE_TRANSITIONS, and what goes with it.

    [Note: update states] A unit's update in one optimizer step, on the scheduler of
    offload/optim/updates.py ([Note: deferred updates], [Note: early updates]):

      IDLE -> QUEUED    main thread: the update is queued (UpdateScheduler.queue_update,
                        under the scheduler's lock, with its ticket), during backward
                        (early) or by step() (deferred)
      QUEUED -> RUNNING optimizer worker: it takes the update off the queue (under the
                        scheduler's lock, so that a fill is attached before or never)
      QUEUED -> IDLE    main thread: step() takes a speculative update the worker has not
                        started off the queue, under the same lock (``take_back``; [Note:
                        speculative updates]): the step updates that unit like one never
                        updated
      RUNNING -> DONE   main thread, after waiting for the ticket (wait_optimizer,
                        settle_unit, settle_all)
      DONE -> IDLE      main thread: zero_grad (the step's gradients are gone)

    A ticket exists exactly in QUEUED and RUNNING. The swap writes of a RUNNING update
    outlive its ticket: no thread sees them end, so "written" is no state; ``pending``
    asks the ticket and the handles. The step's own updates (main thread, nothing
    queued) leave the unit IDLE. The rest are attributes, not states, because they
    vary independently of the progress above:
    - ``in_device`` ([Note: updates through the device copy]): the update writes the
      unit's device copy too. Main thread only: set when queued, by a fill or by the
      step's own staged update; cleared by a release, at the step's end and by
      ``forget`` (in DONE it still tells the step's end not to drop that copy).
    - ``fill`` ([Note: updates fill the device copy]): the device copy is a free slot
      the update fills; attached only in QUEUED, under the lock (``attach_fill``).
    - ``fetch_chained``: the unit's fetch in flight waits for this update; set when the
      fetch is chained (QUEUED or RUNNING), cleared when that fetch lands, which may be
      after the update is forgotten.
    - ``home_writes``: the swap writes of the update, set by the worker while RUNNING;
      a fetch must not read the home before them.
    - ``speculative`` ([Note: speculative updates]): the update writes the unit's spare
      homes, not its homes (never a fill; in_device, the device copy holds the
      speculative result until step() commits it or releases the copy), and step()
      commits or redoes it. Main thread: set when queued, cleared by step() and ``reset``.
    - ``speculation_failed``: a swap write of the speculative update failed; its homes are
      intact and step() redoes the update whatever the norm. Set by the thread that
      finishes the write (the worker, or the main thread once the worker is idle).
    """

    __slots__ = ("what", "state", "ticket", "home_writes", "in_device", "fill", "fetch_chained", "speculative",
                 "speculation_failed")

    def __init__(self, what: str) -> None:
        self.what = what
        self.state = UpdateState.IDLE
        self.ticket: Optional[Future] = None
        self.home_writes: List[Any] = []
        self.in_device = False
        self.fill = False
        self.fetch_chained = False
        self.speculative = False
        self.speculation_failed = False

    def _to(self, new: UpdateState) -> None:
        assert new in LEGAL_UPDATE_TRANSITIONS[self.state], \
            f"{self.what}: illegal update transition {self.state.name} -> {new.name}"
        self.state = new

    @property
    def updated(self) -> bool:
        """Adam has taken (or will take) this step's gradients of the unit."""
        return self.state is not UpdateState.IDLE

    @property
    def started(self) -> bool:
        """The worker has taken the update: no fill can be attached any more."""
        return self.state in (UpdateState.RUNNING, UpdateState.DONE)

    def queue(self, ticket: Future) -> None:
        self._to(UpdateState.QUEUED)
        self.ticket = ticket

    def start(self) -> None:
        self._to(UpdateState.RUNNING)

    def take_back(self) -> None:
        """[Note: speculative updates] A speculative update off the queue before it started:
        nothing was written, its ticket is done with."""
        assert self.speculative, f"{self.what}: only a speculative update is taken back"
        self._to(UpdateState.IDLE)
        self.ticket = None
        self.in_device = self.speculative = False

    def attach_fill(self) -> None:
        assert self.state is UpdateState.QUEUED, f"{self.what}: a fill attached in {self.state.name}"
        assert not self.speculative, f"{self.what}: a fill attached to a speculative update"
        self.in_device = self.fill = True

    def finish(self) -> None:
        """Its ticket is done and waited for; in_device, fill and the writes stay."""
        self._to(UpdateState.DONE)
        self.ticket = None

    def forget(self) -> None:
        """Its update and that update's writes are done (or reported elsewhere); a device
        copy it was writing into holds the update now."""
        if self.state is UpdateState.RUNNING:
            self._to(UpdateState.DONE)
        assert self.state is not UpdateState.QUEUED, f"{self.what}: forgotten while queued"
        self.ticket = None
        self.home_writes = []
        self.in_device = False
        self.fill = False

    def reset(self) -> None:
        """A new step: the last one's update is over."""
        if self.state is not UpdateState.IDLE:
            self._to(UpdateState.IDLE)
        self.speculative = self.speculation_failed = False

    def __repr__(self) -> str:
        return f"{self.what}:{self.state.name}"


@dataclass
class ParamEntry:
    """One parameter's place inside its unit's flat buffers."""

    fqn: str                       # first qualified name in model.named_parameters()
    param: nn.Parameter
    shape: torch.Size
    offset: int                    # element offset inside the unit's flat buffers
    numel: int
    trainable: bool
    group_index: Optional[int]     # optimizer param group (None when frozen)
    # the module attributes that hold it, in model.modules() order: several when tied
    # ([Note: shared parameter gradients] in optim/gradients.py)
    slots: Tuple[Tuple[nn.Module, str], ...] = ()


@dataclass
class UnitSpec:
    """What a unit is made of; no buffers yet."""

    index: int
    name: str                      # qualified module name; "<root>" for the root unit
    module: Optional[nn.Module]    # None for the root unit
    entries: List[ParamEntry]
    trainable_numel: int           # entries[:k] are trainable, k = number of trainable ones
    total_numel: int

    @property
    def trainable_entries(self) -> List[ParamEntry]:
        return [e for e in self.entries if e.trainable]

    @property
    def shared_numel(self) -> int:
        """Trainable elements of parameters held by several module attributes (tied)."""
        return sum(e.numel for e in self.entries if e.trainable and len(e.slots) > 1)

    @property
    def frozen_entries(self) -> List[ParamEntry]:
        return [e for e in self.entries if not e.trainable]

    @property
    def frozen_start(self) -> int:
        """Offset of the frozen tail (the first frozen entry; total_numel when none)."""
        return next((e.offset for e in self.entries if not e.trainable), self.total_numel)


UnitPredicate = Callable[[str, nn.Module], bool]


def _unit_modules(model: nn.Module, unit_classes: Sequence[str],
                  predicate: Optional[UnitPredicate]) -> List[Tuple[str, nn.Module]]:
    """Modules that form units, outermost first; a module inside a unit is not a unit."""
    if predicate is None and unit_classes:
        names = set(unit_classes)
        found = {type(m).__name__ for m in model.modules()}
        missing = names - found
        if missing:
            raise ValueError(
                f"unit_classes: no module of class {', '.join(sorted(missing))} in the model "
                f"(classes present: {', '.join(sorted(found))})")
        predicate = lambda _name, module: type(module).__name__ in names  # noqa: E731
    chosen: List[Tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            qualified = f"{prefix}.{child_name}" if prefix else child_name
            if predicate is None:
                is_unit = isinstance(module, nn.ModuleList)
            else:
                is_unit = bool(predicate(qualified, child))
            if is_unit:
                chosen.append((qualified, child))
            else:
                visit(qualified, child)

    visit("", model)
    return chosen


def split_into_units(model: nn.Module, group_of: Dict[nn.Parameter, int],
                     compute_element_bytes: int, unit_classes: Sequence[str] = (),
                     predicate: Optional[UnitPredicate] = None) -> List[UnitSpec]:
    """Cut ``model`` into units. ``group_of`` maps each trainable parameter to its optimizer
    param group; a trainable parameter the optimizer does not know is an error (it would
    silently never train). Frozen parameters start on a page boundary of the compute copy,
    so the trainable prefix of every buffer can be read and written on its own."""
    fqn_of: Dict[nn.Parameter, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=True):
        fqn_of[p] = fqn
    if not fqn_of:
        raise ValueError(f"model: {type(model).__name__} has no parameters, so there is nothing to offload; "
                         "wrap a model with parameters (nn.Module.parameters() is empty)")
    strays = [(gi, tuple(p.shape)) for p, gi in group_of.items() if p not in fqn_of]
    if strays:
        raise ValueError(
            f"optimizer: {len(strays)} parameter(s) of its param groups are not parameters of the model "
            f"given to wrap(), so they would never be trained (the first: param group {strays[0][0]}, "
            f"shape {strays[0][1]}); build the optimizer over model.parameters()")

    owners: Dict[nn.Parameter, List[int]] = {}
    unit_modules = _unit_modules(model, unit_classes, predicate)
    for index, (_name, module) in enumerate(unit_modules):
        for p in module.parameters():
            owners.setdefault(p, [])
            if index not in owners[p]:
                owners[p].append(index)

    members: List[List[nn.Parameter]] = [[] for _ in unit_modules]
    root_members: List[nn.Parameter] = []
    for p, fqn in fqn_of.items():
        units_of_p = owners.get(p, [])
        if len(units_of_p) == 1:
            members[units_of_p[0]].append(p)
        else:  # [Note: shared parameters]: shared or outside every unit
            root_members.append(p)

    for p, fqn in fqn_of.items():
        if p.requires_grad and p not in group_of:
            raise ValueError(
                f"optimizer: trainable parameter {fqn!r} is in no param group of the optimizer "
                "given to wrap(); add it or set requires_grad=False")

    slots_of: Dict[nn.Parameter, List[Tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for attribute, p in m._parameters.items():
            if p is not None:
                slots_of.setdefault(p, []).append((m, attribute))

    specs: List[UnitSpec] = []

    def make(name: str, module: Optional[nn.Module], params: List[nn.Parameter]) -> None:
        trainable = [p for p in params if p.requires_grad]
        frozen = [p for p in params if not p.requires_grad]
        trainable.sort(key=lambda p: group_of[p])  # stable: model order inside a group
        entries, offset = [], 0
        for p in trainable + frozen:
            if p is (frozen[0] if frozen else None):
                offset = padded_numel(offset, compute_element_bytes)
            entries.append(ParamEntry(
                fqn=fqn_of[p], param=p, shape=p.shape, offset=offset, numel=p.numel(),
                trainable=p.requires_grad, group_index=group_of.get(p) if p.requires_grad else None,
                slots=tuple(slots_of.get(p, ()))))
            offset += p.numel()
        specs.append(UnitSpec(index=len(specs), name=name, module=module, entries=entries,
                              trainable_numel=sum(p.numel() for p in trainable), total_numel=offset))

    # The root unit first: it is fetched first in forward and pinned until backward ends.
    make("<root>", None, root_members)
    for (name, module), params in zip(unit_modules, members):
        if params:
            make(name, module, params)
    return specs
