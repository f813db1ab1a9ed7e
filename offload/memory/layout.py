"""The layout of a run: every config mode resolved once, at wrap, into one object
(``Layout``), and the record of one unit's buffers and runtime state (``UnitState``).

[Note: layout] Nothing after wrap reads ``OffloadConfig``: the engine and the mechanisms it
delegates to take the resolved modes from ``Layout``. The modes that depend on one another
(a merged fp32 master, a split master, the staged step, early updates, ZeRO gathers) are
decided here and nowhere else.

[Note: threads] Which thread writes what: UnitState is the one record several threads
write, so the rule for every field of it and of the mechanism objects lives here.
- The main thread (the caller's) runs every public verb and every hook (autograd runs them
  on the thread that runs backward, while the caller blocks), so it writes the hook and
  gradient fields (calls, backward_done, grads_since_use, has_grad, grad, param_grads,
  delayed_update, delayed_pending), spills gradients
  (``grad_spilled``, ``spilled_grad_squares``: [Note: gradient spill], only of units with
  no update queued or running), and it alone
  moves ``compute_state`` and ``device_offset``, publishes ``pending``/``ready_event``
  (memory/residency.py), runs the step with clipping, fp16 or ZeRO and every collective
  except stage 3's gathers and stage 1-2 delayed updates' gathers, and writes the
  micro-step count (``UpdateScheduler.micro_step``, which a delayed update reads on the
  optimizer worker) and the failure state (``FailureState``).
- The copy worker (``offload-copy``, DeviceResidency) runs the transfers of a fetch into
  the device slot it was handed and stage-3 all-gathers ([Note: parameter all-gathers]):
  it writes tensor data in the slot, no field of UnitState, and takes and gives back the
  staging buffers of reads from NVMe (``DeviceResidency._fetch_staging``, which no other
  thread touches after wrap).
- The optimizer worker (``offload-adam``, UpdateScheduler) runs one update at a time: it
  moves ``update`` QUEUED -> RUNNING under ``UpdateScheduler.lock`` (which also guards the
  queue and a fill being attached: [Note: update states]), writes the unit's states at
  home, ``steps`` and ``update.home_writes``, an early update's ``early_grad_squares`` and
  ``early_nonfinite`` (which step()'s norm reads), [zero] a stage 1-2 delayed update's
  all-gather ([Note: delayed updates across ranks]), PipelinedStep's ring fields (its
  docstring says when the main thread may read them), and gives the unit's gradients back
  (under the gradient pool's lock and HostTier's). Homes runs there too: the updates read
  and write the homes through it, and a slot's failed write-back finished by the worker
  reads the unit's states into ``PipelinedStep.dirty`` ([Note: swap I/O failures]), which
  the main thread reads once the worker is idle (wait_optimizer). The main thread reads
  what the worker wrote only after waiting for the unit's ticket. An update of a spilled unit reads its gradients
  back (``Gradients.grad_range``) on the thread that runs it, which then owns them.
  A delayed update ([Note: delayed updates]) owns its unit's gradient fields from step()
  until the main thread waits for it and takes them back (``Gradients.take_back``).
- The native I/O threads hold no Python state; a request completes through its handle.
Shared counters have locks of their own: Stats, NvmeTier (bytes, recent requests),
HostTier (used bytes); the Timeline appends to deques (atomic).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from offload._sizes import FP32_BYTES
from offload.config import OffloadConfig, local_world_size
from offload.tiers import HostTier
from offload.tiers.streams import Event, standin_requested
from offload.memory.state_slots import PackedHome, StateSlots
from offload.units import ParamEntry, Residency, ResidencyState, UnitSpec, UnitUpdate, padded_numel
from offload.zero.shards import ParamShard, ShardRange

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Layout:
    """The modes of one run, resolved from its config, device and ZeRO partition."""

    device: torch.device
    # [Note: streams] the arena is host RAM the engine and the I/O engine address directly
    # (a CPU device as users run it); False on CUDA and on the CPU stand-in of CUDA
    device_is_host: bool
    compute_dtype: torch.dtype
    compute_element_bytes: int
    # Home of the compute copies: "device", "host" or "nvme" when every unit's is there,
    # "mixed" when placed per unit ([Note: placement by budget], memory/placement.py), or
    # "auto" before placement; ``compute_tier(i)`` is unit i's.
    param_tier: str
    optimizer_tier: str          # the same for the fp32 masters and Adam moments
    compute_tiers: Tuple[str, ...]   # per unit, root first (empty before placement)
    state_tiers: Tuple[str, ...]     # per unit; "" for a unit with nothing to train
    needs_nvme: bool             # some state lives on NVMe
    # [fp32 merge] With fp32 compute the compute copy is the master: one buffer, homed on
    # param_tier, serves both (unless the compute copy lives on the device).
    merged: bool
    # [Note: split master] the master at home is its low half; the compute copy the high
    split_master: bool
    # [Note: gradient ownership] the host tier takes autograd's gradient tensors; [zero]
    # collectives work on flat buffers, so not with several ranks
    adopts_grads: bool
    # [Note: updates through the device copy]
    device_copy_updates: bool
    # [zero] stage 3: every fetch all-gathers the unit's chunks
    gathers: bool
    # The piece pipeline with staging slots; [zero] stage >= 1 updates whole shards through
    # reused buffers of its own instead.
    staged_step: bool
    # Early optimizer updates (a unit's Adam as soon as its gradients are final in backward).
    # With global clipping or fp16 overflow checks (which need every gradient first) only
    # as speculative updates; [zero] with several ranks at stage 3, or at stage 2 where
    # every compute copy is homed on the host ([Note: early updates across ranks] in
    # zero/partition.py).
    early_allowed: bool
    # [Note: speculative updates] early updates write a second set of homes, committed or
    # redone when step() knows the global norm
    speculative: bool
    # [Note: speculative updates] per unit, whether it has spare homes to speculate into
    # (the swap directory's free space may hold only some); () : every unit but the root
    spare_units: Tuple[bool, ...]
    accumulation_steps: int
    max_grad_norm: Optional[float]
    fp16: bool
    skip_nonfinite_steps: bool
    initial_loss_scale: float
    min_loss_scale: float
    loss_scale_window: int
    device_budget: Optional[int]
    # host_budget as given, or where a tier is "auto" or none was given, the default:
    # DEFAULT_HOST_FRACTION of the memory available at wrap (host_budget_default says which)
    host_budget: Optional[int]
    host_budget_default: bool
    optimizer_pipeline_depth: int
    prefetch: bool
    prefetch_units: int
    prefetch_bytes: Optional[int]
    overlap_step_with_forward: bool
    # [Note: delayed updates] (optim/delayed.py): optimizer steps after the warm-up ones run
    # on the worker while the next forward reads the copy from before them
    delayed_update: bool
    delayed_update_warmup_steps: int
    # [Note: saved activations] None, "host", "nvme" or "auto"
    activation_offload: Optional[str] = None
    # [Note: activation host room] (memory/budget.py) host_budget bytes kept for the saved
    # activations' host buffers (the config's share, at least ACTIVATION_PIECE_BYTES where
    # they may reach NVMe): the rest holds the engine's own host needs
    activation_host_bytes: int = 0
    # [Note: compact optimizer states] (memory/compact_codec.py) optimizer_states="compact"
    compact_states: bool = False

    @property
    def grad_dtype(self) -> torch.dtype:
        """[Note: 16-bit gradients] (optim/gradients.py) The dtype a unit's gradients are
        held in from hand-off to its update, in RAM and in its spill extent: the compute
        dtype where gradients are adopted and a step has one backward, else fp32."""
        if self.adopts_grads and self.accumulation_steps == 1 and self.compute_element_bytes < FP32_BYTES:
            return self.compute_dtype
        return torch.float32

    @property
    def starting_loss_scale(self) -> float:
        """The loss scale a run starts from: initial_loss_scale with fp16; 1.0 (no scaling)
        for the other dtypes."""
        return self.initial_loss_scale if self.fp16 else 1.0

    @property
    def grad_element_bytes(self) -> int:
        """Bytes of one element of ``grad_dtype``."""
        return self.compute_element_bytes if self.grad_dtype != torch.float32 else FP32_BYTES

    @property
    def home_dtype(self) -> torch.dtype:
        """dtype of a compute copy at home: fp32 when it is the master too."""
        return torch.float32 if self.merged else self.compute_dtype

    def compute_tier(self, index: int) -> str:
        """Where unit ``index``'s compute copy lives ([Note: placement by budget])."""
        return self.compute_tiers[index] if self.compute_tiers else self.param_tier

    def state_tier(self, index: int) -> str:
        """Where unit ``index``'s fp32 master and Adam moments live ("" if it has none)."""
        return self.state_tiers[index] if self.state_tiers else self.optimizer_tier

    @property
    def spare_homes(self) -> bool:
        """Trainable units have a second set of homes: [Note: speculative updates] write
        there, and [Note: delayed updates] keep the forward's copy in one while the update
        writes the other (which units: ``has_spare``)."""
        return self.speculative or self.delayed_update

    @property
    def spare_states(self) -> bool:
        """Spare homes hold a master and moments of their own, not only a compute copy:
        [Note: speculative updates] keep the old states for a redo; [Note: delayed updates]
        write master and moments in place, and their spare homes share the unit's."""
        return self.spare_homes and not self.delayed_update

    def has_spare(self, index: int, trainable: bool) -> bool:
        """Whether unit ``index`` has spare homes: with delayed updates every trainable
        unit; with speculative updates those ``spare_units`` names, never the root (it is
        updated in step(), after its embedding gradients, never early)."""
        if not trainable or not self.spare_homes:
            return False
        if self.delayed_update:
            return True
        return index != 0 and (not self.spare_units or self.spare_units[index])

    @property
    def state_host_budget(self) -> Optional[int]:
        """[Note: activation host room] What the engine's own host needs (homes, staging,
        gradients) may hold: host_budget less the activations' share. None: no budget."""
        return None if self.host_budget is None else self.host_budget - self.activation_host_bytes

    def home_copies(self, index: int, trainable: bool) -> Tuple[int, int]:
        """How many compute copies, and how many masters and moments, unit ``index`` keeps
        at home: 2 of a role with a spare (``has_spare``; states only where
        ``spare_states``), else 1."""
        copies = 2 if self.has_spare(index, trainable) else 1
        return copies, copies if self.spare_states else 1

    @classmethod
    def resolve(cls, config: OffloadConfig, device: torch.device, partition: Any,
                tiers: Optional[Tuple[Tuple[str, ...], Tuple[str, ...]]] = None,
                default_host_budget_bytes: Optional[int] = None) -> "Layout":
        """The modes of a run of ``config`` on ``device``; ``partition``: the [zero]
        Partition of several ranks, or None; ``tiers``: every unit's compute and state tiers
        ([Note: placement by budget]; None: not placed yet, the config's tiers as given);
        ``default_host_budget_bytes``: host_budget when the config gives none, as a caller
        resolving many layouts read it once (None: ``default_host_budget()`` now)."""
        device_is_host = device.type == "cpu" and not standin_requested()
        if config.optimizer_states == "compact":
            _check_compact_layout(config, partition, tiers, device_is_host)
        compute_dtype = DTYPES[config.dtype]
        compute_tiers, state_tiers = tiers if tiers is not None else ((), ())
        param_tier, optimizer_tier = config.param_tier, config.optimizer_tier
        if tiers is not None:
            param_tier = _summary(compute_tiers, param_tier)
            optimizer_tier = _summary([t for t in state_tiers if t], "host" if optimizer_tier == "auto" else optimizer_tier)
        on_compute = set(compute_tiers) or {param_tier}
        on_states = {t for t in state_tiers if t} or {optimizer_tier}
        merged = config.dtype == "fp32" and param_tier != "device"
        needs_nvme = "nvme" in on_compute | on_states
        needs_norm_first = config.needs_norm_first()
        # [Note: delayed updates] the norm is known in step(), where every update starts
        # [zero] with several ranks at stage 3, or 2 with host compute copies, decided from
        # the config alone, alike on every rank ("auto" places each rank's units under its
        # own budget): each backward's collectives follow it ([Note: early updates across ranks])
        early_with_ranks = partition is None or partition.shards_params or (
            partition.shards_gradients and config.param_tier == "host")
        speculate_by_default = "nvme" in on_states if partition is None else config.optimizer_tier == "nvme"
        speculative = needs_norm_first and early_with_ranks and param_tier != "device" and (
            speculate_by_default if config.speculative_updates is None else config.speculative_updates) \
            and not config.delayed_update
        host_budget = config.host_budget
        if host_budget is None:
            host_budget = default_host_budget_bytes if default_host_budget_bytes is not None else default_host_budget()
        return cls(
            device=device,
            device_is_host=device_is_host,
            compute_dtype=compute_dtype,
            compute_element_bytes=torch.empty(0, dtype=compute_dtype).element_size(),
            param_tier=param_tier,
            optimizer_tier=optimizer_tier,
            compute_tiers=tuple(compute_tiers),
            state_tiers=tuple(state_tiers),
            needs_nvme=needs_nvme,
            merged=merged,
            # [Note: split master] with every state on NVMe and one tier for every compute copy;
            # never with an "auto" tier, whose placements must all compute the same numbers
            # (the split compute copy rounds ties away from zero): [Note: placement by budget]
            split_master=(config.split_master and config.dtype == "bf16" and on_states == {"nvme"}
                          and len(on_compute) == 1 and param_tier != "device"
                          and "auto" not in (config.param_tier, config.optimizer_tier)
                          and config.optimizer_states != "compact"),
            adopts_grads=device_is_host and partition is None,
            device_copy_updates=device_is_host and "nvme" in on_compute and partition is None,
            gathers=partition is not None and partition.shards_params,
            staged_step=needs_nvme and not (partition is not None and partition.shards_state),
            early_allowed=early_with_ranks and (speculative or not needs_norm_first)
            and not config.delayed_update,
            speculative=speculative,
            spare_units=(),
            accumulation_steps=config.gradient_accumulation_steps,
            max_grad_norm=config.max_grad_norm,
            fp16=config.dtype == "fp16",
            skip_nonfinite_steps=config.skip_nonfinite_steps,
            initial_loss_scale=config.initial_loss_scale,
            min_loss_scale=config.min_loss_scale,
            loss_scale_window=config.loss_scale_window,
            device_budget=config.device_budget,
            host_budget=host_budget,
            host_budget_default=config.host_budget is None and host_budget is not None,
            optimizer_pipeline_depth=config.optimizer_pipeline_depth,
            prefetch=config.prefetch,
            prefetch_units=config.prefetch_units,
            prefetch_bytes=config.prefetch_bytes,
            overlap_step_with_forward=config.overlap_step_with_forward,
            delayed_update=config.delayed_update,
            delayed_update_warmup_steps=config.delayed_update_warmup_steps,
            activation_offload=config.activation_offload,
            activation_host_bytes=_activation_host_bytes(config, host_budget),
            compact_states=config.optimizer_states == "compact",
        )


# [Note: activation host room] The least host room kept for saved activations where they
# may reach NVMe (activation_offload set, a swap_dir, a host budget): a group larger than its
# free room goes to its swap extent in pieces through that room (ActivationStore), so the room
# must hold a piece whatever "auto" placement takes. Whole pages; a floor, not the piece
# size (a piece takes all the room has free).
ACTIVATION_PIECE_BYTES = 256 << 10


def _activation_host_bytes(config: OffloadConfig, host_budget: Optional[int]) -> int:
    """[Note: activation host room] config.activation_host_bytes (0 when None), checked
    against the host budget the run takes (the default one too: the config checked a given
    one), and at least ACTIVATION_PIECE_BYTES where the activations may reach NVMe."""
    reserved = config.activation_host_bytes or 0
    if host_budget is not None and reserved > host_budget:
        raise ValueError(f"activation_host_bytes: {reserved} bytes is more than the host budget "
                         f"({host_budget} bytes: 3/4 of the memory available now), which it is part of")
    if config.activation_offload is not None and config.swap_dir and host_budget is not None:
        reserved = max(reserved, ACTIVATION_PIECE_BYTES)
    return reserved


def check_compact_stage(stage: int) -> None:
    """[Note: compact optimizer states] Compact states where several ranks train at ZeRO
    ``stage``: at stage 0 each rank holds them whole; a stage that shards the states is a
    ValueError (the sharded step moves fp32 states). Wrap's refusal once its process group is
    known, and `offload plan --ranks`' in the same words; one process ignores the stage (with
    Partition.from_environment's warning), so neither asks this there."""
    if stage >= 1:
        raise ValueError(f"optimizer_states: 'compact' is not available with ZeRO stage {stage} "
                         "(the sharded step moves fp32 states); use stage=0 or optimizer_states='exact'")


def _check_compact_layout(config: OffloadConfig, partition: Any, tiers: Any, device_is_host: bool) -> None:
    """[Note: compact optimizer states] The runs the homes hold compact states for so far:
    one process, or several ranks at ZeRO stage 0 (each holds whole compact states and steps
    them with the averaged gradients); compact homes and compute copies on the host or NVMe
    (explicit or "auto"), or compute copies on the device where the device is the host (the
    step writes the high parts in place there). Else a ValueError naming the field and the
    reason."""
    if partition is not None:  # several ranks: the stage is theirs (one process ignores it)
        check_compact_stage(partition.stage)
    compute_tiers = {"host", "nvme", "auto"} | ({"device"} if device_is_host else set())
    placed = set(tiers[0]) | {t for t in tiers[1] if t} if tiers is not None else set()
    if config.param_tier not in compute_tiers or placed - compute_tiers:
        raise ValueError(f"optimizer_states: 'compact' is not available with param_tier={config.param_tier!r} "
                         "on an accelerator (the compact step writes the high parts into the compute copy at "
                         "home): use param_tier='host', 'nvme' or 'auto', or optimizer_states='exact'")


def _summary(tiers: Any, default: str) -> str:
    """The one tier of ``tiers``, "mixed" when they differ, ``default`` when empty."""
    found = set(tiers)
    return found.pop() if len(found) == 1 else "mixed" if found else default


# [Note: placement by budget] Without host_budget, the default is this fraction of the
# memory the kernel reports available when the engine is wrapped (MemAvailable).
DEFAULT_HOST_FRACTION = 0.75


def available_memory_bytes() -> Optional[int]:
    """MemAvailable of /proc/meminfo, else free physical pages; None when neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def default_host_budget() -> Optional[int]:
    """host_budget when none is given: this rank's share of DEFAULT_HOST_FRACTION of the
    available memory, the node's ranks (LOCAL_WORLD_SIZE) dividing it evenly (each rank reads
    the memory available when it wraps)."""
    available = available_memory_bytes()
    return None if available is None else host_budget_share(available, local_world_size(os.environ))


def host_budget_share(available_bytes: int, local_ranks: int) -> int:
    """One of ``local_ranks`` ranks' share of DEFAULT_HOST_FRACTION of ``available_bytes``."""
    return int(available_bytes * DEFAULT_HOST_FRACTION) // local_ranks


@dataclass(frozen=True)
class ExtentView:
    """A sub-range of a swap extent (the trainable prefix of a buffer)."""

    path: str
    offset: int
    nbytes: int


def sub_extent(home: Any, offset: int, num_bytes: int) -> ExtentView:
    """Bytes [offset, offset + num_bytes) of a swap extent; page aligned by construction."""
    assert offset + num_bytes <= home.nbytes
    return ExtentView(home.path, home.offset + offset, num_bytes)


def slot_views(buffer: torch.Tensor, slots: int, stride: int, lo: int, hi: int
               ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Elements [lo, hi) of state slots 0 and 1 of ``buffer``, which holds ``slots`` of them
    ``stride`` elements apart (a moments home: Adam's exp_avg then exp_avg_sq; an elementwise
    optimizer's own, [Note: elementwise optimizers]); None for a slot it does not have."""
    return tuple(buffer[i * stride + lo:i * stride + hi] if i < slots else None for i in range(2))


def on_nvme(home: Any) -> bool:
    """Whether ``home`` is a swap extent (not a host tensor, nor None: no home, as the
    compute copy of a unit that lives on the device)."""
    if isinstance(home, PackedHome):  # [Note: per-entry state slots]
        home = home.home
    return home is not None and not isinstance(home, torch.Tensor)


class UnitState:
    """Runtime state of one unit: where each of its buffers lives and what is on the device."""

    def __init__(self, spec: UnitSpec, compute_element_bytes: int, state_slots: int = 2,
                 whole_step: bool = False, entry_slots: Optional[Sequence[Tuple[int, ...]]] = None) -> None:
        """``state_slots``: fp32 state tensors per trainable element, 0 to 2 (Adam's two
        moments; an elementwise optimizer's own, [Note: elementwise optimizers]).
        ``entry_slots``: the slots each trainable parameter's optimizer keeps (default: all);
        where some keep fewer, the moments home holds only theirs ([Note: per-entry state
        slots]: ``state_pages``).
        ``whole_step``: it holds a parameter whose optimizer steps whole parameters only, so
        its update is one piece ([Note: whole-parameter optimizers])."""
        self.spec = spec
        self.index = spec.index
        self.name = spec.name
        self.state_slots = state_slots
        self.whole_step = whole_step
        self.compute_numel = padded_numel(spec.total_numel, compute_element_bytes)
        self.master_numel = padded_numel(spec.trainable_numel, FP32_BYTES)
        self.trainable = spec.trainable_entries
        self.entry_slots: List[Tuple[int, ...]] = [tuple(range(state_slots))] * len(self.trainable) \
            if entry_slots is None else [tuple(k) for k in entry_slots]
        # [Note: per-entry state slots] None: every slot keeps every page (the plain layout)
        self.state_pages: Optional[StateSlots] = StateSlots.of(
            state_slots, self.master_numel,
            [(e.offset, e.numel, k) for e, k in zip(self.trainable, self.entry_slots)]) if state_slots else None
        # Homes: a host tensor or a swap extent, whichever the tier gives.
        self.compute_home: Any = None       # None when param_tier == "device" (lives in the arena)
        self.master_home: Any = None        # None when merged with the compute copy
        # state_slots slots (exp_avg then exp_avg_sq), master_numel each (a PackedHome with
        # state_pages: [Note: per-entry state slots]); None with none
        self.moments_home: Any = None
        # [Note: compact optimizer states] its CompactUnit (optim/compact.py) over a host home,
        # the high parts views of compute_home; master_home and moments_home are None then
        self.compact_home: Optional[torch.Tensor] = None  # its buffer: compact_unit_bytes, uint8
        self.compact: Any = None
        # The fp32 gradient: one flat pooled buffer (grad), or one tensor per trainable
        # parameter handed over by autograd (param_grads); see [Note: gradient ownership].
        self.grad: Optional[torch.Tensor] = None
        self.param_grads: List[Optional[torch.Tensor]] = [None] * len(self.trainable)
        # [Note: gradient spill] the unit's gradient extent on NVMe (None: never spilled),
        # whether this step's gradients are there and not in RAM, and their per-parameter
        # squared norms, taken before they were written (the step's norm sums them)
        self.grad_home: Any = None
        self.grad_spilled = False
        self.spilled_grad_squares: List[Tuple[int, torch.Tensor]] = []
        # the squares of gradients read back from the extent and not changed since (else None)
        self.read_back_squares: Optional[List[Tuple[int, torch.Tensor]]] = None
        # [zero] The part of the trainable prefix whose master/moments this rank keeps and
        # updates (all of it on one process), the grad buffer's length and the element of
        # the trainable prefix at grad[0]. The engine sets them from Partition.assign.
        self.shard = ShardRange.whole(spec.trainable_numel, self.master_numel)
        self.grad_numel = spec.trainable_numel
        self.grad_base = 0
        # [zero] Stage 3: the rank's chunks of the compute copy kept at home (None: all of it).
        self.param_shard: Optional[ParamShard] = None
        # [zero] Stage >= 2: elements of its fp32 gradient bucket on the device (0: none)
        self.bucket_numel = 0
        self.has_grad = [False] * len(self.trainable)
        self.steps = [0] * len(self.trainable)
        self.device_offset: Optional[int] = None
        self.compute_state = ResidencyState(f"{spec.name}.compute", Residency.HOME)
        self.ready_event: Optional[Event] = None
        self.pending: Optional[Callable[[], Optional[torch.cuda.Event]]] = None  # fetch in flight
        self.fetch_started = 0.0
        self.compute_started = 0.0
        self.last_use = 0
        self.grads_since_use = 0     # gradient hooks fired since the unit was last needed
        # squared gradient norms of its parameters that have one, in order, taken before an
        # early update (see UpdateScheduler._update_early), and the first non-finite one
        self.early_grad_squares: List[float] = []
        self.early_nonfinite: Optional[ParamEntry] = None
        self.calls = 0               # forward calls in this pass
        self.backward_done = 0       # calls whose backward finished (see _PostBackward)
        # [Note: update states] its early or deferred optimizer update of this step
        self.update = UnitUpdate(f"{spec.name}.update")
        # [Note: speculative updates] the second set of homes a speculative update writes,
        # and the step counts it leads to (None without speculative updates)
        self.spare: Optional[SpareHomes] = None
        # [Note: delayed updates] the delayed update that holds u's gradient fields (has_grad,
        # grad, param_grads) until the main thread takes them back (Gradients.take_back), and
        # whether u's spare homes hold an update not committed yet (the homes then hold the
        # copy the forward reads, one update old)
        self.delayed_update: Optional[Any] = None
        self.delayed_pending = False

    def commit_spare(self) -> None:
        """[Note: speculative updates] The spare homes hold this step's update: they become
        the homes, and the old homes the spare ones (main thread, nothing in flight). A
        delayed update's spare master and moments are the homes' own ([Note: delayed
        updates]): swapping them changes nothing."""
        spare = self.spare
        assert spare is not None
        self.compute_home, spare.compute_home = spare.compute_home, self.compute_home
        self.master_home, spare.master_home = spare.master_home, self.master_home
        self.moments_home, spare.moments_home = spare.moments_home, self.moments_home
        self.compact_home, spare.compact_home = spare.compact_home, self.compact_home
        self.compact, spare.compact = spare.compact, self.compact
        self.steps, spare.steps = spare.steps, self.steps

    def take_shards(self, shards: Any) -> None:
        """[zero] What this rank keeps of the unit (zero.shards.UnitShards from
        Partition.assign; None at stage 0, which keeps everything: the defaults). The engine
        calls it once per unit at wrap, and nothing else sets these fields."""
        if shards is None:
            return
        assert self.state_pages is None, "[Note: per-entry state slots] stages >= 1 step Adam alone"
        self.shard, self.grad_numel, self.grad_base = shards.shard, shards.grad_numel, shards.grad_base
        self.bucket_numel = shards.bucket_numel
        if shards.param_shard is not None:  # stage 3
            self.param_shard, self.compute_numel = shards.param_shard, shards.compute_numel


class SpareHomes:
    """[Note: speculative updates] A unit's second homes, in the same tiers and sizes as
    its own (compute_home only where an update writes the compute copy at home), and the
    step counts of the speculative update written there. Same attribute names as
    UnitState's homes, so that an update takes either as where it writes. With delayed
    updates (``Layout.spare_states`` false) master_home and moments_home are the unit's
    own homes, which the update thus writes in place ([Note: delayed updates])."""

    def __init__(self, compute_home: Any, master_home: Any, moments_home: Any, steps: List[int],
                 compact_home: Any = None, compact: Any = None) -> None:
        self.compute_home = compute_home
        self.master_home = master_home
        self.moments_home = moments_home
        self.steps = steps
        # [Note: compact optimizer states] a second compact home, and its CompactUnit over it
        # and the spare compute copy where both are in host memory
        self.compact_home = compact_home
        self.compact = compact


class StagingSlot:
    """Host buffers the optimizer pipeline reads one unit's states into."""

    def __init__(self, host: HostTier, master_numel: int, compute_numel: int,
                 compute_dtype: torch.dtype, low_numel: int = 0, compact_bytes: int = 0,
                 moments_numel: int = 0) -> None:
        self.master = host.allocate(master_numel, torch.float32)
        # the state slots of a piece of NVMe-homed moments: state_slots x piece one after
        # another, or a per-entry home's spans ([Note: per-entry state slots], staged_parts)
        self.moments = host.allocate(moments_numel, torch.float32)
        self.compute = host.allocate(compute_numel, compute_dtype) if compute_numel else None
        # [Note: split master] the master's low halves, read and written in its place
        self.low = host.allocate(low_numel, torch.int16) if low_numel else None
        # [Note: compact optimizer states] a whole NVMe-homed compact home
        self.compact = host.allocate(compact_bytes, torch.uint8) if compact_bytes else None
        self.pending_writes: List[Any] = []
