"""wrap() and Engine: the lifecycle of an offloaded model.

The setup reads top to bottom in ``Engine.__init__``: unpack the config, cut the model into
units, check every budget (before anything is allocated or created), allocate the tiers,
move each unit's state to its home tier, install the hooks.

[Note: a failed wrap changes nothing] From the moment wrap first changes something the
caller holds (the meta stand-ins go into the model and the optimizer) to its last step,
every change is logged on one ExitStack as the way to undo it: module parameter and buffer
slots and param groups get their old entries back, the model's own parameters their
storage, the CPU RNG that initialized a meta model is rewound, hooks are removed, the swap
files deleted and the half-built engine's buffers let go. Wrap failing anywhere in between
thus leaves the model, the optimizer, the RNG and the swap directory as they were, and the
same objects can be wrapped again. The price: a model not on the meta device keeps its
storage until wrap has succeeded, not only until its unit is home, so where homes are on
the host (their pages are touched as they are written) wrap's peak grows by up to the
model's size. A meta model's stand-ins are dropped whole, their storage is not kept. What
user code (``reset_parameters``, ``init_fn``) did besides initializing parameters is not
undone.
"""
from __future__ import annotations

import contextlib
import os
import time
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

import torch
from torch import nn

from offload import checkpoint, faults, units
from offload.checkpoint import CheckpointAccess, RunRecord
from offload.config import OffloadConfig
from offload.errors import EngineFailedError, warn_at_caller
from offload.hooks import Hooks
from offload.memory.budget import (
    UnitSizes, activation_host_room_bytes, activation_room_bytes, check_device_budget, check_gathered_fits, check_host_budget, prefetch_room, slot_shape, swap_bytes, update_buffer_bytes)
from offload.memory.activations import ACTIVATIONS_SWAP_SUBDIR, ActivationStore
from offload.memory.homes import Homes
from offload.memory.layout import FP32_BYTES, Layout, UnitState
from offload.memory.materialize import install_stand_ins, meta_stand_ins, move_to_homes
from offload.memory.placement import Placement, describe_units, resolve_placement
from offload.memory.residency import DeviceResidency
from offload.memory.restored import copies_too_big, model_copies
from offload.memory.state_slots import slot_indices
from offload.memory.weights import close_weights, iter_weights, open_weights
from offload.optim.adam_ranges import UnitAdam
from offload.optim.compact import UnitCompactStates, check_compact_supported
from offload.optim.cpu_adam import CPUAdam, adam_flavour, carried_adam_state
from offload.optim.several import GroupRule, OptimizerSet, as_optimizer_list
from offload.optim.whole import probe_rule
from offload.optim.failure import FailureState, with_note
from offload.optim.gradients import Gradients
from offload.optim.paths import UpdatePaths
from offload.optim.sharded import ShardedStep
from offload.optim.step import PipelinedStep
from offload.optim.updates import UpdateScheduler
from offload.prefetch import Prefetcher
from offload.stats import Stats, Timeline, engine_stats
from offload.tiers import DeviceTier, HostTier, NvmeTier
from offload.tiers.context import TierContext
from offload.units import split_into_units
from offload.zero import Partition


def wrap(model: nn.Module, optimizer: "torch.optim.Optimizer | List[torch.optim.Optimizer]",
         config: "OffloadConfig | dict | str | None" = None, *,
         init_fn: Optional[Callable[[nn.Module], None]] = None, weights: "str | os.PathLike | None" = None) -> "Engine":
    """Offload ``model``'s training state as ``config`` says and return the Engine that
    trains it. ``optimizer``: a torch.optim.Optimizer over the model's parameters (Adam/AdamW
    and offload.CPUAdam on the native kernel, any other by its own step(): on ranges where it
    is elementwise, [Note: elementwise optimizers], else on whole parameters, [Note:
    whole-parameter optimizers]), or a list of them whose parameters partition the trainable
    ones ([Note: several optimizers]); param groups (and any LR scheduler changing them) are
    honored, and so is state an optimizer holds when it has taken steps (moved into the
    engine's homes).
    ``init_fn(module)`` initializes modules of a meta-device model after
    ``reset_parameters()``. ``weights``: a Hugging Face model directory or a .safetensors
    file whose tensors become the parameters' values ([Note: weights into the tiers])."""
    return Engine(model, optimizer, OffloadConfig.from_any(config), init_fn=init_fn, weights=weights)


def check_stale_grads(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """A gradient from before wrap is added into the first step, as plain PyTorch adds it,
    where autograd can accumulate into it: fp32, or the compute dtype. Any other (a float64
    .grad left by .double()) is a ValueError naming the parameter, before anything changes."""
    for name, p in model.named_parameters():
        g = p.grad
        if p.requires_grad and g is not None and g.dtype not in (torch.float32, compute_dtype):
            raise ValueError(f"{name}: its .grad from before wrap is {g.dtype}, and the engine computes gradients "
                             f"in {compute_dtype} (accumulated into fp32 or {compute_dtype} only); call "
                             "model.zero_grad(set_to_none=True) before wrap, or convert the .grad")


class Engine:
    """Trains one model with its state spread over device, host and NVMe tiers.

    Use it like the model (``engine(*args, **kwargs)`` runs the model's forward), then
    ``engine.backward(loss)`` and ``engine.step()`` after every micro-batch.
    """

    def __init__(self, model: nn.Module, optimizer: Any, config: OffloadConfig,
                 init_fn: Optional[Callable[[nn.Module], None]] = None, weights: Any = None) -> None:
        FailureState.check_not_wrapped(model)  # before anything is touched
        check_compact_supported(config, optimizer)  # [Note: compact optimizer states]
        self._timeline = Timeline()  # its creation is time 0 of export_trace
        # 1. Unpack the config; below this point code takes plain arguments.
        self.config = config
        self.module = model
        # [Note: several optimizers] ``optimizer`` is what the caller passed (one optimizer or
        # the list), ``optimizers`` always the list; the engine reads their groups as one.
        self.optimizers = as_optimizer_list(optimizer)
        self.optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else list(self.optimizers)
        optimizer_set = OptimizerSet(self.optimizers)
        optimizer_set.check_partition(model)
        self.device = config.resolved_device()  # a CUDA device's index included
        # [zero] Several ranks: every rank wraps the same thing, shards sized per unit below.
        self._partition = Partition.from_environment(config.stage, config.collective_timeout_seconds,
                                                     config.shard_group_size, self.device)
        # [Note: layout] every mode resolved once; nothing below reads the config again.
        self.layout = layout = Layout.resolve(config, self.device, self._partition)
        self.compute_dtype = layout.compute_dtype
        check_stale_grads(model, layout.compute_dtype)
        if layout.fp16 and self.device.type == "cpu":
            warn_at_caller("dtype='fp16' on a CPU device: torch's CPU kernels run fp16 matmuls many times "
                           "slower than bf16 ones, and fp16 needs loss scaling; dtype='bf16' keeps fp32's "
                           "range and runs at bf16's speed")
        compute_element_bytes = layout.compute_element_bytes

        # 2. Units, from the model and the optimizer's param groups.
        # Adam/AdamW/CPUAdam run on the native kernel; any other optimizer must be elementwise
        # ([Note: elementwise optimizers]), probed here on a dummy parameter.
        # With several optimizers each has its own rule ([Note: several optimizers]).
        rules = [None if isinstance(opt, (torch.optim.Adam, CPUAdam)) else probe_rule(opt) for opt in self.optimizers]
        adamws = [adam_flavour(opt) if rule is None else False  # checks what we cannot honor
                  for opt, rule in zip(self.optimizers, rules)]
        for rule in rules:
            if rule is not None and self._partition is not None and config.stage >= 1:
                # the sharded step (optim/sharded.py) moves Adam's two moments and settles no scalars
                raise ValueError(f"stage: ZeRO stage {config.stage} shards Adam's states only; {rule.name} runs "
                                 "with stage=0 (every rank keeps its whole state) or one process")
            if rule is not None and rule.whole and layout.delayed_update:
                raise ValueError(f"delayed_update: {rule.name} steps whole parameters ([Note: whole-parameter "
                                 "optimizers]), which delayed updates do not support yet; set delayed_update=False")
        state_slots = OptimizerSet.state_slots(rules)  # the plan's too (plan_optimizers.py)
        group_rules = [GroupRule(rule, local, adamw) for opt, rule, adamw in zip(self.optimizers, rules, adamws)
                       for local in range(len(opt.param_groups))]
        group_of: Dict[nn.Parameter, int] = {}
        for gi, group in enumerate(optimizer_set.param_groups):
            for p in group["params"]:
                group_of[p] = gi
        specs = split_into_units(model, group_of, compute_element_bytes, config.unit_classes,
                                 config.unit_predicate)
        # What an optimizer that has taken steps holds goes into the homes (checked here).
        trainable = [(e.fqn, e.param) for spec in specs for e in spec.entries if e.trainable]
        adam_state: Dict[nn.Parameter, Any] = {}
        for opt, rule in zip(self.optimizers, rules):
            mine = {p for group in opt.param_groups for p in group["params"]}
            own = [(name, p) for name, p in trainable if p in mine]
            adam_state.update(carried_adam_state(opt, own) if rule is None else rule.carried_state(own))
        # Meta parameters get storage-less stand-ins, put into the model and the optimizer
        # only once every check below has passed, and taken out again if wrap fails after
        # that ([Note: a failed wrap changes nothing]).
        meta_replacements = meta_stand_ins(specs)
        whole_groups = {gi for gi, r in enumerate(group_rules) if r.rule is not None and r.rule.whole}
        # [Note: per-entry state slots] each parameter's moments take the slots its optimizer keeps
        self.units = [UnitState(spec, compute_element_bytes, state_slots,
                                whole_step=any(e.group_index in whole_groups for e in spec.entries if e.trainable),
                                entry_slots=[slot_indices(group_rules[e.group_index].rule,
                                                          group_rules[e.group_index].local_index, len(e.shape))
                                             for e in spec.trainable_entries])
                      for spec in specs]
        self._root = self.units[0]
        if self._partition is not None:
            home_element_bytes = FP32_BYTES if layout.merged else compute_element_bytes
            for u in self.units:
                u.take_shards(self._partition.assign(u, home_element_bytes))
            self._partition.check_consistent(config, self.units, optimizer_set)

        # 3. Where each unit's state lives ([Note: placement by budget]), and the budgets,
        # checked before anything is allocated.
        unit_sizes = [UnitSizes.of(u) for u in self.units]
        self.layout = layout = resolve_placement(config, self.device, self._partition, unit_sizes)
        self._placement = describe_units(unit_sizes, layout)  # fixed from here on
        arena = check_device_budget(unit_sizes, layout)
        room = prefetch_room(unit_sizes, layout, arena)  # [Note: prefetch room]
        if layout.prefetch and layout.prefetch_units and room is not None and room.units_ahead == 0:
            warn_at_caller(room.warning(arena.budget_bytes, layout.prefetch_units))
        device_capacity_numel, device_budget = arena.capacity_numel, arena.budget_bytes
        needs_nvme = layout.needs_nvme
        nvme_bytes = swap_bytes(unit_sizes, layout)
        self._host_planned_bytes = check_host_budget(unit_sizes, layout).total
        staging_shape = slot_shape(unit_sizes, layout)
        weight_files = open_weights(weights, model)  # every name and shape checked here

        # From here on wrap changes what the caller holds: a failure anywhere below puts it
        # all back ([Note: a failed wrap changes nothing]).
        with contextlib.ExitStack() as undo:
            # Last of all: the half-built engine lets go of its buffers (its traceback keeps
            # it alive), so that wrapping again finds the memory free.
            undo.callback(vars(self).clear)
            undo.callback(close_weights, weight_files)
            unmaterialized = install_stand_ins(model, optimizer_set, meta_replacements, undo)

            # 4. Tiers, and whether the engine may train ([Note: failures inside a step]).
            self._status = FailureState()
            self.stats_counters = Stats()
            self._device = DeviceTier(self.device, self.compute_dtype, device_capacity_numel, device_budget,
                                      host_addressable=layout.device_is_host,
                                      bounds_activations=layout.device_budget is not None,
                                      pages_follow_slots=layout.activation_offload is not None,
                                      # [Note: gradient buckets in the device budget]
                                      bucket_room_bytes=arena.bucket_room_bytes
                                      if layout.device_budget is not None else None)
            # [Note: pinned buffers] page-locked for a device the host does not address
            self._host = HostTier(layout.host_budget, pinner=None if layout.device_is_host else self._device)
            # [Note: gradient ownership] the gradients, their pool and the loss scale
            self._gradients = Gradients(
                self.units, layout=layout, partition=self._partition, device=self._device, host=self._host,
                stats=self.stats_counters)
            if self._partition is not None:
                self._partition.bind_gradients(self._gradients)
                self._partition.count_buckets_in(self._device)
            # Adam over ranges of a unit: every update path calls it.
            self._adam = UnitAdam(optimizer_set, group_rules, layout=layout, device=self._device,
                                  gradients=self._gradients, timeline=self._timeline,
                                  piece_numel=units.OPTIMIZER_PIECE_NUMEL)
            self._nvme: Optional[NvmeTier] = None
            undo.callback(self._close_tiers)
            if needs_nvme:
                self._nvme = NvmeTier(self._rank_swap_dir(config.swap_dir), nvme_bytes, config.io_backend, config.io_block_bytes,
                                      config.io_queue_depth, checksums=config.swap_checksums)
            self._gradients.spill_through(self._nvme)  # [Note: gradient spill]
            # what every mechanism that moves bytes shares: the tiers, the counters, the timeline
            tiers = TierContext(self._device, self._host, self._nvme, self.stats_counters, self._timeline)
            # [Note: saved activations] "nvme" (and any mode with a swap_dir, for activations
            # beyond the host room): swap space of their own, in a directory of their own
            # under swap_dir (a swap directory holds one run's lock)
            activation_swap_dir = os.path.join(self._rank_swap_dir(config.swap_dir), ACTIVATIONS_SWAP_SUBDIR) \
                if layout.activation_offload is not None and config.swap_dir else None
            made_activation_swap_dir = activation_swap_dir is not None and not os.path.lexists(activation_swap_dir)
            self._activations = ActivationStore(
                layout.activation_offload, tiers=tiers,
                nvme=NvmeTier(activation_swap_dir, 0, config.io_backend, config.io_block_bytes,
                              config.io_queue_depth, checksums=config.swap_checksums)
                if activation_swap_dir is not None else None,
                room_bytes=activation_room_bytes(unit_sizes, layout, arena),
                host_room_bytes=activation_host_room_bytes(layout, self._host_planned_bytes),
                warn_room_spill=not config.activation_host_bytes,
                remove_dir=activation_swap_dir if made_activation_swap_dir else None)
            # 5. The device residency of the compute copies ([Note: residency]), the homes
            # and their codec, the optimizer steps.
            self._prefetcher = Prefetcher(layout.prefetch, layout.prefetch_units, max_bytes_ahead=layout.prefetch_bytes)
            self._residency = DeviceResidency(layout=layout, units=self.units, tiers=tiers, partition=self._partition,
                                              prefetcher=self._prefetcher)
            self._homes = Homes(self.units, layout, tiers=tiers, partition=self._partition,
                                release_param=self._residency.released.release, bind=self._residency.bind,
                                adam_state=adam_state, compact=UnitCompactStates())
            self._homes.allocate()
            # [Note: the piece ring] the staged step: its slots and what it keeps between steps;
            # a failed swap write there becomes the engine's failure ([Note: swap I/O failures]).
            staging_slots = self._homes.allocate_staging(staging_shape)
            self._step_ring = PipelinedStep(
                staging_slots, layout=layout, tiers=tiers, homes=self._homes, adam=self._adam,
                gradients=self._gradients, failures=self._status, host_planned_bytes=self._host_planned_bytes)
            # [zero] Stage >= 1: the optimizer step over this rank's shards, through update
            # buffers of its own (the staging slots serve the unsharded step).
            self._sharded_step: Optional[ShardedStep] = ShardedStep(
                layout=layout, tiers=tiers, partition=self._partition, piece_numel=units.OPTIMIZER_PIECE_NUMEL,
                update_buffer_bytes=update_buffer_bytes(unit_sizes, layout), adam=self._adam,
                gradients=self._gradients, failures=self._status,
            ) if self._partition is not None and self._partition.shards_state else None

            # 6. Every unit's state to its home tier (materializing meta models).
            move_to_homes(model, self.units, unmaterialized, self.device, init_fn, self._homes.write_initial_state,
                          undo, weight_files)
            self._homes.drop_buffers()  # the last unit's write let go of them already
            close_weights(weight_files)

            # 7. The update scheduler, with the worker that updates units ([Note: early updates],
            # [Note: deferred updates]: when each unit's Adam runs, and what waits for it), hooks.
            self._updates = UpdateScheduler(
                self.units, layout=layout, tiers=tiers, paths=UpdatePaths(
                    layout, ring=self._step_ring, sharded=self._sharded_step, adam=self._adam, partition=self._partition),
                prefetcher=self._prefetcher, gradients=self._gradients, residency=self._residency, status=self._status)
            self._residency.connect(self._updates)
            self._activations.connect(self._residency)  # [Note: saved activations] room by eviction
            self._gradients.connect(self._updates)
            self._backward_running = False  # engine.gathered() refuses then
            self._last_step_end: Optional[float] = None
            self._last_step_seconds = 0.0
            self._last_optimizer_seconds = 0.0
            # Every use of a unit, in forward and backward, goes through these hooks; the
            # gradient hooks hand gradients to self._gradients ([Note: gradient ownership]).
            self._hooks = Hooks(model, self.units, tiers=tiers, gradients=self._gradients, partition=self._partition,
                                activations=self._activations, residency=self._residency, updates=self._updates)
            undo.callback(self._hooks.remove)
            self._hooks.install()
            self._hooks.install_copies(self._plain_values)  # [Note: copies of a wrapped model]
            faults.hit("wrap.done")
            undo.pop_all()  # wrap has succeeded: keep what it changed, let go of the originals
        self._status.hold(model)
        optimizer_set.forget_state(list(adam_state))  # the homes hold it now

        # 8. Checkpoints reach the states through this object alone ([Note: checkpoint
        # access]); the training counters and failed writes' host copies through the scheduler.
        self._checkpoint = CheckpointAccess(
            self.units, layout, RunRecord(model, optimizer_set, config, optimizer_set.layout(rules)),
            homes=self._homes, residency=self._residency, failures=self._status, training=self._updates,
            partition=self._partition)

    # ------------------------------------------------------------------ public API
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._status.check("forward")
        self._residency.refuse_while_held("a forward")  # before any hook runs
        try:
            return self.module(*args, **kwargs)
        except BaseException as error:
            self._hooks.abort_forward()  # [Note: failures inside a step] consistent: carry on
            if not isinstance(error, OSError) or self._status.failure is not None:
                raise
            raise with_note(error, "the forward was abandoned, no weight or optimizer state changed: "
                                   "the next forward reads the unit again") from error

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss / gradient_accumulation_steps`` (times the loss scale with fp16)."""
        self._status.check("backward")
        self._residency.refuse_while_held("backward()")
        self._updates.settle_all()  # [Note: deferred updates] the last step's updates are done
        scaled = loss / self.layout.accumulation_steps
        if self._gradients.loss_scale != 1.0:
            scaled = scaled * self._gradients.loss_scale
        # The backward before an update may start Adam on units whose gradients are final.
        # Speculative ones only while they pay: not after a step that clipped.
        last_micro_step = (self._updates.micro_step + 1) % self.layout.accumulation_steps == 0
        self._updates.early_updates = self.layout.early_allowed and self._prefetcher.enabled and last_micro_step \
            and (self._updates.speculate or not self.layout.speculative)
        if self._partition is not None:  # [Note: early updates across ranks] from what every rank
            # has alike (the prefetcher's state is the rank's own)
            settle = self._partition.settle_in_backward = self.layout.early_allowed and last_micro_step
            self._updates.gathers_owed = settle and not self._partition.shards_params
        self._hooks.begin_backward()
        updates, root = self._updates, self._root
        if updates.early_updates and self.layout.staged_step and root.trainable and not updates.defers_updates() \
                and not root.update.updated and self._step_ring.root_prestaged is None:
            # The root unit is updated last (its embedding gradients come last); its states
            # cannot change before then, so read them now, under backward. Slot 0 is the one
            # PipelinedStep.staged_update gives the first unit, the root (early updates use the others).
            self._step_ring.prestage_root(root)
        start = time.perf_counter()
        self._backward_running = True
        try:
            with self.stats_counters.timed("backward"):
                scaled.backward()
                self._gradients.finish_backward()  # [Note: shared parameter gradients]
        except BaseException as error:
            self._gradients.drop_partials()
            updates.abort_backward(error)  # [Note: failures inside a step]
        finally:
            self._updates.early_updates = False
            if self._partition is not None:
                self._partition.settle_in_backward = False
            self._backward_running = False
        self._hooks.end_backward()
        self._timeline.span("phase", "backward", start, time.perf_counter())

    def step(self) -> None:
        """Call after every micro-batch; every gradient_accumulation_steps-th call updates."""
        self._status.check("step")
        self._residency.refuse_while_held("step()")
        self._updates.micro_step += 1
        if self._updates.micro_step % self.layout.accumulation_steps:
            return
        start = time.perf_counter()
        try:
            self._updates.step()
            self._updates.prefetch_next_pass()
        except BaseException as error:  # [Note: failures inside a step] fatal, unless recorded already
            self._status.fail_step_unless_recorded(error, f"in the optimizer step at micro-step {self._updates.micro_step}")
        # The user's optimizer never runs its own step(); tell torch's LR schedulers that a
        # step happened so they do not warn about calling scheduler.step() first.
        for opt in self.optimizers:
            opt._opt_called = True
        end = time.perf_counter()
        self._timeline.span("phase", "optimizer step", start, end)
        self._last_optimizer_seconds = end - start
        if self._last_step_end is not None:
            self._last_step_seconds = end - self._last_step_end
        self._last_step_end = end

    def zero_grad(self) -> None:
        self._status.check_open("zero_grad")
        self._updates.zero_grad()

    # ------------------------------------------------------------------ reading state
    @torch.no_grad()
    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Full-precision weights keyed as ``model.state_dict()``, on the CPU: the fp32
        master where one exists, else the compute copy. [zero] With several ranks at stage
        >= 1 it gathers the shards: every rank must call it (like save_checkpoint)."""
        values = self._updates.settled_values("state_dict")
        return {name: value.to("cpu", copy=True) for name, value in iter_weights(self.module, self.units, values)}

    def save_pretrained(self, directory: str, dtype: "torch.dtype | str | None" = None,
                        max_shard_size: "int | str" = "5GB") -> None:
        """The weights as a Hugging Face model directory that ``from_pretrained`` loads
        (safetensors, sharded above ``max_shard_size``, config.json), one unit at a time.
        ``dtype`` converts floating tensors: torch.float32, torch.bfloat16 or torch.float16,
        or "fp32", "bf16", "fp16" as in OffloadConfig; None keeps each tensor's own. A bad
        argument is a ValueError before anything is written. ``directory`` holds the earlier
        save or the new one whole at every instant, and keeps its other files; the files are
        0600 (a new directory 0700) like a checkpoint's. [Note: atomic model directory] in
        checkpoint/export.py

        [Note: save_pretrained with several ranks] Every rank calls it, with the same
        arguments (like state_dict: at stage >= 1 reading the values gathers shards, in
        unit order); rank 0 alone writes ``directory``, the others read the values and
        drop them. The others return without waiting for rank 0's files to be in place."""
        checkpoint.export.save_pretrained(
            directory, self.module, self.units, self._updates.settled_values("save_pretrained"),
            torch.float32 if self.layout.merged else self.compute_dtype, dtype, max_shard_size,
            write=self._partition is None or self._partition.rank == 0)

    def restore_model(self) -> None:
        """Between steps: every parameter of the model holds a copy of its current value
        (the fp32 master where one exists, as ``state_dict()``) in its dtype from before
        wrap, on the CPU, so that the model reads as a plain model, until the next forward,
        ``gathered()``, ``load_state_dict()`` or ``load_checkpoint()`` takes the copies back.
        The copies are for reading: a write into one is named (RuntimeError) there, as the
        engine's tiers never see it. Refused (ValueError, before anything changes) when
        ``gathered()`` would be (with several ranks only at ZeRO stage >= 1: at stage 0
        each rank copies its own whole replica), and when the copies would take more than 3/4 of the memory
        available now (it names the bytes: read through ``state_dict()`` or ``gathered()``
        instead). Called again, it refreshes the copies. [Note: restored parameters]"""
        what = "engine.restore_model()"
        self._check_weights_access(what, writes=False, copies=True)
        self._end_restore_or_raise(what)
        too_big = copies_too_big(self.units, self._residency.released, self.layout.host_budget)
        if too_big:
            raise ValueError(f"{what}: {too_big}; read the weights with engine.state_dict(), "
                             "engine.save_pretrained(DIR) or inside `with engine.gathered(params):`")
        self._residency.restored.restore(model_copies(self.units, self._residency.released,
                                                      self._updates.settled_values(what)))

    def _plain_values(self, module: nn.Module) -> Dict[nn.Parameter, torch.Tensor]:
        """[Note: copies of a wrapped model] New copies of the current values of ``module``'s
        parameters (and of the others of their units), as restore_model() would give them,
        refused where it would be."""
        what = "copy.deepcopy() or pickle of a model wrapped by offload"
        self._check_weights_access(what, writes=False, copies=True)
        units = self._units_of(module, what)
        too_big = copies_too_big(units, self._residency.released, self.layout.host_budget)
        if too_big:
            raise ValueError(f"{what}: {too_big}; read the weights with engine.state_dict() or save them with "
                             "engine.save_pretrained(DIR)")
        return model_copies(units, self._residency.released, self._updates.settled_values(what))

    def _end_restore_or_raise(self, what: str, compare: bool = True) -> None:
        """[Note: restored parameters] End a restore, if one is on (DeviceResidency.end_restore);
        a RuntimeError naming the parameters written while restored."""
        written = self._residency.end_restore(what, compare)
        if written:
            self._residency.released.check_unwritten([], written)

    @contextlib.contextmanager
    def gathered(self, params_or_modules: "nn.Parameter | nn.Module | Iterable[nn.Parameter | nn.Module] | None" = None,
                 modify: bool = False) -> Iterator[None]:
        """A block in which the given parameters (every parameter of the given modules; None:
        the whole model) hold their real values, on ``engine.device`` in the compute dtype
        (``dtype='bf16'``: the fp32 master rounded to bfloat16). With ``modify=True`` what
        the block writes into them in place (``p.mul_(2)``, ``p.zero_()``, ``p.copy_(t)``)
        goes home at its end, to every tier that holds it: the compute copy's home and, for
        a trainable parameter, the fp32 master, so that training and ``state_dict()`` go on
        from the edited values; Adam's moments and step counts are left alone. Units are
        whole: every parameter of a unit that holds one asked for comes too, and goes home
        (unchanged) too. Refused (ValueError, before anything moves) during a forward or
        backward, with gradients of un-stepped micro-batches pending, when the device
        budget cannot hold what is asked at once (it names the bytes needed: gather one
        module after another), with ``modify=True`` while a delayed update is pending
        ([Note: delayed updates]), and with several ranks. No forward, backward or step
        inside the block. [Note: gathered parameters]"""
        held = self._begin_gathered(params_or_modules, modify)
        failed = True
        try:
            yield
            failed = False
        finally:
            self._end_gathered(held, modify and not failed)

    def _begin_gathered(self, params_or_modules: Any, modify: bool) -> List[UnitState]:
        """[Note: gathered parameters] Check, settle, and hold the units asked for."""
        what = "engine.gathered()"
        if modify and self.layout.compact_states and self.layout.param_tier == "device":
            # [Note: compact optimizer states] an edit is found against the compute copy at home,
            # which here is the device copy being edited
            raise ValueError("optimizer_states: engine.gathered(modify=True) is not available with 'compact' states "
                             "and param_tier='device'; use engine.load_state_dict, or param_tier='host'")
        self._check_weights_access(what, modify)
        self._end_restore_or_raise(what)
        wanted = self._units_of(params_or_modules, what)
        if self.layout.param_tier != "device":
            check_gathered_fits(self._root.compute_numel, [(u.name, u.compute_numel) for u in wanted if u is not self._root],
                                self.layout.compute_element_bytes, self._device.arena.numel(), self._device.budget_bytes)
        self._residency.hold(wanted)
        return wanted

    def _end_gathered(self, wanted: List[UnitState], write_back: bool) -> None:
        """Let go of the held units; write back the edits (``write_back``); release them."""
        held = self._residency.let_go()
        if not write_back:
            for u in held:
                self._residency.release(u)
            return
        # A failure part-way leaves some units edited and others not: the engine refuses to
        # train until a checkpoint is loaded ([Note: failures inside a step]).
        self._checkpoint.begin_state_load("engine.gathered(modify=True) did not finish writing the edits back, so "
                                          "some units hold them and others not; load a checkpoint before training")
        try:
            for u in held:
                edited = self._device.view(u.device_offset, u.compute_numel).to("cpu", copy=True)
                self._checkpoint.write_edited_weights(u, edited)
        finally:
            self._checkpoint.release_buffers()
        self._checkpoint.finish_state_load()

    def _check_weights_access(self, what: str, writes: bool, copies: bool = False) -> None:
        """Raise unless weights may be gathered (or written: ``writes``; or copied to the CPU:
        ``copies``, restore_model() and copies of the model) now: the engine open and not
        failed, one rank (``copies``: or several at ZeRO stage 0, where every rank reads its
        own whole replica), no pass running, no gradients pending; the last step's deferred
        updates are settled here, as state_dict() settles them."""
        self._status.check(what)
        partition = self._partition
        if partition is not None and (not copies or partition.shards_state):
            why = (f"at ZeRO stage {partition.stage} each rank holds a shard of the states, and reading them is a "
                   "collective every rank must enter at once (a forward of one rank alone would wait for the "
                   "others); with stage=0 every rank holds them whole and this works") if copies else \
                "each rank holds the states (or a part of them) and its own copy of the weights"
            raise ValueError(f"{what}: not with several ranks (this run has {partition.world_size}): {why}; use "
                             "engine.state_dict() on every rank to read the weights and wrap(..., weights=PATH) "
                             "or load_checkpoint to set them")
        if self._hooks.in_forward or self._backward_running:
            raise ValueError(f"{what}: a {'forward' if self._hooks.in_forward else 'backward'} pass is running; "
                             "call it between steps")
        if self._residency.held:
            raise ValueError(f"{what}: inside an engine.gathered() block; they do not nest")
        self._updates.settle_for_reading()  # [Note: deferred updates] the last step's updates are done
        micro_step = self._updates.micro_step
        pending = micro_step % self.layout.accumulation_steps
        if pending or any(any(u.has_grad) for u in self.units) or any(u.update.updated for u in self.units):
            raise ValueError(
                f"{what}: a step is pending: gradients of {pending or 'un-stepped'} micro-batch(es) are held "
                f"(micro-step {micro_step}, gradient_accumulation_steps={self.layout.accumulation_steps}); "
                "call it after the engine.step() that updates the parameters, or after zero_grad()")
        if writes and any(u.delayed_pending for u in self.units):
            raise ValueError(f"{what}: a delayed update is pending (delayed_update=True: the compute copy "
                             "lags the master by one step), so an edit would be overwritten by it; set "
                             "weights before the first step, or with wrap(..., weights=PATH)")

    def _units_of(self, params_or_modules: Any, what: str) -> List[UnitState]:
        """The units (index order) that hold the given parameters or modules' parameters."""
        if params_or_modules is None:
            return list(self.units)
        items = [params_or_modules] if isinstance(params_or_modules, (nn.Parameter, nn.Module)) \
            else list(params_or_modules)
        unit_of = {e.param: u for u in self.units for e in u.spec.entries}
        indices = set()
        for item in items:
            params = list(item.parameters()) if isinstance(item, nn.Module) else [item]
            for p in params:
                if p not in unit_of:
                    raise ValueError(f"{what}: {type(p).__name__} of shape {tuple(p.shape)} is not a parameter "
                                     "of the wrapped model")
                indices.add(unit_of[p].index)
        return [self.units[i] for i in sorted(indices)]

    def load_state_dict(self, state_dict: Dict[str, torch.Tensor], strict: bool = True) -> Any:
        """Load weights (parameters and buffers, keyed as ``model.state_dict()``) into the
        tiers, as ``wrap(..., weights=PATH)`` does: every key, shape and dtype checked
        before anything is written (a ValueError naming the offending keys); a parameter
        tied to others needs one of its names. ``strict=False``: missing parameters keep
        their values and unexpected keys are ignored, as torch's load_state_dict. Trainable
        parameters get the values as their fp32 master (the compute copy its rounding),
        frozen ones in the compute copy's dtype. Optimizer states, step counts and every
        counter are left alone. Refused when engine.gathered(modify=True) would be.
        Returns torch's ``(missing_keys, unexpected_keys)`` named tuple."""
        what = "engine.load_state_dict()"
        self._check_weights_access(what, True)
        self._end_restore_or_raise(what, compare=False)
        self._updates.quiesce()  # nothing in flight: fetches landed
        unfinished = (f"{what} did not finish, so some units hold the new weights and others not; "
                      "load the weights again before training")
        return checkpoint.load_weights(self._checkpoint, state_dict, strict, unfinished)

    def save_checkpoint(self, ckpt_dir: str) -> None:
        """Write every unit's state, the optimizer's and the RNGs' into the directory
        ``ckpt_dir``, atomically, one piece of a unit at a time; with several ranks every rank calls
        it and writes its own part. See offload/checkpoint/."""
        failure = self._status.failure
        if failure is not None and failure["fatal"]:  # before quiesce re-raises what failed the engine
            raise EngineFailedError(f"save_checkpoint: {failure['message']}")
        self._updates.quiesce()
        with self._updates.committed_view():  # [Note: delayed updates] the true state, and the lagging copy
            checkpoint.save_checkpoint(self._checkpoint, ckpt_dir)

    def load_checkpoint(self, ckpt_dir: str) -> None:
        """Verify the checkpoint in ``ckpt_dir`` against its manifest and this model, then
        stream its states into their tiers (with several ranks: every rank calls it and
        reads the part it keeps, whatever the world size that wrote it). See
        offload/checkpoint/."""
        self._residency.refuse_while_held("load_checkpoint()")
        self._updates.quiesce(raise_errors=False)  # what failed before is what the load recovers from
        self._end_restore_or_raise("load_checkpoint()", compare=False)
        checkpoint.load_checkpoint(self._checkpoint, ckpt_dir)
        self.zero_grad()

    def placement(self) -> Placement:
        """Where each unit's compute copy and optimizer states live, with their bytes, root
        first; ``.bytes_per_tier()`` sums them ([Note: placement by budget])."""
        return self._placement

    def stats(self) -> Dict[str, Any]:
        """Counters of this engine (bytes, seconds, peaks): ``offload.stats.engine_stats``."""
        return engine_stats(device=self._device, host=self._host, nvme=self._nvme, counters=self.stats_counters,
                            prefetcher=self._prefetcher, gradients=self._gradients, updates=self._updates,
                            partition=self._partition, homes=self._homes, units=self.units,
                            micro_step=self._updates.micro_step, step_seconds=self._last_step_seconds,
                            optimizer_seconds=self._last_optimizer_seconds,
                            home_bytes=self._placement.bytes_per_tier(), activations=self._activations)

    # ------------------------------------------------------------------ timeline
    def export_trace(self, path: str) -> None:
        """Write the most recent part of the timeline (``offload.stats.TIMELINE_SPANS`` spans,
        and the NVMe tier's last ``TRACE_REQUESTS`` requests) as Chrome/Perfetto trace-event
        JSON: lanes for the phases (forward, backward, optimizer step), compute per unit, the main
        thread's waits before a unit could run (for its fetch or its update), copies to the
        device, saved activations on their way out and back ("activations", with
        ``activation_offload``; their swap requests join the NVMe lanes), NVMe reads, NVMe
        writes, the updates on the optimizer worker (per unit, waits
        included: "optimizer") and the Adam kernel per unit or piece ("adam"). See
        tools/trace_summary.py for a text summary.

        NVMe requests run from their first block's issue to their completion, as the I/O
        engine saw them; several are in flight at once, so each direction is spread over
        numbered lanes ("nvme read 0", "nvme read 1", ...) in which no two overlap. Other
        transfer spans end when the engine observed them complete (a wait returned), which
        can be later than the bytes arrived; compute spans of backward run from one unit's
        backward start to the next's."""
        activations_nvme = self._activations.nvme
        self._timeline.export(path, (list(self._nvme.recent) if self._nvme is not None else []) +
                              (list(activations_nvme.recent) if activations_nvme is not None else []))

    # ------------------------------------------------------------------ lifecycle
    def _rank_swap_dir(self, swap_dir: str) -> str:
        """Where this process's swap space lives: ``swap_dir`` itself, or with several ranks
        its ``rank-<RANK>`` subdirectory, so that one swap_dir serves every rank of a node
        (each rank's run directory and lock are its own)."""
        if self._partition is None:
            return swap_dir
        return os.path.join(swap_dir, f"rank-{self._partition.rank}")

    def _close_tiers(self) -> None:
        activations = vars(self).get("_activations")
        if activations is not None:
            activations.close()
        self._device.close()  # the copies from host buffers are done: they may be unpinned
        self._host.close()
        if self._nvme is not None:
            self._nvme.close()
            self._nvme = None

    def close(self) -> None:
        """Remove hooks and swap files; the engine cannot train afterwards. Idempotent.
        Everything is released whatever fails; then a failure of the last step is raised.
        The model becomes a plain model again ([Note: the model after close]): its
        parameters hold their trained values in their dtypes from before wrap, on the CPU,
        and it can be wrapped again; unless units lived on NVMe and no restore_model() is on
        (the model is not read into RAM at close), those values would not fit in host
        memory, the engine failed, or several ranks shard the states (stage >= 1): then its parameters
        hold no values (a warning says so where the values would not fit) and wrapping it
        again is refused, naming why. [zero] With several ranks every rank calls it: it
        returns once every rank has reached its close() and finished what it had in flight,
        or raises (after releasing everything) naming the ranks that did not within
        collective_timeout_seconds ([Note: closing with several ranks])."""
        self._close(propagating=None)

    def _close(self, propagating: Optional[BaseException]) -> None:
        """close(), from the exit of a ``with`` block that ``propagating`` is leaving (None:
        none is, or close() itself): then a rank missing at the barrier is a warning."""
        status = vars(self).get("_status")  # none after a failed wrap ([Note: a failed wrap changes nothing])
        if status is None or status.closed:
            return
        status.closed = True
        # [Note: deferred updates] the last step's updates finish before the tiers close;
        # its bookkeeping is moot now, but not a failed update or swap write (reported last)
        deferred, self._updates.step_pending = self._updates.step_pending, False
        copies: Dict[nn.Parameter, torch.Tensor] = {}
        updates_done: List[bool] = []

        def wait_updates() -> None:
            self._updates.wait_optimizer()
            updates_done.append(True)

        def copy_values() -> None:  # after the updates finished, before the tiers close
            status.not_restored = self._why_not_restored(deferred) if updates_done else \
                "the last optimizer step's updates failed"
            if status.not_restored is None:
                # restored copies (and what was written into them) stay the model's
                held = self._residency.restored.take_held()
                try:
                    copies.update(model_copies(self.units, self._residency.released,
                                              self._updates.values_reader("close", step_finished=deferred), held))
                except Exception as error:  # noqa: B902 - close() goes on; the values stay where they are
                    # (a RuntimeError between backward() and step(): two steps' values)
                    copies.clear()
                    status.not_restored = str(error) if isinstance(error, RuntimeError) else \
                        f"reading them failed ({type(error).__name__}: {error})"

        def give_back_values() -> None:  # after the hooks are gone
            if copies:
                for p, value in copies.items():
                    p.data = value
                status.let_go(self.module)
            elif status.not_restored is None:
                status.not_restored = "close() failed before it read them"  # an earlier finish step raised

        def wait_for_ranks() -> None:  # [Note: closing with several ranks] before anything is torn down
            try:
                self._partition.close_barrier()
            except RuntimeError as error:
                if propagating is None:
                    raise
                warn_at_caller(f"close() while {type(propagating).__name__} leaves the with block: {error}")

        finish = [wait_updates, self._residency.drain_fetches, copy_values]
        status.close(finish=finish + [wait_for_ranks] if self._partition is not None else finish,
                     release=[self._residency.shutdown, self._updates.shutdown_worker,
                              self._hooks.remove, self._close_tiers, give_back_values],
                     write_errors=lambda: self._step_ring.write_errors if deferred else [])

    def _why_not_restored(self, deferred: bool) -> Optional[str]:
        """[Note: the model after close] Why close() cannot give the model its values back; None when it can."""
        failure = self._status.failure
        if failure is not None:
            return f"the engine failed ({failure['message']})"
        if self._partition is not None and self._partition.shards_state:  # stage 0: every rank holds them whole
            return f"each of the {self._partition.world_size} ranks holds a part of the states"
        if deferred and self._step_ring.write_errors:
            return "swap writes of the last optimizer step failed"
        on_nvme = sum(self.layout.compute_tier(u.index) == "nvme" for u in self.units)
        if on_nvme and not self._residency.restored.active:
            # a model offloaded beyond RAM is not read into RAM at close, unless restored
            return (f"{on_nvme} of its {len(self.units)} units lived on NVMe, and close() does not read a model "
                    "offloaded beyond RAM into RAM (engine.restore_model() before close() does, where it fits)")
        too_big = copies_too_big(self.units, self._residency.released, self.layout.host_budget)
        if too_big:
            warn_at_caller(f"close(): the model's parameters hold no values from now on: {too_big}. Save the "
                           "trained weights before close() with engine.save_pretrained(DIR) (or save_checkpoint), "
                           "then build the model again with wrap(..., weights=DIR)")
            return too_big
        return None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        self._close(propagating=exc)

    # ------------------------------------------------------------------ seams
    @property
    def debug(self) -> SimpleNamespace:
        """For tests and tools only, not a stable API: the tiers (``device``, ``host``,
        ``nvme``: None without swap), ``homes``, ``residency``, ``updates``, ``gradients``
        (``grad_range`` reads a parameter's gradient between backward and its update) and
        ``activations`` (the ActivationStore, with its own ``nvme`` tier), so that a test
        reads a counter or swaps in a wrapper without the engine's private fields
        (docs/architecture.md, "Seams"). Failures are injected through offload.faults."""
        return SimpleNamespace(device=self._device, host=self._host, nvme=self._nvme, homes=self._homes, residency=self._residency,
                               updates=self._updates, timeline=self._timeline, prefetcher=self._prefetcher,
                               gradients=self._gradients, activations=self._activations)
