"""An offload engine under Hugging Face accelerate: ``prepare``, ``Accelerator.prepare`` for a
wrapped model, and the loop around it.

::

    engine = offload.wrap(model, optimizer, config=dict(param_tier="nvme", optimizer_tier="nvme",
                                                        swap_dir="/mnt/nvme/offload"))
    accelerator = Accelerator()                                  # mixed_precision="no": the engine's dtype=
    model, optimizer, loader, scheduler = prepare(accelerator, engine, model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):                       # only with gradient accumulation
            loss = model(**batch).loss
            engine.backward(loss)                                 # not accelerator.backward(loss)
            engine.step()                                         # not optimizer.step()
            scheduler.step()

[Note: accelerate around the engine] ``Accelerator.prepare`` would do three things to a wrapped
model and its optimizer that the engine does itself, so ``prepare`` checks the accelerator
first (one ValueError naming every setting it cannot honour, before anything is prepared) and
asks accelerate not to place those two:

1. Device placement: ``model.to(accelerator.device)`` would replace the parameters the engine
   placed ([Note: moving a wrapped model] refuses it), and the optimizer's state_dict round
   trip is pointless (the engine holds the state). The data loaders are placed as ever, so
   batches arrive on ``accelerator.device``, which must be ``engine.device``.
2. Mixed precision: accelerate's autocast around the forward would compute in a dtype the
   engine's compute copies do not have; the engine's ``dtype`` ("bf16") is the way.
3. DistributedDataParallel: with several processes (``accelerate launch``, ``torchrun``)
   accelerate would wrap the model in it, whose gradient hooks would reduce gradients the
   engine keeps out of ``p.grad``. The engine averages the ranks' gradients itself ([Note:
   gradient averaging] in zero/partition.py) when it was wrapped with the ranks (wrap uses
   the process group there is, or starts one from torchrun's environment: RANK, WORLD_SIZE,
   MASTER_ADDR), ``OffloadConfig.stage`` saying what each rank keeps. ``prepare`` then has
   the engine's model prepared as for evaluation (no DDP), as OffloadTrainer's accelerator
   does; an engine with other ranks than the accelerator's processes (wrapped before a
   process group that the launcher's environment does not describe) is refused.
   DeepSpeed, FSDP, Megatron-LM and torch.compile (``dynamo_backend``) replace the model or
   its forward, hooks included: refused.

What stays accelerate's: the data loaders (sharding, ``gather_for_metrics``), the scheduler
(``AcceleratedScheduler`` steps it once per optimizer step under ``accumulate``, which is why
``gradient_accumulation_steps`` must be the engine's), ``accumulate``'s sync flags, logging
and saving of anything else. ``accelerator.backward(loss)`` runs ``loss.backward()``, which the
engine refuses ([Note: backward outside engine.backward] in hooks.py): ``engine.backward(loss)``
and ``engine.step()`` take its place, and the prepared optimizer's ``step()``/``zero_grad()``
find no ``p.grad`` and change nothing.
"""
from __future__ import annotations

from typing import Any, List

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, DynamoBackend
except ImportError as error:
    raise ImportError(f"{error}: offload.integrations.accelerate needs offload's hf extra (transformers, "
                      "accelerate): from offload's source tree, python3 -m pip install torch==2.13.0 -e '.[hf]'") \
        from error

import offload

__all__ = ["prepare", "accelerator_problems"]

# Several processes, each one rank of the engine's (accelerate would put DDP around the model)
_PROCESS_RANKS = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def accelerator_problems(accelerator: Accelerator, engine: "offload.Engine") -> List[str]:
    """Every setting of ``accelerator`` that an engine's training cannot honour, as
    'name=value: why' ([] when none; [Note: accelerate around the engine])."""
    problems = []
    kind = accelerator.distributed_type
    if kind not in (DistributedType.NO, *_PROCESS_RANKS):
        problems.append(f"distributed_type={kind.value}: the engine trains in one process or with CPU or CUDA "
                        "ranks (MULTI_CPU, MULTI_GPU), and DeepSpeed, FSDP and Megatron-LM would wrap or replace "
                        "the model; the engine shards across ranks itself (OffloadConfig stage=): launch with "
                        "torchrun or accelerate launch without them")
    elif kind in _PROCESS_RANKS:
        engine_ranks = engine.stats()["world_size"]
        if engine_ranks != accelerator.num_processes:
            problems.append(
                f"distributed_type={kind.value}: {accelerator.num_processes} processes train, and the engine was "
                f"wrapped with {engine_ranks} rank(s), so each process would train its own replica on its own "
                "batches; wrap once the process group exists (build the Accelerator first; under torchrun, "
                "wrap starts it from RANK, WORLD_SIZE and MASTER_ADDR itself), so that the engine averages the "
                "ranks' gradients")
    if accelerator.mixed_precision != "no":
        problems.append(f"mixed_precision={accelerator.mixed_precision!r}: accelerate's autocast would compute in "
                        "a dtype the engine's compute copies do not have; set offload's dtype='bf16' instead")
    backend = accelerator.state.dynamo_plugin.backend
    if backend != DynamoBackend.NO:
        problems.append(f"dynamo_backend={backend.value.lower()!r}: accelerate would compile the whole model, the engine's "
                        "per-unit hooks included; compile each unit's forward yourself before wrap")
    device = accelerator.device
    if device.type != engine.device.type or (device.index or 0) != (engine.device.index or 0):
        problems.append(f"device={str(device)!r}: the data loaders would put batches there, and the engine "
                        f"computes on {str(engine.device)!r}; make them agree (Accelerator(cpu=True), "
                        "CUDA_VISIBLE_DEVICES, or OffloadConfig device=)")
    steps = engine.config.gradient_accumulation_steps
    if accelerator.gradient_accumulation_steps != steps:
        problems.append(f"gradient_accumulation_steps={accelerator.gradient_accumulation_steps}: the engine "
                        f"updates every {steps} engine.step() calls, and accumulate() and the prepared scheduler "
                        "must count the same windows; give Accelerator and OffloadConfig the same value")
    return problems


def prepare(accelerator: Accelerator, engine: "offload.Engine", *objects: Any) -> Any:
    """``accelerator.prepare(*objects)`` for a training through ``engine`` ([Note: accelerate
    around the engine]): the engine's model and optimizer(s) are not placed by accelerate,
    everything else is prepared as ``Accelerator.prepare`` does. Returns what it returns (one
    object, or a tuple in the order given). A ValueError naming every setting of the
    accelerator that cannot work, before anything is prepared."""
    problems = accelerator_problems(accelerator, engine)
    if problems:
        raise ValueError("offload.integrations.accelerate.prepare: the accelerator's settings cannot train "
                         "through an offload engine:\n  " + "\n  ".join(problems))
    engine_owned = [engine.module, *engine.optimizers]
    placement = [not any(obj is owned for owned in engine_owned) for obj in objects]
    if accelerator.distributed_type not in _PROCESS_RANKS:
        return accelerator.prepare(*objects, device_placement=placement)
    # [Note: accelerate around the engine] 3: the engine's model as for evaluation (no DDP);
    # Accelerator.prepare reaches prepare_model through the instance
    prepare_model = accelerator.prepare_model
    own = vars(accelerator).get("prepare_model")  # one set on the instance before, put back after

    def prepare_without_ddp(model: Any, device_placement: Any = None, evaluation_mode: bool = False) -> Any:
        return prepare_model(model, device_placement=device_placement,
                             evaluation_mode=evaluation_mode or model is engine.module)

    accelerator.prepare_model = prepare_without_ddp
    try:
        return accelerator.prepare(*objects, device_placement=placement)
    finally:
        if own is None:
            del accelerator.prepare_model
        else:
            accelerator.prepare_model = own
