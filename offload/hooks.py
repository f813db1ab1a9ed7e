"""The forward and backward hooks that bring units to the device as the model uses them, and
the saved-tensor hooks that let backward find parameters again after their unit has left.

Each hook is one use of a unit, told in the same order: have the unit on the device (the
``need`` callable: wait for its prefetch or fetch it, evicting as the plan says, then issue
the plan's next transfers), wait until its copy has landed on this stream, mark it in use
for as long as its compute runs, and give it back after.

[Note: saved parameters] Autograd keeps references to the parameters a backward formula
needs (the weight of a Linear, say). Those tensors are views into the device arena, whose
slots are reused by other units once a unit is released. A saved-tensors hook therefore
replaces every saved view of the arena by a reference (unit, offset, size, stride) and, when
backward unpacks it, fetches the unit again if it has left the device. So correctness never
depends on what is resident when; residency only decides speed.

With activation_offload set, every other saved tensor goes to the ActivationStore, which
moves a unit's saved tensors off the device between its forward and its backward ([Note:
saved activations] in memory/activations.py).

[Note: released parameters] (memory/released.py): a parameter whose unit is not on the
device keeps its shape; read weights with ``engine.state_dict()`` or inside
``engine.gathered()`` ([Note: gathered parameters] in memory/residency.py).
"""
from __future__ import annotations

import copy
import functools
import sys
import time
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Optional, Protocol, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from offload import faults
from offload.memory.activations import ActivationStore, SavedActivation
from offload.memory.layout import UnitState
from offload.optim.gradients import Gradients
from offload.tiers.context import TierContext
from offload.units import Residency
from offload.zero import Partition

__all__ = ["Hooks"]


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward tells the engine that one call of the unit
    has finished its backward (the gradient with respect to its inputs is complete)."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.callback = callback
        ctx.set_materialize_grads(False)
        outputs = tuple(t.view_as(t) for t in tensors)
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.callback()
        return (None, *grads)


def wrap_unit_inputs(args: Any, callback: Callable[[], None]) -> Optional[Tuple[Any, ...]]:
    """A unit call's positional arguments with each tensor that requires a gradient passed
    through ``_PostBackward`` (None: none does). ``offload plan``'s activation trace wraps
    them too (plan_activations.py): the views it makes are what the unit saves."""
    wrap_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not wrap_at:
        return None
    wrapped = _PostBackward.apply(callback, *(args[i] for i in wrap_at))
    wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
    args = list(args)
    for i, t in zip(wrap_at, wrapped):
        args[i] = t
    return tuple(args)


@dataclass(frozen=True)
class _SavedParamRef:
    """Stands for a saved view of the arena while backward has not used it yet."""

    unit_index: int
    relative_offset: int
    size: torch.Size
    stride: Tuple[int, ...]


class _AliasSlot:
    """[Note: shared parameter gradients] A module slot that holds a shared parameter, not
    its first: while the module's forward runs under grad mode the slot holds an alias, the
    same memory as a leaf of its own, whose gradient goes to ``on_grad`` (``Gradients.on_shared_grad``
    through the check of [Note: backward outside engine.backward])."""

    def __init__(self, module: nn.Module, name: str, on_grad: Callable[[torch.Tensor], None]) -> None:
        self._module = module
        self._name = name
        self._param = module._parameters[name]
        self._on_grad = on_grad
        self._depth = 0  # a module called from within its own forward swaps once

    def enter(self, module: nn.Module, args: Any) -> None:
        self._depth += 1
        if self._depth == 1 and torch.is_grad_enabled() and self._param.requires_grad:
            alias = self._param.detach().requires_grad_()
            alias.register_post_accumulate_grad_hook(self._on_grad)
            module._parameters[self._name] = alias

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1
        if self._depth <= 0:
            self.restore()

    def restore(self) -> None:
        self._depth = 0
        self._module._parameters[self._name] = self._param


class _StateDicts:
    """[Note: state_dict of a wrapped model] After wrap a parameter holds a placeholder
    ([Note: released parameters]), so ``model.state_dict()`` (or any submodule's) would give
    NaN views. Hooks on every module put the values in: each module's post-hook replaces
    the entries of the parameters it owns by their current full-precision values (the
    fp32 master where one exists, as ``engine.state_dict()``; on the CPU), read a unit at a
    time for the whole call (the outermost module's pre-hook starts the call, its post-hook
    ends it). So code that saves through ``state_dict()`` (peft's ``save_pretrained`` of an
    adapter, a Trainer's ``save_model``) writes the trained values. ``keep_vars=True`` gets
    the parameter objects, as ever. ``load_state_dict`` into a wrapped model is refused
    with a ValueError naming the ways to load weights (its writes would be lost)."""

    def __init__(self, module: nn.Module, units: List[UnitState], updates: "PassUpdates") -> None:
        self._module = module
        self._updates = updates
        entry_of = {e.param: (u, e) for u in units for e in u.spec.entries}
        self._owned: Dict[nn.Module, List[Tuple[str, UnitState, Any]]] = {}
        for m in module.modules():
            self._owned[m] = [(name, *entry_of[p]) for name, p in m._parameters.items() if p in entry_of]
        self._call: Optional[Tuple[nn.Module, bool]] = None  # (outermost module, keep_vars)
        self._values: Optional[Callable[[UnitState], Dict[int, torch.Tensor]]] = None
        self._cached: Tuple[Optional[UnitState], Dict[int, torch.Tensor]] = (None, {})

    def install(self) -> List[Any]:
        handles = []
        for m, owned in self._owned.items():
            # (partials: torch marks a post-hook with an attribute, which a bound method refuses)
            handles.append(m.register_state_dict_pre_hook(functools.partial(_StateDicts._pre, self)))
            handles.append(m.register_state_dict_post_hook(functools.partial(_StateDicts._post, self)))
            if owned or m is self._module:
                handles.append(m.register_load_state_dict_pre_hook(self._refuse_load))
        return handles

    def _pre(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self._call is None:
            self._values = None if keep_vars else self._updates.settled_values("state_dict")
            self._call = (module, keep_vars)

    def _post(self, module: nn.Module, state_dict: Dict[str, Any], prefix: str, metadata: Any) -> None:
        outermost, keep_vars = self._call if self._call is not None else (module, True)
        try:
            if not keep_vars:
                for name, u, e in self._owned.get(module, ()):
                    key = prefix + name
                    if key in state_dict:
                        if self._cached[0] is not u:
                            self._cached = (None, {})
                            self._cached = (u, self._values(u))
                        state_dict[key] = self._cached[1][e.offset].clone()
        except BaseException:
            self._end()
            raise
        if module is outermost:
            self._end()

    def _end(self) -> None:
        self._call, self._values, self._cached = None, None, (None, {})

    def _refuse_load(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        raise ValueError("load_state_dict() into a model wrapped by offload would be lost (its values live "
                         "in the engine's tiers): load weights with engine.load_state_dict(state_dict), "
                         "wrap(..., weights=PATH) or engine.load_checkpoint(DIR), or edit them inside "
                         "`with engine.gathered(params, modify=True):`")


class _Moves:
    """[Note: moving a wrapped model] ``model.to(...)``, ``.cuda()``, ``.cpu()``, ``.half()``,
    ``.float()``, ``.bfloat16()``, ``.type()``, ``.to_empty()`` (and the same on any submodule)
    all run ``nn.Module._apply(fn)``, which would give each parameter a new tensor: one the
    engine never sees, so the values would go stale and the engine's writes be lost. Every
    module of the model gets its own ``_apply`` while wrapped (an attribute of the instance,
    so the class and other models are untouched; removed with the hooks). The outermost
    call first tries ``fn`` on a small stand-in of every parameter and buffer below it (same
    dtype and device; 2 elements per dimension for 4-5 dimensions, where ``to`` may change
    the memory format): where ``fn`` gives back its input for every one, the call changes
    nothing and goes ahead (``trainer.model.to("cpu")`` of a CPU engine's restored model);
    otherwise a ValueError names the method, the first tensor it would replace, and the
    ways (the engine's config; ``close()``, after which the model is a plain one)."""

    def __init__(self, module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self._module = module
        self._device = device
        self._dtype = dtype
        self._applying = False  # an allowed call runs: the inner modules' _apply go straight on
        self._prefix = {m: f"{name}." if name else "" for name, m in module.named_modules(remove_duplicate=False)}

    def install(self) -> List[Any]:
        handles = []
        for m in self._module.modules():
            object.__setattr__(m, "_apply", functools.partial(self._apply, m))
            handles.append(types.SimpleNamespace(remove=functools.partial(m.__dict__.pop, "_apply", None)))
        return handles

    def _apply(self, module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        if self._applying:
            return type(module)._apply(module, fn, recurse)
        tensors = [*module.named_parameters(recurse=recurse), *module.named_buffers(recurse=recurse)]
        for name, t in tensors:
            if t is None:
                continue
            shape = (2,) * t.dim() if t.dim() in (4, 5) else (0,) * t.dim()
            stand_in = torch.empty(shape, dtype=t.dtype, device=t.device)
            try:
                with torch.no_grad():
                    changes = fn(stand_in) is not stand_in
            except Exception as error:  # the call would fail on the real tensor too (.cuda() without CUDA)
                raise ValueError(self._refusal(module, fn, name, t)) from error
            if changes:
                raise ValueError(self._refusal(module, fn, name, t))
        self._applying = True
        try:
            return type(module)._apply(module, fn, recurse)
        finally:
            self._applying = False

    def _refusal(self, module: nn.Module, fn: Callable[..., Any], name: str, t: torch.Tensor) -> str:
        qualname = getattr(fn, "__qualname__", "")  # "Module.half.<locals>.<lambda>": the method's name
        method = qualname.split(".<locals>")[0].rpartition(".")[2] if ".<locals>" in qualname else ""
        call = f"{type(module).__name__}.{method}()" if method else "a conversion"
        name = self._prefix.get(module, "") + name
        return (f"{call} on a model wrapped by offload: it would replace {name} ({t.dtype}, on {t.device}) by a "
                f"tensor the engine never sees, and the engine places and casts the parameters itself (on "
                f"{self._device}, computing in {self._dtype}). Choose them with OffloadConfig's device= and dtype= "
                "(OffloadTrainer: TrainingArguments' device and bf16), or close the engine first (engine.close(), "
                "trainer.close()): the model is then a plain model on the CPU with its trained values")


class _Copies:
    """[Note: copies of a wrapped model] ``copy.deepcopy``, ``pickle`` and ``torch.save`` of
    a wrapped model (or of any of its modules) would copy the engine along with it, through
    its hooks (and fail on its locks), and its parameters hold placeholders or compute
    copies, not their values ([Note: released parameters]). Every module of the model gets
    its own ``__deepcopy__`` and ``__reduce_ex__`` while wrapped (attributes of the instance,
    as [Note: moving a wrapped model]; both ``copy`` and ``pickle`` look them up on the
    instance; removed with the hooks) that copy it as a plain module: the same attributes,
    deep-copied, without the engine's hooks (hooks of the user's own are copied) and these
    attributes, each parameter a new ``nn.Parameter`` holding a copy of its current value,
    as ``engine.restore_model()`` gives it (``plain_values``: the fp32 master where one
    exists, in the dtype from before wrap, on the CPU; refused, a ValueError, where
    ``restore_model()`` would be); buffers as they are; parameters tied in the model tied
    in the copy. So the copy is a model of its own: it trains, moves and can be wrapped by
    another engine, and the engine never sees it. ``copy.copy`` goes through
    ``__reduce_ex__`` too, so it also gives such a copy rather than a second handle on the
    wrapped model. A pickle of the model thus holds a plain model; ``torch.load`` gives that
    back. One deepcopy keeps identities across its objects (``deepcopy([model.blocks[1],
    model])``: the copied model holds the copied block); each module pickled is copied on
    its own."""

    def __init__(self, module: nn.Module, engine_handles: List[Any],
                 plain_values: Callable[[nn.Module], Dict[nn.Parameter, torch.Tensor]]) -> None:
        self._module = module
        self._plain_values = plain_values
        handles = [h for h in engine_handles if isinstance(h, torch.utils.hooks.RemovableHandle)]
        # the engine's hook entries: keyed by their handles' ids in the module's hook dicts
        self._hook_ids = {h.id for h in handles}
        self._hook_dicts = {id(d) for h in handles for ref in (h.hooks_dict_ref, *h.extra_dict_ref)
                            if (d := ref()) is not None}

    def install(self) -> List[Any]:
        handles = []
        for m in self._module.modules():
            object.__setattr__(m, "__deepcopy__", functools.partial(self._deepcopy, m))
            object.__setattr__(m, "__reduce_ex__", functools.partial(self._reduce_ex, m))
            for name in ("__deepcopy__", "__reduce_ex__"):
                handles.append(types.SimpleNamespace(remove=functools.partial(m.__dict__.pop, name, None)))
        return handles

    def _deepcopy(self, module: nn.Module, memo: Dict[int, Any]) -> nn.Module:
        prepared = memo.setdefault(id(self), set())  # the modules of this copy whose values are in memo
        if id(module) not in prepared:  # the outermost module of its subtree: values, hook dicts
            for p, value in self._plain_values(module).items():
                if id(p) not in memo:
                    memo[id(p)] = type(p)(value, p.requires_grad)
            for m in module.modules():
                prepared.add(id(m))
                for attribute in vars(m).values():
                    if isinstance(attribute, dict) and id(attribute) in self._hook_dicts and id(attribute) not in memo:
                        memo[id(attribute)] = type(attribute)(
                            (k, copy.deepcopy(v, memo)) for k, v in attribute.items() if k not in self._hook_ids)
        plain = type(module).__new__(type(module))
        memo[id(module)] = plain
        state = {k: v for k, v in vars(module).items() if k not in ("_apply", "__deepcopy__", "__reduce_ex__")}
        plain.__dict__.update(copy.deepcopy(state, memo))
        return plain

    def _reduce_ex(self, module: nn.Module, protocol: int) -> Any:
        return self._deepcopy(module, {}).__reduce_ex__(protocol)


class UnitsOnDevice(Protocol):
    """What the hooks need of the residency (memory.residency.DeviceResidency)."""

    def begin_pass(self) -> None:
        """A forward pass begins, no unit is the current one: a restore ends, and it raises,
        before the pass changes anything, if a parameter was written where the write is lost
        ([Note: released parameters], [Note: restored parameters])."""

    def begin_trace(self, key: Hashable, training: bool) -> None:
        """The pass of kind ``key`` begins: the prefetcher replays its trace, or records one."""

    def need(self, u: UnitState) -> None:
        """u is about to be used: have it on the device (or its transfer in flight) and start
        the transfers the prefetch plan says come next."""

    def wait_ready(self, u: UnitState) -> None:
        """Make the compute stream wait for u's transfer to land."""


class PassUpdates(Protocol):
    """What the hooks need of the update scheduler (optim.updates.UpdateScheduler)."""

    early_updates: bool  # this backward may update units as they finish ([Note: early updates])

    def overlapping(self) -> bool:
        """The last step's deferred or delayed updates are still running ([Note: deferred
        updates], [Note: delayed updates]): the forward must not wait for them."""

    def wait_before_forward(self) -> None:
        """Wait for every queued update (and drop the device copies that speculative
        updates not yet committed wrote)."""

    def maybe_update_early(self) -> None:
        """Start the updates of the units now done."""

    def settled_values(self, what: str) -> Callable[[UnitState], Dict[int, torch.Tensor]]:
        """The reader of a unit's current values (Homes.unit_values), raising if ``what``
        came between an early update and step() ([Note: state_dict of a wrapped model])."""


class Hooks:
    """The hooks on the model (its root, every other unit's module, every trainable
    parameter's gradient) and the saved-tensor hooks of a forward under grad mode; owns
    their handles and what the hooks keep between calls: the forward nesting depth, the
    unit whose backward runs now, the key of the last training pass. Main thread only
    (autograd runs these hooks on the thread that calls backward)."""

    def __init__(self, module: nn.Module, units: List[UnitState], *, tiers: TierContext, gradients: Gradients,
                 partition: Optional[Partition], activations: ActivationStore, residency: UnitsOnDevice,
                 updates: PassUpdates) -> None:
        """``units``: the root first. ``tiers``: the device tier (the arena's views, the reads
        a forward is done with) and the timeline. ``gradients`` takes each parameter's
        gradient once autograd has accumulated it. ``partition``: [zero] the ranks'
        partition, or None. ``activations``: where saved tensors other than parameters go
        ([Note: saved activations]; a store with no mode hands them back as they are).
        ``residency`` begins passes and brings units to the device; ``updates`` runs the
        optimizer beside the passes and reads the units' values for ``state_dict()``."""
        self._module = module
        self._units = units
        self._root = units[0]
        self._gradients = gradients
        self._device = tiers.device
        self._partition = partition
        self._timeline = tiers.timeline
        self._activations = activations
        self._residency = residency
        self._updates = updates
        self._state_dicts = _StateDicts(module, units, updates)
        # [zero] Buffers kept in step across ranks (like DDP's broadcast_buffers).
        self._buffers = [b for b in module.buffers()]
        self._handles: List[Any] = []
        self._saved_hooks: List[Any] = []  # the saved-tensor hooks of the forward running now
        self._aliases: List[_AliasSlot] = []  # [Note: shared parameter gradients]
        self._forward_depth = 0  # the root's forward may be called from within itself
        # the frame of the root call that began the pass open now (None between passes)
        self._pass_frame: Optional[types.FrameType] = None
        self._forward_started = 0.0
        self._backward_unit: Optional[UnitState] = None  # the unit whose backward runs now
        self._in_engine_backward = False  # [Note: backward outside engine.backward]
        self._backward_started = 0.0

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> None:
        handles = self._handles
        handles.append(self._module.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True))
        handles.append(self._module.register_forward_hook(self._root_post_forward, always_call=True))
        for u in self._units[1:]:
            handles.append(u.spec.module.register_forward_pre_hook(functools.partial(self._unit_pre_forward, u)))
            handles.append(u.spec.module.register_forward_hook(
                functools.partial(self._unit_post_forward, u), always_call=True))
        # [Note: shared parameter gradients] (unit index, k) -> the module attributes of a tied parameter
        shared = {(u.index, k): e.slots for u in self._units for k, e in enumerate(u.trainable)
                  if len(e.slots) > 1} if self._gradients.sums_shared_uses else {}
        for u in self._units:
            for k, e in enumerate(u.trainable):
                on_grad = self._gradients.on_shared_grad if (u.index, k) in shared else self._gradients.on_grad_ready
                handles.append(e.param.register_post_accumulate_grad_hook(
                    functools.partial(self._grad_ready, on_grad, u, k)))
        for (u_index, k), slots in shared.items():  # [Note: shared parameter gradients]
            for module, name in slots[1:]:
                alias = _AliasSlot(module, name, functools.partial(
                    self._grad_ready, self._gradients.on_shared_grad, self._units[u_index], k))
                self._aliases.append(alias)
                handles.append(module.register_forward_pre_hook(alias.enter))
                handles.append(module.register_forward_hook(alias.leave, always_call=True))
        handles.extend(self._state_dicts.install())
        handles.extend(_Moves(self._module, self._device.device, self._device.dtype).install())

    def install_copies(self, plain_values: Callable[[nn.Module], Dict[nn.Parameter, torch.Tensor]]) -> None:
        """After install(): copies and pickles of the model's modules are plain modules ([Note:
        copies of a wrapped model]); ``plain_values(module)`` gives the values of its
        parameters (Engine's, as restore_model reads them)."""
        self._handles.extend(_Copies(self._module, self._handles, plain_values).install())

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ forward
    def _root_pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._forward_depth > 0 and not self._pass_on_stack():
            # The last pass was interrupted where torch skips the always-called post-forward
            # hooks (a KeyboardInterrupt in model(...) called directly; engine(...) ends its own
            # pass): end it now, so that this call starts a new one instead of nesting in it.
            self.abort_forward()
        self._forward_depth += 1
        if self._forward_depth > 1:
            return
        self._pass_frame = sys._getframe(1)  # the root module's call, on the stack while the pass runs
        self._forward_started = time.perf_counter()
        # A new pass, no unit the current one. It raises, before anything of the pass
        # changes, if a released parameter was written ([Note: released parameters]); the
        # root post-forward hook runs all the same (always_call) and undoes the depth.
        self._residency.begin_pass()
        self._in_engine_backward = False  # a backward that raised did not reach end_backward
        # 1. The last step's updates are done ([Note: deferred updates]: else each fetch
        #    waits for its own unit; [Note: delayed updates]: else nothing waits for them
        #    before the next step()), and [zero] the ranks' buffers agree.
        if not self._updates.overlapping():
            self._updates.wait_before_forward()
        if self._partition is not None and self._module.training and self._buffers:  # [zero]
            self._partition.broadcast_buffers(self._buffers)
        # 2. A new pass: the trace of its kind is replayed, every unit's calls counted anew.
        key = self._pass_key(args, kwargs)
        self._residency.begin_trace(key, training=key[0] and key[1])
        for u in self._units:
            u.calls = u.backward_done = 0
        # 3. Saved views of the arena become references ([Note: saved parameters]), other
        #    saved tensors go to the activation store ([Note: saved activations]).
        if torch.is_grad_enabled():
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack_saved, self._unpack_saved)
            ctx.__enter__()
            self._saved_hooks.append(ctx)
            self._activations.begin_pass()
        # 4. The root on the device, in use until the whole forward is over.
        self._residency.need(self._root)
        self._residency.wait_ready(self._root)
        if self._root.compute_state == Residency.LOADED:
            self._root.compute_state.to(Residency.IN_USE)

    @property
    def in_forward(self) -> bool:
        """Whether a forward pass of the model is running (engine.gathered() refuses then)."""
        return self._forward_depth > 0 and self._pass_on_stack()

    def _pass_on_stack(self) -> bool:
        """Whether the root call that began the open pass is still running on this thread's
        stack (a call of the root from within its own forward), rather than unwound."""
        frame = sys._getframe(2)
        while frame is not None:
            if frame is self._pass_frame:
                return True
            frame = frame.f_back
        return False

    def abort_forward(self) -> None:
        """A forward raised ([Note: failures inside a step]). torch runs the always-called
        post-forward hooks for an Exception only: after a KeyboardInterrupt (or any other
        BaseException) end the pass here, so that the next forward starts a new one."""
        self._forward_depth = 0
        self._pass_frame = None
        while self._saved_hooks:
            self._saved_hooks.pop().__exit__(None, None, None)
        try:
            self._activations.end_pass(abandoned=True)
        except OSError:
            pass  # a failed swap write of this abandoned pass: nothing will read it
        for alias in self._aliases:
            alias.restore()
        for u in self._units:
            if u.compute_state == Residency.IN_USE:
                u.compute_state.to(Residency.LOADED)

    def _pass_key(self, args: Any, kwargs: Any) -> Tuple[Hashable, ...]:
        """Passes of one kind share a trace: same mode, grad mode and argument shapes."""
        signature = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
                          for x in tree_flatten((args, kwargs))[0])
        return (self._module.training, torch.is_grad_enabled(), signature)

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._forward_depth -= 1
        if self._forward_depth > 0:
            return
        self._pass_frame = None
        if self._saved_hooks:
            self._saved_hooks.pop().__exit__(None, None, None)
        self._activations.end_pass()  # [Note: saved activations] the last group stays
        if self._root.compute_state == Residency.IN_USE:
            self._root.compute_state.to(Residency.LOADED)
        # [Note: streams] an update written into a device-homed unit's slot waits for this
        # forward's reads (an evaluation's, too, before the step)
        for u in self._units:
            if u.compute_home is None and u.device_offset is not None:
                self._device.reads_done(u.device_offset, u.compute_numel, what=f"the forward of unit {u.name!r}")
        self._timeline.span("phase", "forward", self._forward_started, time.perf_counter())

    def _unit_pre_forward(self, u: UnitState, module: nn.Module, args: Any) -> Any:
        start = time.perf_counter()
        faults.hit("hooks.forward", unit=u.name)
        u.calls += 1
        # 0. The saved tensors before this unit leave the device ([Note: saved activations]).
        self._activations.begin_unit(u.name)
        # 1. u on the device (its prefetch waited for, or fetched now), the next ones issued.
        self._residency.need(u)
        self._residency.wait_ready(u)
        u.compute_started = self._timeline.wait(f"forward {u.name}", start)
        # 2. In use while its forward runs: no eviction takes its slot.
        if u.compute_state == Residency.LOADED:
            u.compute_state.to(Residency.IN_USE)
        # 3. Under grad mode its inputs report when this call's backward is over.
        if not torch.is_grad_enabled():
            return None
        return wrap_unit_inputs(args, functools.partial(self._on_unit_backward_done, u))

    def _unit_post_forward(self, u: UnitState, module: nn.Module, args: Any, output: Any) -> None:
        # 1. Done with u: its slot may be evicted again.
        if u.compute_state == Residency.IN_USE:
            u.compute_state.to(Residency.LOADED)
        self._timeline.span("compute", f"forward {u.name}", u.compute_started, time.perf_counter())
        # 2. Under grad mode the gradient of its output says that u's backward comes next.
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, u))

    # ------------------------------------------------------------------ backward
    def begin_backward(self) -> None:
        """engine.backward starts a backward: no unit's backward runs yet."""
        self._backward_unit = None
        self._in_engine_backward = True

    def end_backward(self) -> None:
        """The backward is over: close the compute span of the unit that ran last."""
        self._in_engine_backward = False
        if self._backward_unit is not None:
            self._timeline.span("compute", f"backward {self._backward_unit.name}", self._backward_started,
                                time.perf_counter())

    def _check_engine_backward(self) -> None:
        """[Note: backward outside engine.backward] A backward of the model's graph that
        engine.backward did not start (``loss.backward()``, accelerate's
        ``accelerator.backward(loss)``, ``torch.autograd.grad``) would hand the engine
        gradients it never scales by the accumulation nor steps with, or none at all, and the
        model would not train while nothing said so. The first of the engine's hooks that such
        a backward reaches raises: the saved tensors' unpacking, a unit's pre-backward, or a
        parameter's gradient (dropped, not taken). Some hook runs before any gradient of a
        trainable parameter is taken, so nothing of that backward reaches the engine."""
        if not self._in_engine_backward:
            raise ValueError("a backward of a model wrapped by offload ran outside engine.backward(loss) "
                             "(loss.backward(), accelerator.backward(loss), torch.autograd.grad): the engine "
                             "takes gradients only there, so nothing would train; call engine.backward(loss), "
                             "then engine.step() in place of optimizer.step(). Nothing of this backward was kept")

    def _grad_ready(self, on_grad: Callable[[UnitState, int, torch.Tensor], None], u: UnitState, k: int,
                    param: torch.Tensor) -> None:
        if not self._in_engine_backward:
            param.grad = None
            self._check_engine_backward()
        on_grad(u, k, param)

    def _pre_backward(self, u: UnitState, grad: torch.Tensor) -> None:
        """The gradient of u's output has arrived: u's backward is next. Bring it back."""
        self._check_engine_backward()
        faults.hit("hooks.backward", unit=u.name)
        now = time.perf_counter()
        # 1. The unit before it is done computing.
        if self._backward_unit is not None and self._backward_unit is not u:
            self._timeline.span("compute", f"backward {self._backward_unit.name}", self._backward_started, now)
        self._backward_unit = u
        # 2. u on the device, the next ones issued.
        self._residency.need(u)
        self._residency.wait_ready(u)
        self._backward_started = self._timeline.wait(f"backward {u.name}", now)
        # 3. Its saved tensors, and the next ones backward needs, on their way back ([Note:
        #    saved activations]).
        self._activations.before_backward(u.name)
        # 4. Units whose gradients are final may be updated now ([Note: early updates]).
        self._updates.maybe_update_early()

    def _on_unit_backward_done(self, u: UnitState) -> None:
        u.backward_done += 1
        if self._updates.early_updates:
            self._updates.maybe_update_early()

    # ------------------------------------------------------------------ saved tensors
    def _pack_saved(self, t: torch.Tensor) -> Any:
        """[Note: saved parameters] A view of a resident unit's slot becomes a reference;
        [Note: saved activations] any other tensor goes to the activation store."""
        device = self._device
        offset = device.offset_of(t) if t.device == device.device and t.dtype == device.dtype else None
        if offset is not None:
            for u in self._units:
                if u.device_offset is not None and u.compute_state.value in (Residency.LOADED, Residency.IN_USE) \
                        and u.device_offset <= offset < u.device_offset + u.compute_numel:
                    return _SavedParamRef(u.index, offset - u.device_offset, t.size(), t.stride())
            raise AssertionError("a saved view of the device arena belongs to no resident unit")
        return self._activations.pack(t)

    def _unpack_saved(self, saved: Any) -> torch.Tensor:
        """[Note: saved parameters] A reference becomes a view again, its unit fetched."""
        self._check_engine_backward()
        if isinstance(saved, _SavedParamRef):
            u = self._units[saved.unit_index]
            self._residency.need(u)
            self._residency.wait_ready(u)
            return self._device.strided_view(saved.size, saved.stride, u.device_offset + saved.relative_offset)
        if isinstance(saved, SavedActivation):
            return self._activations.unpack(saved)
        return saved
