"""wrap() and Engine: the lifecycle of an offloaded model.

The setup reads top to bottom in ``Engine.__init__``: unpack the config, cut the model into
units, check every budget (before anything is allocated or created), allocate the tiers,
move each unit's state to its home tier, install the hooks.

[Note: saved parameters] Autograd keeps references to the parameters a backward formula
needs (the weight of a Linear, say). Those tensors are views into the device arena, whose
slots are reused by other units once a unit is released. A saved-tensors hook therefore
replaces every saved view of the arena by a reference (unit, offset, size, stride) and, when
backward unpacks it, fetches the unit again if it has left the device. So correctness never
depends on what is resident when; residency only decides speed.

[Note: released parameters] A parameter whose unit is not on the device holds an empty
tensor (``param.data`` is swapped, the ``nn.Parameter`` object stays the same, so the user's
optimizer and the gradient hooks keep working). Use ``engine.state_dict()`` to read weights.
"""
from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from offload import checkpoint
from offload.checkpoint import EngineFailedError
from offload.config import OffloadConfig, format_size
from offload.optim import adam_step_flat
from offload.stats import Stats
from offload.tiers import DeviceTier, HostTier, NvmeTier
from offload.units import (
    ParamEntry, Residency, ResidencyState, UnitSpec, padded_numel, split_into_units)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_FP32_BYTES = 4


@dataclass(frozen=True)
class _SavedParamRef:
    """Stands for a saved view of the arena while backward has not used it yet."""

    unit_index: int
    relative_offset: int
    size: torch.Size
    stride: Tuple[int, ...]


@dataclass(frozen=True)
class _ExtentView:
    """A sub-range of a swap extent (the trainable prefix of a buffer)."""

    path: str
    offset: int
    nbytes: int


class _Unit:
    """Runtime state of one unit: where each of its buffers lives and what is on the device."""

    def __init__(self, spec: UnitSpec, compute_element_bytes: int) -> None:
        self.spec = spec
        self.index = spec.index
        self.name = spec.name
        self.compute_numel = padded_numel(spec.total_numel, compute_element_bytes)
        self.master_numel = padded_numel(spec.trainable_numel, _FP32_BYTES)
        self.trainable = [e for e in spec.entries if e.trainable]
        # Homes: a host tensor or a swap extent, whichever the tier gives.
        self.compute_home: Any = None       # None when param_tier == "device" (lives in the arena)
        self.master_home: Any = None        # None when merged with the compute copy
        self.moments_home: Any = None       # exp_avg then exp_avg_sq, master_numel each
        self.grad: Optional[torch.Tensor] = None
        self.has_grad = [False] * len(self.trainable)
        self.steps = [0] * len(self.trainable)
        self.device_offset: Optional[int] = None
        self.compute_state = ResidencyState(f"{spec.name}.compute", Residency.HOME)
        self.ready_event: Optional[torch.cuda.Event] = None
        self.last_use = 0


class _StagingSlot:
    """Host buffers the optimizer pipeline reads one unit's states into."""

    def __init__(self, host: HostTier, master_numel: int, compute_numel: int,
                 compute_dtype: torch.dtype) -> None:
        self.master = host.allocate(master_numel, torch.float32)
        self.moments = host.allocate(2 * master_numel, torch.float32)
        self.compute = host.allocate(compute_numel, compute_dtype) if compute_numel else None
        self.pending_writes: List[Any] = []


def wrap(model: nn.Module, optimizer: torch.optim.Optimizer,
         config: "OffloadConfig | dict | str | None" = None, *,
         init_fn: Optional[Callable[[nn.Module], None]] = None) -> "Engine":
    """Offload ``model``'s training state as ``config`` says and return the Engine that
    trains it. ``optimizer`` must be torch.optim.Adam/AdamW or offload.CPUAdam over the
    model's parameters; its param groups (and any LR scheduler changing them) are honored.
    ``init_fn(module)`` initializes modules of a meta-device model after
    ``reset_parameters()``."""
    return Engine(model, optimizer, OffloadConfig.from_any(config), init_fn=init_fn)


def _adam_flavour(optimizer: torch.optim.Optimizer) -> bool:
    """True for decoupled weight decay (AdamW); checks what we cannot honor."""
    from offload.optim import CPUAdam  # the one optimizer class of ours

    if not isinstance(optimizer, (torch.optim.Adam, CPUAdam)):
        raise ValueError(
            f"optimizer: offload runs Adam/AdamW on the CPU next to the states; got "
            f"{type(optimizer).__name__}. Pass torch.optim.Adam, torch.optim.AdamW or offload.CPUAdam")
    for i, group in enumerate(optimizer.param_groups):
        for key in ("amsgrad", "maximize"):
            if group.get(key, False):
                raise ValueError(f"optimizer: param_groups[{i}]['{key}']=True is not supported")
    if isinstance(optimizer, CPUAdam):
        return bool(optimizer.defaults.get("adamw", True))
    return isinstance(optimizer, torch.optim.AdamW) or bool(
        optimizer.defaults.get("decoupled_weight_decay", False))


class Engine:
    """Trains one model with its state spread over device, host and NVMe tiers.

    Use it like the model (``engine(*args, **kwargs)`` runs the model's forward), then
    ``engine.backward(loss)`` and ``engine.step()`` after every micro-batch.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: OffloadConfig,
                 init_fn: Optional[Callable[[nn.Module], None]] = None) -> None:
        # 1. Unpack the config; below this point code takes plain arguments.
        self.config = config
        self.module = model
        self.optimizer = optimizer
        self.device = config.resolved_device()
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.compute_dtype = _DTYPES[config.dtype]
        compute_element_bytes = torch.empty(0, dtype=self.compute_dtype).element_size()
        self._param_tier = config.param_tier
        self._optimizer_tier = config.optimizer_tier
        self._accumulation_steps = config.gradient_accumulation_steps
        self._max_grad_norm = config.max_grad_norm
        # [fp32 merge] With fp32 compute, the compute copy is the master: one buffer, homed
        # on param_tier, serves both (unless the compute copy lives on the device).
        self._merged = config.dtype == "fp32" and config.param_tier != "device"
        if config.stage != 0:
            raise ValueError(f"stage: ZeRO stage {config.stage} needs several ranks; "
                             "multi-rank training is not available yet, use stage=0")

        # 2. Units, from the model and the optimizer's param groups.
        self._adamw = _adam_flavour(optimizer)
        group_of: Dict[nn.Parameter, int] = {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                group_of[p] = gi
        specs = split_into_units(model, group_of, compute_element_bytes, config.unit_classes,
                                 config.unit_predicate)
        self._unmaterialized = self._replace_meta_parameters(specs)
        self.units = [_Unit(spec, compute_element_bytes) for spec in specs]
        self._root = self.units[0]

        # 3. Budgets, checked before anything is allocated.
        device_capacity_numel, device_budget = self._plan_device(compute_element_bytes)
        needs_nvme = "nvme" in (self._param_tier, self._optimizer_tier)
        self._staged_step = needs_nvme
        nvme_bytes = self._plan_nvme(compute_element_bytes) if needs_nvme else 0
        self._check_host_budget(compute_element_bytes)

        # 4. Tiers.
        self.stats_counters = Stats()
        self._device = DeviceTier(self.device, self.compute_dtype, device_capacity_numel, device_budget)
        self._host = HostTier(config.host_budget)
        self._nvme: Optional[NvmeTier] = None
        if needs_nvme:
            self._nvme = NvmeTier(config.swap_dir, nvme_bytes, config.io_backend,
                                  config.io_block_bytes, config.io_queue_depth)
        try:
            self._allocate_homes()
            self._slots = self._allocate_staging()
            # 5. Move every unit's state to its home tier (materializing meta models).
            self._placeholder = torch.empty(0, dtype=self.compute_dtype, device=self.device)
            self._move_to_homes(init_fn)
        except BaseException:
            self._close_tiers()
            raise

        # 6. Hooks.
        self._tick = 0
        self._micro_step = 0
        self._loss_scale = config.initial_loss_scale if config.dtype == "fp16" else 1.0
        self._good_steps = 0
        self._last_grad_norm: Optional[float] = None
        self._last_step_end: Optional[float] = None
        self._last_step_seconds = 0.0
        self._last_optimizer_seconds = 0.0
        self._forward_depth = 0
        self._saved_hooks: List[Any] = []
        self._hook_handles: List[Any] = []
        self._install_hooks()
        # [Note: swap I/O failures] _failure: None, or why the engine refuses to train;
        # _dirty: unit index -> states whose swap write failed, held in host RAM.
        self._failure: Optional[Dict[str, Any]] = None
        self._dirty: Dict[int, Dict[str, torch.Tensor]] = {}
        self._closed = False

    # ------------------------------------------------------------------ planning
    def _plan_device(self, element_bytes: int) -> Tuple[int, int]:
        """Arena size (elements) and budget (bytes), or a ValueError naming the culprit."""
        others = self.units[1:]
        largest = max(others, key=lambda u: u.compute_numel, default=None)
        largest_param_numel = max((e.numel for u in self.units for e in u.trainable), default=0)
        grad_reserve = largest_param_numel * element_bytes
        root_bytes = self._root.compute_numel * element_bytes
        total_bytes = sum(u.compute_numel for u in self.units) * element_bytes
        if self._param_tier == "device":
            needed = total_bytes + grad_reserve
            why = f"param_tier='device' keeps all {len(self.units)} units there ({format_size(total_bytes)})"
        else:
            largest_bytes = largest.compute_numel * element_bytes if largest else 0
            needed = root_bytes + largest_bytes + grad_reserve
            why = (f"unit {largest.name!r} needs {format_size(largest_bytes)} for its compute copy, "
                   if largest else "") + \
                f"the root unit (on the device from forward to backward) {format_size(root_bytes)}"
        budget = self.config.device_budget
        if budget is None:
            budget = total_bytes + grad_reserve
        if budget < needed:
            raise ValueError(
                f"device_budget: {format_size(budget)} ({budget} bytes) is too small: {why}, plus "
                f"{format_size(grad_reserve)} for the largest gradient on its way out; "
                f"at least {needed} bytes ({format_size(needed)}) are needed")
        return (budget - grad_reserve) // element_bytes, budget

    def _plan_nvme(self, element_bytes: int) -> int:
        """Swap bytes this run will hold."""
        total = 0
        for u in self.units:
            if self._param_tier == "nvme":
                total += u.compute_numel * (_FP32_BYTES if self._merged else element_bytes)
            if self._optimizer_tier == "nvme" and u.trainable:
                if not self._merged:
                    total += u.master_numel * _FP32_BYTES
                total += 2 * u.master_numel * _FP32_BYTES
        return total

    def _home_bytes_on_host(self, element_bytes: int) -> Dict[str, int]:
        grads = sum(u.spec.trainable_numel for u in self.units) * _FP32_BYTES
        compute = master = moments = staging = 0
        for u in self.units:
            if self._param_tier == "host":
                compute += u.compute_numel * (_FP32_BYTES if self._merged else element_bytes)
            if self._optimizer_tier == "host" and u.trainable:
                if not self._merged:
                    master += u.master_numel * _FP32_BYTES
                moments += 2 * u.master_numel * _FP32_BYTES
        if "nvme" in (self._param_tier, self._optimizer_tier):
            staging = self.config.optimizer_pipeline_depth * self._slot_bytes(element_bytes)
        return {"fp32 gradients": grads, "compute copies": compute, "fp32 master weights": master,
                "Adam moments": moments, "optimizer staging buffers": staging}

    def _slot_shape(self) -> Tuple[int, int]:
        """(master elements, compute elements) of one staging slot."""
        master = max((u.master_numel for u in self.units), default=0)
        needs_compute = self._param_tier == "nvme" and not self._merged or \
            (self._param_tier == "device" and self.device.type == "cuda")
        compute = max((u.compute_numel for u in self.units), default=0) if needs_compute else 0
        return master, compute

    def _slot_bytes(self, element_bytes: int) -> int:
        master, compute = self._slot_shape()
        return 3 * master * _FP32_BYTES + compute * element_bytes

    def _check_host_budget(self, element_bytes: int) -> None:
        budget = self.config.host_budget
        if budget is None:
            return
        parts = self._home_bytes_on_host(element_bytes)
        needed = sum(parts.values())
        if needed > budget:
            detail = ", ".join(f"{k} {format_size(v)}" for k, v in parts.items() if v)
            raise ValueError(
                f"host_budget: {format_size(budget)} ({budget} bytes) is too small: this "
                f"configuration holds {detail} on the host, {needed} bytes in all")

    # ------------------------------------------------------------------ allocation
    def _allocate_homes(self) -> None:
        for u in self.units:
            if self._param_tier == "device":
                u.device_offset = self._device.allocate(u.compute_numel)
                assert u.device_offset is not None
                u.compute_state.to(Residency.LOADING)
                u.compute_state.to(Residency.LOADED)
            else:
                dtype = torch.float32 if self._merged else self.compute_dtype
                u.compute_home = self._allocate_home(self._param_tier, u.compute_numel, dtype)
            if u.trainable:
                if not self._merged:
                    u.master_home = self._allocate_home(self._optimizer_tier, u.master_numel, torch.float32)
                u.moments_home = self._allocate_home(self._optimizer_tier, 2 * u.master_numel, torch.float32)
                u.grad = self._host.allocate(u.spec.trainable_numel, torch.float32)
        if self._param_tier != "device":
            # The root unit keeps one slot for the whole run: it is on the device from the
            # start of forward to the end of backward, and a fixed place avoids fragmenting.
            self._root.device_offset = self._device.allocate(self._root.compute_numel)

    def _allocate_home(self, tier: str, numel: int, dtype: torch.dtype) -> Any:
        if tier == "host":
            return self._host.allocate(numel, dtype)
        element_bytes = torch.empty(0, dtype=dtype).element_size()
        return self._nvme.allocate(numel * element_bytes)

    def _allocate_staging(self) -> List[_StagingSlot]:
        if not self._staged_step:
            return []
        master, compute = self._slot_shape()
        return [_StagingSlot(self._host, master, compute, self.compute_dtype)
                for _ in range(self.config.optimizer_pipeline_depth)]

    # ------------------------------------------------------------------ initial placement
    def _replace_meta_parameters(self, specs: List[UnitSpec]) -> set:
        """A meta tensor's storage cannot be swapped for a real one, so each meta parameter
        is replaced by a CPU parameter with no storage yet, in every module that holds it
        (ties stay ties) and in the optimizer's param groups. Returns the new parameters."""
        new_of: Dict[nn.Parameter, nn.Parameter] = {}
        for spec in specs:
            for e in spec.entries:
                if e.param.is_meta:
                    new = nn.Parameter(torch.empty(0, dtype=e.param.dtype), requires_grad=e.param.requires_grad)
                    new_of[e.param] = new
                    e.param = new
        if not new_of:
            return set()
        for module in self.module.modules():
            for name, p in module._parameters.items():
                if p is not None and p in new_of:
                    module._parameters[name] = new_of[p]
        for group in self.optimizer.param_groups:
            group["params"] = [new_of.get(p, p) for p in group["params"]]
        return set(new_of.values())

    def _move_to_homes(self, init_fn: Optional[Callable[[nn.Module], None]]) -> None:
        """Copy each unit's parameters into its home buffers and free the originals. A
        meta-device model is materialized module by module in model order (so initial values
        follow the same RNG sequence as an eager build), each unit written home as soon as
        all its parameters exist: the whole model never has to be in RAM."""
        unit_of: Dict[nn.Parameter, _Unit] = {}
        for u in self.units:
            for e in u.spec.entries:
                unit_of[e.param] = u
        missing = {u.index: len(u.spec.entries) for u in self.units}
        done: set = set()

        def finish(param: nn.Parameter) -> None:
            if param in done:
                return
            done.add(param)
            u = unit_of[param]
            missing[u.index] -= 1
            if missing[u.index] == 0:
                self._write_initial_state(u)

        shape_of = {e.param: e.shape for u in self.units for e in u.spec.entries}
        for module in self.module.modules():
            materialized = False
            for name, p in list(module._parameters.items()):
                if p is not None and p in self._unmaterialized:
                    p.data = torch.empty(shape_of[p], dtype=p.dtype, device="cpu")
                    self._unmaterialized.discard(p)
                    materialized = True
            for name, b in list(module._buffers.items()):
                if b is not None and b.is_meta:
                    module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=self.device)
                    materialized = True
            if materialized:
                with torch.no_grad():
                    if hasattr(module, "reset_parameters"):
                        module.reset_parameters()
                    if init_fn is not None:
                        init_fn(module)
            for name, b in list(module._buffers.items()):
                if b is not None and b.device != self.device:
                    module._buffers[name] = b.to(self.device)
            for p in module._parameters.values():
                if p is not None:
                    finish(p)
        assert all(v == 0 for v in missing.values()), "every unit must have been written home"

    @torch.no_grad()
    def _write_initial_state(self, u: _Unit) -> None:
        master = torch.zeros(u.master_numel, dtype=torch.float32)
        compute = torch.zeros(u.compute_numel, dtype=self.compute_dtype)
        for e in u.spec.entries:
            value = e.param.detach().reshape(-1).to("cpu")
            compute[e.offset:e.offset + e.numel].copy_(value)
            if e.trainable:
                master[e.offset:e.offset + e.numel].copy_(value)
        if self._param_tier == "device":
            self._device.view(u.device_offset, u.compute_numel).copy_(compute)
        else:
            self._store(u.compute_home, compute)  # merged: compute dtype is fp32, the master
        if u.trainable:
            if not self._merged:
                self._store(u.master_home, master)
            self._store(u.moments_home, torch.zeros(2 * u.master_numel, dtype=torch.float32))
        for e in u.spec.entries:
            e.param.data = self._placeholder
        if self._param_tier == "device":
            self._bind(u)

    def _store(self, home: Any, src: torch.Tensor) -> None:
        """Synchronous copy of a whole buffer home (setup and checkpoint load only)."""
        if isinstance(home, torch.Tensor):
            home.copy_(src)
            return
        staging = self._host_bounce(src)
        self._nvme.write(staging, home).wait()

    def _load(self, home: Any, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Synchronous read of a whole buffer from its home into a new host tensor."""
        if isinstance(home, torch.Tensor):
            return home[:numel].clone()
        from offload.io import aligned_empty

        buf = aligned_empty(home.nbytes, dtype=torch.uint8)
        self._nvme.read(buf, home).wait()
        return buf.view(dtype)[:numel].clone()

    def _host_bounce(self, src: torch.Tensor) -> torch.Tensor:
        from offload.io import aligned_empty

        buf = aligned_empty(src.numel() * src.element_size(), dtype=src.dtype)
        buf.copy_(src)
        return buf

    # ------------------------------------------------------------------ residency
    def _bind(self, u: _Unit) -> None:
        view = self._device.view(u.device_offset, u.compute_numel)
        for e in u.spec.entries:
            e.param.data = view[e.offset:e.offset + e.numel].view(e.shape)

    def _unbind(self, u: _Unit) -> None:
        for e in u.spec.entries:
            e.param.data = self._placeholder

    def _fetch(self, u: _Unit) -> None:
        """Bring u's compute copy to the device (no-op when it is there)."""
        self._tick += 1
        u.last_use = self._tick
        if u.compute_state.value in (Residency.LOADED, Residency.IN_USE):
            return
        with self.stats_counters.timed("fetch"):
            if u.device_offset is None:
                u.device_offset = self._allocate_slot(u)
            u.compute_state.to(Residency.LOADING)
            dst = self._device.view(u.device_offset, u.compute_numel)
            if self._param_tier == "nvme" and self.device.type == "cpu":
                # The CPU "device" is RAM: read from the swap file straight into the slot.
                with self.stats_counters.timed("io_wait"):
                    self._nvme.read(dst, u.compute_home).wait()
                self.stats_counters.add_bytes("nvme_to_device", u.compute_home.nbytes)
            elif self._param_tier == "nvme":
                staging = self._slots[0].compute
                with self.stats_counters.timed("io_wait"):
                    self._nvme.read(staging[:u.compute_numel], u.compute_home).wait()
                u.ready_event = self._device.copy_in(dst, staging[:u.compute_numel])
                self.stats_counters.add_bytes("host_to_device", u.compute_numel * dst.element_size())
            else:
                u.ready_event = self._device.copy_in(dst, u.compute_home)
                self.stats_counters.add_bytes("host_to_device", u.compute_numel * dst.element_size())
            u.compute_state.to(Residency.LOADED)
            self._bind(u)

    def _allocate_slot(self, u: _Unit) -> int:
        while True:
            offset = self._device.allocate(u.compute_numel)
            if offset is not None:
                return offset
            victims = [v for v in self.units
                       if v is not u and v is not self._root and v.compute_state == Residency.LOADED]
            if not victims:
                in_use = [v.name for v in self.units if v.compute_state == Residency.IN_USE]
                raise RuntimeError(
                    f"device budget exhausted fetching unit {u.name!r}: units in use "
                    f"{in_use}; raise device_budget")
            self._release(min(victims, key=lambda v: v.last_use))

    def _release(self, u: _Unit) -> None:
        """Drop u's device copy (its home copy is current)."""
        if self._param_tier == "device" or u.compute_state != Residency.LOADED:
            return
        u.compute_state.to(Residency.HOME)
        self._unbind(u)
        if u is not self._root:
            self._device.free(u.device_offset, u.compute_numel)
            u.device_offset = None

    def _wait_ready(self, u: _Unit) -> None:
        if u.ready_event is not None:
            torch.cuda.current_stream(self.device).wait_event(u.ready_event)
            u.ready_event = None

    # ------------------------------------------------------------------ hooks
    def _install_hooks(self) -> None:
        handles = self._hook_handles
        handles.append(self.module.register_forward_pre_hook(self._root_pre_forward))
        handles.append(self.module.register_forward_hook(self._root_post_forward, always_call=True))
        for u in self.units[1:]:
            handles.append(u.spec.module.register_forward_pre_hook(functools.partial(self._unit_pre_forward, u)))
            handles.append(u.spec.module.register_forward_hook(
                functools.partial(self._unit_post_forward, u), always_call=True))
        for u in self.units:
            for k, e in enumerate(u.trainable):
                handles.append(e.param.register_post_accumulate_grad_hook(
                    functools.partial(self._on_grad_ready, u, k)))

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self._forward_depth += 1
        if self._forward_depth > 1:
            return
        if torch.is_grad_enabled():  # [Note: saved parameters]
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack_saved, self._unpack_saved)
            ctx.__enter__()
            self._saved_hooks.append(ctx)
        self._fetch(self._root)
        self._wait_ready(self._root)
        if self._root.compute_state == Residency.LOADED:
            self._root.compute_state.to(Residency.IN_USE)

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._forward_depth -= 1
        if self._forward_depth > 0:
            return
        if self._saved_hooks:
            self._saved_hooks.pop().__exit__(None, None, None)
        if self._root.compute_state == Residency.IN_USE:
            self._root.compute_state.to(Residency.LOADED)

    def _unit_pre_forward(self, u: _Unit, module: nn.Module, args: Any) -> None:
        self._fetch(u)
        self._wait_ready(u)
        if u.compute_state == Residency.LOADED:
            u.compute_state.to(Residency.IN_USE)

    def _unit_post_forward(self, u: _Unit, module: nn.Module, args: Any, output: Any) -> None:
        if u.compute_state == Residency.IN_USE:
            u.compute_state.to(Residency.LOADED)
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, u))

    def _pre_backward(self, u: _Unit, grad: torch.Tensor) -> None:
        """The gradient of u's output has arrived: u's backward is next. Bring it back."""
        self._fetch(u)
        self._wait_ready(u)

    def _pack_saved(self, t: torch.Tensor) -> Any:
        if (t.device == self.device and t.dtype == self.compute_dtype
                and t.untyped_storage().data_ptr() == self._device.arena_storage_ptr):
            offset = t.storage_offset()
            for u in self.units:
                if u.device_offset is not None and u.compute_state.value in (Residency.LOADED, Residency.IN_USE) \
                        and u.device_offset <= offset < u.device_offset + u.compute_numel:
                    return _SavedParamRef(u.index, offset - u.device_offset, t.size(), t.stride())
            raise AssertionError("a saved view of the device arena belongs to no resident unit")
        return t

    def _unpack_saved(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _SavedParamRef):
            u = self.units[saved.unit_index]
            self._fetch(u)
            self._wait_ready(u)
            return self._device.arena.as_strided(saved.size, saved.stride,
                                                 u.device_offset + saved.relative_offset)
        return saved

    @torch.no_grad()
    def _on_grad_ready(self, u: _Unit, k: int, param: nn.Parameter) -> None:
        """A parameter's gradient is final for this backward: move it to the host fp32
        buffer (accumulating across micro-steps) and free the device copy."""
        grad = param.grad
        if grad is None:
            return
        num_bytes = grad.numel() * grad.element_size()
        self._device.hold_transient(num_bytes)
        e = u.trainable[k]
        dst = u.grad[e.offset:e.offset + e.numel]
        src = grad.reshape(-1)
        if src.device != dst.device:
            src = src.to(dst.device)  # slow path on CUDA: synchronous D2H
        if u.has_grad[k]:
            dst.add_(src)
        else:
            dst.copy_(src)
            u.has_grad[k] = True
        param.grad = None
        self._device.drop_transient(num_bytes)
        self.stats_counters.add_bytes("device_to_host", num_bytes)

    # ------------------------------------------------------------------ public API
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError("engine is closed")
        self._check_not_failed("forward")
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss / gradient_accumulation_steps`` (times the loss scale with fp16)."""
        scaled = loss / self._accumulation_steps
        if self._loss_scale != 1.0:
            scaled = scaled * self._loss_scale
        with self.stats_counters.timed("backward"):
            scaled.backward()

    def step(self) -> None:
        """Call after every micro-batch; every gradient_accumulation_steps-th call updates."""
        self._micro_step += 1
        if self._micro_step % self._accumulation_steps:
            return
        start = time.perf_counter()
        self._optimizer_step()
        # The user's optimizer never runs its own step(); tell torch's LR schedulers that a
        # step happened so they do not warn about calling scheduler.step() first.
        self.optimizer._opt_called = True
        end = time.perf_counter()
        self._last_optimizer_seconds = end - start
        if self._last_step_end is not None:
            self._last_step_seconds = end - self._last_step_end
        self._last_step_end = end

    def zero_grad(self) -> None:
        for u in self.units:
            u.has_grad = [False] * len(u.trainable)

    # ------------------------------------------------------------------ optimizer step
    def _grad_scale_and_skip(self) -> Tuple[float, bool]:
        """Factor folded into Adam (unscale x clip) and whether to skip this step."""
        # The norm is taken on every step, clipping or not: it is also how NaN/Inf gradients
        # are found (and reported with the first parameter that has them).
        squares = torch.zeros((), dtype=torch.float64)
        first_nonfinite: Optional[Tuple[_Unit, ParamEntry]] = None
        for u in self.units:
            for k, e in enumerate(u.trainable):
                if u.has_grad[k]:
                    g = u.grad[e.offset:e.offset + e.numel]
                    square = torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2
                    if first_nonfinite is None and not torch.isfinite(square):
                        first_nonfinite = (u, e)
                    squares += square
        inv_scale = 1.0 / self._loss_scale
        total_norm = squares.sqrt().item() * inv_scale
        finite = total_norm == total_norm and total_norm != float("inf")
        if not finite:
            self.stats_counters.count("nonfinite_steps")
            if self.config.dtype != "fp16":  # with fp16 an overflow is routine loss scaling
                where = (f"unit {first_nonfinite[0].name!r} (parameter {first_nonfinite[1].fqn!r})"
                         if first_nonfinite else "the gradient norm")
                self._first_nonfinite_unit = first_nonfinite[0].name if first_nonfinite else None
                action = ("the step is skipped (skip_nonfinite_steps=True)" if self.config.skip_nonfinite_steps
                          else "the step goes ahead and writes NaN/Inf into the parameters; set "
                          "skip_nonfinite_steps=True to skip such steps")
                warnings.warn(f"non-finite gradient (NaN/Inf) at micro-step {self._micro_step}, first "
                              f"in {where}; {action}", RuntimeWarning, stacklevel=4)
            if self.config.dtype == "fp16":
                self._loss_scale = max(self._loss_scale / 2, self.config.min_loss_scale)
                self._good_steps = 0
                return inv_scale, True
            if self.config.skip_nonfinite_steps:
                return inv_scale, True
        elif self.config.dtype == "fp16":
            self._good_steps += 1
            if self._good_steps % self.config.loss_scale_window == 0:
                self._loss_scale *= 2
        self._last_grad_norm = total_norm
        factor = inv_scale
        if self._max_grad_norm is not None and finite:
            clip = self._max_grad_norm / (total_norm + 1e-6)
            if clip < 1.0:
                factor *= clip
        return factor, False

    def _check_not_failed(self, what: str) -> None:
        if self._failure is not None:
            raise EngineFailedError(f"{what}: {self._failure['message']}")

    def _optimizer_step(self) -> None:
        self._check_not_failed("step")
        grad_factor, skip = self._grad_scale_and_skip()
        if skip:
            self.stats_counters.count("skipped_steps")
            self.zero_grad()
            return
        units = [u for u in self.units if any(u.has_grad)]
        try:
            with self.stats_counters.timed("optimizer"):
                if self._staged_step:
                    self._staged_update(units, grad_factor)
                else:
                    for u in units:
                        self._update_unit(u, u.compute_home if self._merged else u.master_home,
                                          u.moments_home, None, grad_factor)
        finally:  # also after a swap failure: the step is over either way
            self.zero_grad()
            # Device copies are stale now, except those the update wrote in place.
            if self._param_tier != "device":
                for u in self.units:
                    if u.compute_state == Residency.LOADED:
                        self._release(u)

    def _update_unit(self, u: _Unit, master: torch.Tensor, moments: torch.Tensor,
                     compute_staging: Optional[torch.Tensor], grad_factor: float) -> None:
        """Adam on one unit whose master and moments are on the host. Writes the new compute
        copy: into the host home, the staging buffer (for NVMe), or the device slot."""
        exp_avg = moments[:u.master_numel]
        exp_avg_sq = moments[u.master_numel:2 * u.master_numel]
        compute_out = None
        if not self._merged and self.compute_dtype != torch.float32:
            if compute_staging is not None:
                compute_out = compute_staging
            elif self._param_tier == "host":
                compute_out = u.compute_home
            elif self.device.type == "cpu":
                compute_out = self._device.view(u.device_offset, u.compute_numel)
        groups = self.optimizer.param_groups
        for k, e in enumerate(u.trainable):
            sl = slice(e.offset, e.offset + e.numel)
            if not u.has_grad[k]:
                if compute_staging is not None:  # keep this parameter's compute copy as it is
                    compute_staging[sl].copy_(master[sl])
                continue
            u.steps[k] += 1
            group = groups[e.group_index]
            beta1, beta2 = group["betas"]
            adam_step_flat(
                master[sl], u.grad[sl], exp_avg[sl], exp_avg_sq[sl], step=u.steps[k],
                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]), adamw=self._adamw, grad_scale=grad_factor,
                copy_out=None if compute_out is None else compute_out[sl])
        if self._param_tier == "device" and (compute_out is None or self.device.type == "cuda"):
            src = compute_out if compute_out is not None else master
            dst = self._device.view(u.device_offset, u.compute_numel)
            n = u.spec.trainable_numel
            event = self._device.copy_in(dst[:n], src[:n])
            if event is not None:
                event.synchronize()

    def _staged_update(self, units: List[_Unit], grad_factor: float) -> None:
        """The pipeline over units: unit i+1's states are read while Adam updates unit i and
        unit i-1 is written back; ``optimizer_pipeline_depth`` slots in a ring.

        [Note: swap I/O failures] A failed write does not stop the step: the unit's updated
        states are copied from its slot into ``self._dirty`` (host RAM, bounded by
        ``_dirty_limit_bytes``) before the slot is reused, the other units are updated, and
        the step then raises. The engine holds a complete, consistent step; forward and
        step refuse (a swap home may be half-written) while ``save_checkpoint`` reads the
        dirty copies. A failed read (or too many dirty bytes) leaves some units updated and
        others not: the engine refuses everything and says to resume from the last
        checkpoint. Either way nothing is left in flight into a slot."""
        depth = len(self._slots)
        reads: Dict[int, List[Any]] = {}
        writer_of: List[Optional[_Unit]] = [None] * depth  # the unit whose writes a slot holds
        write_errors: List[Tuple[_Unit, OSError]] = []

        def master_home(u: _Unit) -> Any:
            return u.compute_home if self._merged else u.master_home

        def prefix(home: Any, num_bytes: int) -> _ExtentView:
            return _ExtentView(home.path, home.offset, num_bytes)

        def on_nvme(home: Any) -> bool:
            return not isinstance(home, torch.Tensor)

        def finish_writes(s: int) -> None:
            slot, u = self._slots[s], writer_of[s]
            try:
                self._wait_all(slot.pending_writes)
            except OSError as error:
                self._keep_dirty(u, slot, on_nvme(master_home(u)), on_nvme(u.moments_home), error)
                write_errors.append((u, error))
            writer_of[s] = None

        def issue_reads(i: int) -> None:
            u, slot = units[i], self._slots[i % depth]
            finish_writes(i % depth)
            handles = []
            reads[i] = handles
            home = master_home(u)
            if on_nvme(home):
                handles.append(self._nvme.read(slot.master[:u.master_numel],
                                               prefix(home, u.master_numel * _FP32_BYTES)))
            if on_nvme(u.moments_home):
                handles.append(self._nvme.read(slot.moments[:2 * u.master_numel], u.moments_home))

        def issue_writes(i: int) -> None:
            u, slot = units[i], self._slots[i % depth]
            home = master_home(u)
            writer_of[i % depth] = u
            writes = slot.pending_writes
            if on_nvme(home):
                writes.append(self._nvme.write(slot.master[:u.master_numel],
                                               prefix(home, u.master_numel * _FP32_BYTES)))
            if on_nvme(u.moments_home):
                writes.append(self._nvme.write(slot.moments[:2 * u.master_numel], u.moments_home))
            if slot.compute is not None and self._param_tier == "nvme":
                n = padded_numel(u.spec.trainable_numel, slot.compute.element_size())
                writes.append(self._nvme.write(
                    slot.compute[:n], prefix(u.compute_home, n * slot.compute.element_size())))

        current = None
        try:
            for i in range(min(depth - 1, len(units))):
                issue_reads(i)
            for i, u in enumerate(units):
                current = u
                self._wait_all(reads.pop(i))
                slot = self._slots[i % depth]
                staging = slot.compute[:u.compute_numel] if slot.compute is not None else None
                master = slot.master if on_nvme(master_home(u)) else master_home(u)
                moments = slot.moments if on_nvme(u.moments_home) else u.moments_home
                self._update_unit(u, master, moments, staging, grad_factor)
                issue_writes(i)
                if i + depth - 1 < len(units):
                    issue_reads(i + depth - 1)
            current = None
            for s in range(depth):
                finish_writes(s)
        except BaseException as error:
            for handles in reads.values():
                self._drain(handles)
            for slot in self._slots:
                self._drain(slot.pending_writes)
            if isinstance(error, OSError):
                where = f"unit {current.name!r}" if current is not None else "a unit"
                self._failure = {"fatal": True, "message": (
                    f"swap I/O failed in the optimizer step at micro-step {self._micro_step} while "
                    f"working on {where} ({error}); some units were updated and others not, so "
                    "the in-memory state mixes two steps: resume from the last checkpoint "
                    "(engine.load_checkpoint(DIR) or a new process)")}
                raise OSError(error.errno, self._failure["message"]) from error
            raise
        if write_errors:
            held = sum(t.numel() * t.element_size() for d in self._dirty.values() for t in d.values())
            first = write_errors[0][1]
            names = ", ".join(repr(u.name) for u, _ in write_errors)
            self._failure = {"fatal": False, "message": (
                f"swap writes failed in the optimizer step at micro-step {self._micro_step} "
                f"(units {names}; first error: {first}). The step completed: the updated states "
                f"of those units are held in host RAM ({format_size(held)}), so "
                "engine.save_checkpoint(DIR) on a filesystem with room saves a consistent "
                "checkpoint of this step; forward and step refuse until a checkpoint is loaded "
                "(engine.load_checkpoint(DIR) or a new process)")}
            raise OSError(first.errno, self._failure["message"]) from first

    def _dirty_limit_bytes(self) -> int:
        """Host bytes the dirty copies may take: what host_budget leaves, else half of the
        RAM the kernel reports available."""
        if self.config.host_budget is not None:
            return max(self.config.host_budget - self._host.used_bytes, 0)
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024 // 2
        except OSError:
            pass
        return 0

    def _keep_dirty(self, u: _Unit, slot: _StagingSlot, master_on_nvme: bool, moments_on_nvme: bool,
                    error: OSError) -> None:
        """[Note: swap I/O failures] Copy u's updated states out of its slot, or raise."""
        held = sum(t.numel() * t.element_size() for d in self._dirty.values() for t in d.values())
        need = (master_on_nvme + 2 * moments_on_nvme) * u.master_numel * _FP32_BYTES
        if held + need > self._dirty_limit_bytes():
            raise OSError(error.errno, f"{error}; holding the states of unit {u.name!r} in host RAM "
                          f"would take {format_size(held + need)}, more than the host can spare")
        dirty = {}
        if master_on_nvme:
            dirty["master"] = slot.master[:u.master_numel].clone()
        if moments_on_nvme:
            dirty["moments"] = slot.moments[:2 * u.master_numel].clone()
        self._dirty[u.index] = dirty

    def _drain(self, handles: List[Any]) -> None:
        """Wait for handles whose errors are already being reported another way."""
        try:
            self._wait_all(handles)
        except OSError:
            pass

    def _wait_all(self, handles: List[Any]) -> None:
        """Waits for every handle (none may stay in flight into a buffer about to be reused),
        then raises the first error."""
        first_error: Optional[OSError] = None
        with self.stats_counters.timed("io_wait"):
            while handles:
                try:
                    handles.pop().wait()
                except OSError as error:
                    first_error = first_error or error
        if first_error is not None:
            raise first_error

    # ------------------------------------------------------------------ reading state
    @torch.no_grad()
    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Full-precision weights keyed as ``model.state_dict()``, on the CPU: the fp32
        master where one exists, else the compute copy."""
        values: Dict[int, Dict[int, torch.Tensor]] = {}
        entry_of: Dict[nn.Parameter, Tuple[_Unit, ParamEntry]] = {}
        for u in self.units:
            for e in u.spec.entries:
                entry_of[e.param] = (u, e)
        result: Dict[str, torch.Tensor] = {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            if isinstance(value, nn.Parameter) and value in entry_of:
                u, e = entry_of[value]
                if u.index not in values:
                    values[u.index] = self._unit_values(u)
                result[name] = values[u.index][e.offset].clone()
            else:
                result[name] = value.detach().to("cpu", copy=True)
        return result

    def save_checkpoint(self, ckpt_dir: str) -> None:
        """Write every unit's state, the optimizer's and the RNGs' into the directory
        ``ckpt_dir``, atomically, one unit at a time. See offload/checkpoint.py."""
        checkpoint.save(self, ckpt_dir)

    def load_checkpoint(self, ckpt_dir: str) -> None:
        """Verify the checkpoint in ``ckpt_dir`` against its manifest and this model, then
        stream its states into their tiers. See offload/checkpoint.py."""
        checkpoint.load(self, ckpt_dir)

    def _unit_values(self, u: _Unit) -> Dict[int, torch.Tensor]:
        if self._param_tier == "device":
            compute = self._device.view(u.device_offset, u.compute_numel).to("cpu")
        else:
            dtype = torch.float32 if self._merged else self.compute_dtype
            compute = self._load(u.compute_home, u.compute_numel, dtype)
        master = compute
        if u.index in self._dirty and "master" in self._dirty[u.index]:
            master = self._dirty[u.index]["master"]  # [Note: swap I/O failures]
        elif u.trainable and not self._merged:
            master = self._load(u.master_home, u.master_numel, torch.float32)
        out = {}
        for e in u.spec.entries:
            source = master if e.trainable else compute
            out[e.offset] = source[e.offset:e.offset + e.numel].view(e.shape)
        return out

    def stats(self) -> Dict[str, Any]:
        """Counters of this engine (bytes, seconds, peaks). ``*_seconds`` are cumulative
        except ``step_seconds`` and ``optimizer_seconds``: those of the last optimizer step
        (step_seconds: wall time between the last two optimizer steps)."""
        s = self.stats_counters
        nvme = self._nvme
        return {
            "device_peak_bytes": self._device.peak_bytes,
            "device_budget_bytes": self._device.budget_bytes,
            "host_peak_bytes": self._host.peak_bytes,
            "nvme_bytes": nvme.used_bytes if nvme else 0,
            "bytes_read_nvme": nvme.bytes_read if nvme else 0,
            "bytes_written_nvme": nvme.bytes_written if nvme else 0,
            "bytes_host_to_device": s.bytes["host_to_device"],
            "bytes_nvme_to_device": s.bytes["nvme_to_device"],
            "bytes_device_to_host": s.bytes["device_to_host"],
            "step_seconds": self._last_step_seconds,
            "optimizer_seconds": self._last_optimizer_seconds,
            "io_wait_seconds": s.seconds["io_wait"],
            "fetch_seconds": s.seconds["fetch"],
            "backward_seconds": s.seconds["backward"],
            "total_optimizer_seconds": s.seconds["optimizer"],
            "skipped_steps": s.counts["skipped_steps"],
            "nonfinite_steps": s.counts["nonfinite_steps"],
            "loss_scale": self._loss_scale,
            "num_units": len(self.units),
        }

    # ------------------------------------------------------------------ lifecycle
    def _close_tiers(self) -> None:
        if self._nvme is not None:
            self._nvme.close()
            self._nvme = None

    def close(self) -> None:
        """Remove hooks and swap files; the engine cannot train afterwards. Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for h in self._hook_handles:
            h.remove()
        self._hook_handles.clear()
        self._close_tiers()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
