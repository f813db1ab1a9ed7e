"""OffloadTrainer: a ``transformers.Trainer`` whose model trains through an offload Engine.

::

    trainer = OffloadTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                             offload_config=dict(param_tier="nvme", optimizer_tier="nvme",
                                                 swap_dir="/mnt/nvme/offload"),
                             weights="path/to/model")   # optional: pretrained weights into the tiers
    trainer.train()
    trainer.save_model("out/")                           # Hugging Face weights, streamed from the tiers
    trainer.close()                                      # the engine's swap files go

[Note: the Trainer's loop around the engine] The Trainer keeps its loop (data, sampler,
accumulation windows, logging, evaluation, checkpoints, callbacks); the engine does what
the Trainer would do to the model and the optimizer:

1. The constructor checks every setting the engine cannot honour first (one ValueError
   naming them all, before the Trainer creates anything), then builds the Trainer, the
   Trainer's own optimizer (``create_optimizer``: the decay / no-decay groups and the
   hyperparameters of the TrainingArguments; AdamW, or another of SUPPORTED_OPTIMS, or the
   user's ``optimizers=(opt, sched)``, probed first) and wraps model and optimizer into
   ``self.engine``.
   ``gradient_accumulation_steps``, ``max_grad_norm`` and ``bf16`` become the engine's
   config; the engine's device is the Trainer's ``args.device``.
2. Accelerate neither moves the model nor wraps its forward in autocast (the engine places
   every state and computes in its own dtype); the Trainer's ``_move_model_to_device`` does
   nothing (a meta model cannot move). Accelerate's ``device_placement`` also decides how
   it prepares a data loader, so ``_get_dataloader`` turns it on for that, as in a plain
   Trainer: with it off, an IterableDataset gets a DataLoaderShard instead of a
   DataLoaderDispatcher, ``gather_for_metrics`` is not told the size of the last batch, and
   ``evaluation_loop`` weights that batch's loss as a full batch's.
3. ``training_step`` runs the model's forward (through the engine's hooks) and
   ``compute_loss`` as the Trainer does, normalizes the loss as ``Trainer.training_step``
   does (by ``num_items_in_batch`` across the accumulation window, or by the window's
   length), and hands it to ``engine.backward`` times ``gradient_accumulation_steps``
   (which the engine divides by again), then calls ``engine.step()``: every accumulation
   window's last call clips (the engine's global norm) and updates. A window cut short at
   the end of an epoch is closed with ``engine.step()`` calls without a backward.
4. The Trainer's ``optimizer.step()`` and ``zero_grad()`` then do nothing
   (``EngineAdam``, whose ``state_dict()`` reads the moments from the engine); its gradient
   clipping reports the norm the engine measured (gradients never reach ``p.grad``); its LR
   scheduler sets the param groups the engine's Adam reads.
5. Checkpoints (``save_steps``): the Trainer writes ``checkpoint-N/`` as usual (Hugging Face
   weights from ``engine.save_pretrained``, RNG states, trainer state, scheduler) with the
   engine's checkpoint in ``checkpoint-N/offload/``, ``optimizer.pt`` beside it where small
   ([Note: optimizer.pt beside the engine's checkpoint]), and COMPLETE_MARKER last ([Note: complete Trainer checkpoints]); ``resume_from_checkpoint``
   loads it once the scheduler exists (its param groups, learning rates included, come from
   the checkpoint).

[Note: OffloadTrainer with several ranks] Under ``torchrun --nproc-per-node N`` (or a gloo /
NCCL process group initialized before the Trainer) every rank builds the same OffloadTrainer
and wraps the same model; the engine shards by ``offload_config``'s ``stage`` and averages
the ranks' gradients itself ([Note: gradient averaging] in zero/partition.py). What the
Trainer and accelerate would do with ranks, and what happens instead:

1. accelerate's ``prepare_model`` would wrap the model in DistributedDataParallel, whose
   gradient hooks would reduce a second time (and see no gradients: the engine keeps them
   out of ``p.grad``). OffloadTrainer's accelerator prepares it as for evaluation: no DDP;
   ``trainer.model_wrapped`` is the model.
2. Kept as the Trainer has them: the data loaders (accelerate gives rank r the r-th of each
   run of N batches of ``per_device_*_batch_size``, padding the last), ``num_items_in_batch``
   summed over the ranks and each rank's loss times N (the engine's average then gives the
   gradient of the whole batch), the logged loss (the mean over ranks), and evaluation
   (each rank its batches, ``gather_for_metrics``). ``grad_norm`` is the engine's global
   norm, the same on every rank.
3. Checkpoints: every rank calls ``engine.save_checkpoint`` (a collective: [Note: sharded
   checkpoints]) and writes its ``rng_state_R.pth``; rank 0 writes the rest. Barriers put
   the marker of [Note: complete Trainer checkpoints] around them: rank 0 takes it out
   before any rank writes, and writes it after every rank has written, so it lists every
   rank's files. Every rank loads the engine checkpoint on resume.
4. ``save_model``: every rank reads the weights (``engine.save_pretrained``, or peft's
   ``save_pretrained`` with ``is_main_process``: at stage >= 1 reading gathers shards, so
   every rank calls the collectives in one order), rank 0 writes them ([Note:
   save_pretrained with several ranks] in engine.py).
5. Refused: ``n_gpu > 1`` (nn.DataParallel: one process, several devices) and
   ``save_on_each_node`` (an engine checkpoint is one directory on a file system the ranks
   share). ``optimizer.state_dict()`` raises (each rank holds a shard of the moments). After
   ``train()`` the model holds its values at stage 0, where each rank reads its own whole
   replica; at stage >= 1 the parameters keep placeholders (``engine.restore_model()``
   refuses: reading shards is a collective every rank must enter at once, and a forward of
   rank 0 alone, a ``generate()``, would hang at the next restore's end; a warning says so):
   read the weights through ``save_model`` or ``engine.state_dict()`` on every rank.

[Note: complete Trainer checkpoints] A ``checkpoint-N`` directory is a checkpoint only once
it holds COMPLETE_MARKER. The Trainer writes its files into ``checkpoint-N`` under their
final names, so a save killed part-way leaves a directory that looks like a checkpoint;
the marker is what says the save finished. ``_save_checkpoint``:

1. takes the marker out of a ``checkpoint-N`` that exists already (the same step saved
   again after a resume) and fsyncs the directory: it is incomplete until step 3;
2. runs the Trainer's save (weights, the engine's checkpoint, which is atomic itself,
   scheduler, RNG states, trainer state) with its ``save_total_limit`` rotation and its
   push to the Hub (``push_to_hub``) held back;
3. fsyncs every file, then writes the marker under a temporary name, fsyncs it, renames
   it into place and fsyncs the directory and its parent. The marker lists the files, so
   a directory that lost some afterwards (the Trainer's own removal of checkpoints after
   load_best_model_at_end, cut short) is not complete either. Then the Trainer's push of
   the checkpoint folder, whose copy on the Hub is thus one OffloadTrainer resumes from;
4. rotates over complete checkpoints only: they alone count toward ``save_total_limit``,
   so a save killed before step 3 never deleted an older checkpoint and an incomplete
   directory never pushes a complete one out. With ``save_total_limit``, incomplete
   directories of earlier steps are removed; a removed checkpoint loses its marker first,
   so a removal cut short leaves an incomplete directory.

``train`` checks before the Trainer changes anything (``resumable_problems``: the marker,
every file it lists, the engine's manifest, and not ``save_only_model``):
``resume_from_checkpoint=True`` takes the newest ``checkpoint-N`` that passes and warns
naming the newer ones it skipped and why; a path that does not pass is a ValueError naming
it and what it lacks.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

try:
    from transformers import PreTrainedModel, Trainer, TrainingArguments
    from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints
except ImportError as error:
    raise ImportError(f"{error}: OffloadTrainer needs offload's hf extra (transformers, accelerate): from "
                      "offload's source tree, python3 -m pip install torch==2.13.0 -e '.[hf]'") from error

import offload
from offload.checkpoint import MANIFEST
from offload.checkpoint.directory import remove_checkpoint
from offload.config import OffloadConfig
from offload.optim.failure import FailureState
from offload.integrations.trainer_checkpoints import ADAM_CLASSES, adam_state_dict, write_optimizer_pt
from offload.optim.whole import probe_rule

__all__ = ["OffloadTrainer", "EngineAdam", "ENGINE_CHECKPOINT_DIR", "COMPLETE_MARKER", "checkpoint_missing",
           "resumable_problems"]

ENGINE_CHECKPOINT_DIR = "offload"
"""Where the engine's checkpoint goes inside a Trainer's ``checkpoint-N`` directory."""

COMPLETE_MARKER = "offload_trainer_complete.json"
"""The file a save of ``checkpoint-N`` writes last ([Note: complete Trainer checkpoints])."""

_MARKER_FORMAT = "offload-trainer-checkpoint"
_MARKER_VERSION = 1
_MARKER_PARTIAL = f".{COMPLETE_MARKER}.partial"
_RNG_STATE_NAME = "rng_state.pth"  # the Trainer's name for one process's RNG states
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")  # as trainer_utils.get_last_checkpoint

SUPPORTED_OPTIMS = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop", "adafactor")
"""TrainingArguments.optim values the engine runs: torch's AdamW (the engine's CPU Adam
replaces its kernel, fused or not), torch's SGD, Adagrad and RMSprop (elementwise: [Note:
elementwise optimizers]) and transformers' Adafactor (on whole parameters: [Note:
whole-parameter optimizers]). The others build optimizers of other libraries (bitsandbytes,
torchao, galore, ...) whose state is not float32 tensors, or are not probed here."""

# OffloadConfig fields that TrainingArguments decides, with the TrainingArguments name.
_FIELDS_FROM_ARGS = {"gradient_accumulation_steps": "gradient_accumulation_steps",
                     "max_grad_norm": "max_grad_norm", "dtype": "bf16"}


class EngineAdam(torch.optim.Optimizer):
    """The optimizer the Trainer holds: the optimizer given to ``offload.wrap`` (AdamW, or
    another the engine runs), seen through its param groups and state (so the Trainer's LR
    scheduler sets the learning rates the engine reads), with a ``step()`` and
    ``zero_grad()`` that do nothing, since the engine has updated in ``training_step``
    ([Note: the Trainer's loop around the engine]). For Adam/AdamW ``state_dict()`` gathers
    the moments from the engine's tiers ([Note: the optimizer's state as torch lays it
    out]); for another optimizer, or with several ranks, it is a ValueError naming
    engine.save_checkpoint. Like accelerate's AcceleratedOptimizer it does not call
    ``Optimizer.__init__``."""

    def __init__(self, adam: torch.optim.Optimizer, engine: "offload.Engine") -> None:
        self.adam = adam
        self.engine = engine

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.adam.param_groups

    @property
    def defaults(self) -> Dict[str, Any]:
        return self.adam.defaults

    @property
    def state(self) -> Dict[Any, Any]:
        return self.adam.state

    def step(self, closure: Optional[Callable[[], float]] = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> Dict[str, Any]:
        """``torch.optim.AdamW.state_dict()``'s layout, gathered from the engine's tiers
        (trainer_checkpoints.adam_state_dict); a ValueError naming
        ``trainer.engine.save_checkpoint(DIR)`` where that layout cannot be had ([Note:
        optimizer.pt beside the engine's checkpoint])."""
        return adam_state_dict(self.adam, self.engine)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """A ValueError, as ``state_dict()``'s refusals: the state is loaded into the tiers."""
        raise ValueError("optimizer.load_state_dict(): the optimizer's state lives in the engine's tiers: load it "
                         "with trainer.engine.load_checkpoint(DIR) (resume_from_checkpoint does)")

    def __repr__(self) -> str:
        return f"EngineAdam({self.adam!r})"


def unsupported_settings(args: TrainingArguments, config: OffloadConfig, *, model_init: Any, optimizer: Any,
                         optimizer_cls_and_kwargs: Any) -> List[str]:
    """Every setting OffloadTrainer cannot honour, as 'name=value: why' ([] when none)."""
    problems = []
    optim = getattr(args.optim, "value", args.optim)
    if optim not in SUPPORTED_OPTIMS:
        problems.append(f"optim={optim!r}: the engine runs torch's optimizers and transformers' Adafactor on "
                        f"the CPU; use one of {', '.join(map(repr, SUPPORTED_OPTIMS))}")
    if args.optim_args:
        problems.append(f"optim_args={args.optim_args!r}: the engine's AdamW takes no extra arguments")
    if optimizer_cls_and_kwargs is not None and not (
            isinstance(optimizer_cls_and_kwargs[0], type) and issubclass(optimizer_cls_and_kwargs[0], ADAM_CLASSES)):
        problems.append(f"optimizer_cls_and_kwargs={optimizer_cls_and_kwargs[0]!r}: the engine runs "
                        "torch.optim.Adam/AdamW or offload.CPUAdam only")
    if optimizer is not None and not isinstance(optimizer, ADAM_CLASSES):
        try:  # any other optimizer the engine can run: the probe steps copies, never this one
            probe_rule(optimizer)
        except ValueError as e:
            problems.append(f"optimizers=({type(optimizer).__name__}, ...): {e}")
    named = [
        ("deepspeed", args.deepspeed, "the engine does what DeepSpeed would"),
        ("fsdp", args.fsdp, "the engine shards across ranks itself (stage=) and is not FSDP"),
        ("parallelism_config", args.parallelism_config, "one process trains one engine"),
        ("torch_compile", args.torch_compile,
         "accelerate would compile the whole model, the engine's per-unit hooks (fetches, waits, I/O) "
         "included; compile each unit's forward yourself before OffloadTrainer instead, e.g. for layer in "
         "model.model.layers: layer.forward = torch.compile(layer.forward)"),
        ("fp16", args.fp16, "the engine would scale the loss and skip overflowed steps itself, but the "
                            "Trainer holds the LR schedule only for accelerate's own GradScaler skips; use bf16=True"),
        ("fp16_full_eval", args.fp16_full_eval, "the engine evaluates in its own dtype"),
        ("bf16_full_eval", args.bf16_full_eval, "the engine evaluates in its own dtype"),
        ("use_liger_kernel", args.use_liger_kernel, "it replaces modules after the engine cut the model into units"),
        ("auto_find_batch_size", args.auto_find_batch_size,
         "the Trainer retries a step that ran out of memory with half the batch, but one that failed after "
         "the engine's updates began leaves the engine refusing to train until a checkpoint is loaded; "
         "set per_device_train_batch_size"),
        ("model_init", model_init,
         "Trainer.train builds a new model per trial from it, and OffloadTrainer wraps one model, at "
         "construction, into its engine (a trial's model would train outside it); build an OffloadTrainer "
         "with model= per trial"),
    ]
    problems += [f"{name}={value!r}: {why}" for name, value, why in named if value]
    if args.world_size > 1 and args.save_on_each_node:
        problems.append("save_on_each_node=True: with several ranks an engine checkpoint is one directory into "
                        "which every rank writes its shard and rank 0 the manifest ([Note: sharded checkpoints]), "
                        "so output_dir must be on a file system every node shares, where one save serves all")
    if args.n_gpu > 1:
        problems.append(f"n_gpu={args.n_gpu}: the Trainer would wrap the model in nn.DataParallel (one process, "
                        "several devices), and an engine computes on one device; launch one process per device "
                        "(torchrun --nproc-per-node N), each rank trains through its engine ([Note: OffloadTrainer "
                        "with several ranks])")
    defaults = OffloadConfig()
    wanted = trainer_owned_fields(args)
    for field, arg_name in _FIELDS_FROM_ARGS.items():
        value = getattr(config, field)
        if value != getattr(defaults, field) and value != wanted[field]:
            problems.append(f"offload_config {field}={value!r}: TrainingArguments decide it "
                            f"({arg_name}={getattr(args, arg_name)!r}); leave it out of offload_config")
    device = torch.device(config.device) if config.device != "auto" else args.device
    if device.type != args.device.type or device.index not in (None, args.device.index or 0):
        problems.append(f"offload_config device={config.device!r}: the Trainer computes on "
                        f"args.device={str(args.device)!r}; leave device out or make them agree")
    return problems


def trainer_owned_fields(args: TrainingArguments) -> Dict[str, Any]:
    """The OffloadConfig fields that TrainingArguments set."""
    return {"gradient_accumulation_steps": args.gradient_accumulation_steps,
            "max_grad_norm": args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None,
            "dtype": "bf16" if args.bf16 else "fp32"}


def checkpoint_missing(checkpoint_dir: str) -> List[str]:
    """What ``checkpoint_dir`` lacks of a finished OffloadTrainer save, one phrase each; []
    when it is complete ([Note: complete Trainer checkpoints])."""
    return _read_marker(checkpoint_dir)[1]


def resumable_problems(checkpoint_dir: str) -> List[str]:
    """Why OffloadTrainer cannot resume from ``checkpoint_dir``, one phrase each; [] when it can."""
    marker, missing = _read_marker(checkpoint_dir)
    if missing:
        return missing
    if not marker["engine_checkpoint"]:
        return [f"no engine checkpoint ({ENGINE_CHECKPOINT_DIR}/): it was saved with save_only_model=True, and "
                "OffloadTrainer resumes from checkpoints saved without it"]
    return []


def _read_marker(checkpoint_dir: str) -> Tuple[Optional[Dict[str, Any]], List[str]]:
    """The marker of ``checkpoint_dir`` and what the directory lacks of the save it records."""
    if not os.path.isdir(checkpoint_dir):
        return None, ["the directory does not exist"]
    engine_manifest = f"{ENGINE_CHECKPOINT_DIR}/{MANIFEST}"
    try:
        with open(os.path.join(checkpoint_dir, COMPLETE_MARKER), encoding="utf-8") as file:
            marker = json.load(file)
    except FileNotFoundError:
        expected = (TRAINER_STATE_NAME, SCHEDULER_NAME, _RNG_STATE_NAME, engine_manifest)
        return None, [f"no {COMPLETE_MARKER}, the file a save writes last: the save was interrupted (or "
                      "OffloadTrainer did not write it)"] + \
            [f"no {name}" for name in expected if not os.path.exists(os.path.join(checkpoint_dir, name))]
    except (OSError, ValueError) as error:
        return None, [f"{COMPLETE_MARKER} is unreadable ({error})"]
    if not (isinstance(marker, dict) and marker.get("format") == _MARKER_FORMAT
            and isinstance(marker.get("files"), list) and isinstance(marker.get("engine_checkpoint"), bool)
            and all(isinstance(name, str) for name in marker["files"])):
        return None, [f"{COMPLETE_MARKER} is not an OffloadTrainer marker"]
    missing = [f"no {name}" for name in marker["files"] if not os.path.isfile(os.path.join(checkpoint_dir, name))]
    if marker["engine_checkpoint"] and not os.path.isfile(os.path.join(checkpoint_dir, engine_manifest)):
        missing.append(f"no {engine_manifest}")
    return marker, missing


def _fsync(path: str) -> None:
    """fsync a file or a directory; an OSError names it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        raise OSError(error.errno, f"could not fsync ({error.strerror})", path) from error
    finally:
        os.close(fd)


def _unmark(checkpoint_dir: str) -> None:
    """[Note: complete Trainer checkpoints] step 1; nothing when there is no marker."""
    try:
        os.unlink(os.path.join(checkpoint_dir, COMPLETE_MARKER))
    except FileNotFoundError:
        return
    _fsync(checkpoint_dir)


def _mark_complete(checkpoint_dir: str, engine_checkpoint: bool) -> None:
    """[Note: complete Trainer checkpoints] step 3. The engine's directory is durable already
    (its save fsyncs it) and verified by its own manifest; its leftovers beside it
    (``.offload.partial-*``) belong to no checkpoint."""
    files: List[str] = []
    for root, dirs, names in os.walk(checkpoint_dir):
        if root == checkpoint_dir:
            dirs[:] = [d for d in dirs if d != ENGINE_CHECKPOINT_DIR and not d.startswith(f".{ENGINE_CHECKPOINT_DIR}.")]
            names = [n for n in names if n not in (COMPLETE_MARKER, _MARKER_PARTIAL)]
        for name in names:
            path = os.path.join(root, name)
            _fsync(path)
            files.append(os.path.relpath(path, checkpoint_dir))
        _fsync(root)
    marker = {"format": _MARKER_FORMAT, "version": _MARKER_VERSION, "engine_checkpoint": engine_checkpoint,
              "files": sorted(files)}
    partial = os.path.join(checkpoint_dir, _MARKER_PARTIAL)
    with open(partial, "w", encoding="utf-8") as file:
        json.dump(marker, file, indent=1, sort_keys=True)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, os.path.join(checkpoint_dir, COMPLETE_MARKER))
    _fsync(checkpoint_dir)
    _fsync(os.path.dirname(os.path.abspath(checkpoint_dir)))  # the entry checkpoint-N itself


def _remove_checkpoint(checkpoint_dir: str) -> None:
    """Marker first: a removal cut short leaves an incomplete directory, never one that
    claims files it lost."""
    remove_checkpoint(checkpoint_dir, first=COMPLETE_MARKER)


def _checkpoint_step(path: str) -> Optional[int]:
    """N of a ``checkpoint-N`` directory; None for anything else."""
    match = _CHECKPOINT_NAME.match(os.path.basename(path))
    return int(match.group(1)) if match and os.path.isdir(path) else None


def _require_resumable(checkpoint_dir: str) -> None:
    problems = resumable_problems(checkpoint_dir)
    if problems:
        # Trainer's own words first: scripts and tools match them
        raise ValueError(f"Can't find a valid checkpoint at {checkpoint_dir}: it is not a checkpoint OffloadTrainer "
                         f"can resume from: {'; '.join(problems)}. Resume from another one "
                         "(resume_from_checkpoint=True takes the newest complete one in output_dir)")


class OffloadTrainer(Trainer):
    """A ``transformers.Trainer`` that trains through ``offload.wrap`` ([Note: the Trainer's
    loop around the engine]). Takes the Trainer's arguments, plus ``offload_config`` (an
    OffloadConfig, a dict or a JSON path: where the states live, without the fields that
    TrainingArguments decide) and ``weights`` (a Hugging Face model directory or a
    .safetensors file whose tensors become the parameters' values; with a model built on
    the meta device). ``self.engine`` is the Engine; ``close()`` removes its swap files.

    The engine stays open after ``train()`` (evaluate, predict and save_model run through it).
    After ``train()``, ``evaluate()`` and ``predict()`` the model reads as a plain model
    ([Note: the model after train()]); ``close()`` gives it its values for good, and it can
    then be handed to another Trainer ([Note: the model after close])."""

    def __init__(
        self,
        model: "PreTrainedModel | nn.Module | None" = None,
        args: Optional[TrainingArguments] = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Optional[Callable[..., PreTrainedModel]] = None,
        compute_loss_func: Optional[Callable] = None,
        compute_metrics: Optional[Callable] = None,
        callbacks: Optional[list] = None,
        optimizers: Tuple[Optional[torch.optim.Optimizer], Any] = (None, None),
        optimizer_cls_and_kwargs: Optional[Tuple[type, Dict[str, Any]]] = None,
        preprocess_logits_for_metrics: Optional[Callable] = None,
        *,
        offload_config: "OffloadConfig | dict | str | None" = None,
        weights: "str | os.PathLike | None" = None,
    ) -> None:
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")  # as Trainer does
        config = OffloadConfig.from_any(offload_config)
        if model is not None:
            FailureState.check_not_wrapped(model)  # before the Trainer touches it: says what to do
        problems = unsupported_settings(args, config, model_init=model_init, optimizer=optimizers[0],
                                        optimizer_cls_and_kwargs=optimizer_cls_and_kwargs)
        if problems:
            raise ValueError("OffloadTrainer cannot honour these settings:\n  " + "\n  ".join(problems))
        # (a distributed run's CPU device is "cpu:0"; the engine's is "cpu")
        device = "cpu" if args.device.type == "cpu" else str(args.device)
        config = dataclasses.replace(config, device=device, **trainer_owned_fields(args))
        if optimizer_cls_and_kwargs is None and optimizers[0] is None:
            # The Trainer's own AdamW and hyperparameters; "fused" names a kernel the engine replaces.
            adam_cls, adam_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
            optimizer_cls_and_kwargs = (adam_cls, {k: v for k, v in adam_kwargs.items() if k != "fused"})
        super().__init__(
            model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=processing_class, compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        adam = self.create_optimizer()
        # A meta model without weights= is initialized by wrap: from the RNG as the Trainer
        # seeded it, and without moving the RNG that the training run then draws from.
        with torch.random.fork_rng(devices=[]):
            self.engine = offload.wrap(self.model, adam, config=config, weights=weights)
        self.optimizer = EngineAdam(adam, self.engine)  # accelerate's prepare wraps it in train()
        self._adam = adam
        self._grad_norm: Optional[float] = None  # the last optimizer step's, see _measured_grad_norm
        self._warned_grad_norm = False
        self._closed = False
        self._training = False  # inside train(): evaluate() leaves the model to the run
        self._warned_restore = False
        # the caller's TrainingArguments while _save_checkpoint holds a copy in self.args
        self._args_outside_save: Optional[TrainingArguments] = None

    def close(self) -> None:
        """Close the engine (its swap files are removed); the trainer cannot train, evaluate
        or save afterwards. Idempotent."""
        self._closed = True
        self.engine.close()

    def _check_open(self, what: str) -> None:
        # The model's forward runs through the engine's hooks, not through engine(...), which
        # would refuse a closed engine itself: without hooks the parameters are placeholders.
        if self._closed:
            raise RuntimeError(f"{what}: the OffloadTrainer is closed (its engine let go of the model's states)")

    # ------------------------------------------------------------------ setup
    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's, with an accelerator that prepares the model without DistributedDataParallel
        ([Note: OffloadTrainer with several ranks] 1)."""
        super().create_accelerator_and_postprocess()
        # evaluation_mode=True is prepare_model without the DDP (and torch.compile, refused
        # anyway) wrapping; autocast and device placement are off already (step 2).
        prepare = self.accelerator.prepare_model
        self.accelerator.prepare_model = lambda model, device_placement=None, evaluation_mode=False: prepare(
            model, device_placement=device_placement, evaluation_mode=True)

    def _build_accelerator_args(self, **kwargs: Any) -> Dict[str, Any]:
        # [Note: the Trainer's loop around the engine] step 2
        accelerator_args = super()._build_accelerator_args(**kwargs)
        accelerator_args.update(device_placement=False, mixed_precision="no")
        return accelerator_args

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """Nothing to do: the engine puts every state on its tier and brings units to the device."""

    def _get_dataloader(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's (the train, eval and test loaders), prepared by accelerate as a plain
        Trainer's are ([Note: the Trainer's loop around the engine] step 2)."""
        # Off for the model and the optimizer (accelerate would move them, and round-trip the
        # optimizer's state through state_dict and load_state_dict, which EngineAdam refuses);
        # on while the loader is prepared.
        accelerator = self.accelerator
        accelerator.device_placement = True
        try:
            return super()._get_dataloader(*args, **kwargs)
        finally:
            accelerator.device_placement = False

    # ------------------------------------------------------------------ training
    def training_step(self, model: nn.Module, inputs: Dict[str, Any],
                      num_items_in_batch: "torch.Tensor | int | None" = None) -> torch.Tensor:
        """[Note: the Trainer's loop around the engine] step 3."""
        self._check_open("training_step")
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        declared = getattr(self, "loss_is_scaled_for_ga", None)  # a Trainer field since transformers 5.2x
        if declared is not None:
            loss_is_scaled_for_ga = declared
        else:  # as Trainer.training_step decides it (transformers 5.17 to 5.24 alike)
            loss_is_scaled_for_ga = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        if not loss_is_scaled_for_ga:
            loss = loss / self.current_gradient_accumulation_steps
        accumulation = self.args.gradient_accumulation_steps
        engine = self.engine
        engine.backward(loss * accumulation)  # the engine divides by accumulation again
        engine.step()
        if self.accelerator.sync_gradients:  # the last micro-batch of this optimizer step
            while engine.stats()["micro_steps"] % accumulation:  # a window cut short by the epoch's end
                engine.step()
            self._grad_norm = self._measured_grad_norm()
        return loss.detach()

    def prediction_step(self, model: nn.Module, inputs: Dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: Optional[List[str]] = None) -> Tuple[Any, Any, Any]:
        """Trainer's, in the engine's eval mode (evaluation_loop sets it on the model)."""
        self._check_open("evaluation")
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _measured_grad_norm(self) -> Optional[float]:
        """The global gradient norm before clipping of the update just made; None when the
        engine deferred that update's bookkeeping to the next pass (overlap_step_with_forward
        without clipping): it is not known yet."""
        if not self.engine.stats()["grad_norm_pending"]:
            return self.engine.stats()["grad_norm"]
        if not self._warned_grad_norm:
            self._warned_grad_norm = True
            warnings.warn("grad_norm is not logged: the engine finishes each optimizer step's bookkeeping "
                          "(the gradient norm among it) during the next forward (overlap_step_with_forward); "
                          "set offload_config overlap_step_with_forward=False, or max_grad_norm, to log it",
                          RuntimeWarning, stacklevel=2)
        return None

    def _clip_grad_norm(self, model: nn.Module) -> Optional[float]:
        """The engine clipped in training_step; this is the norm it measured."""
        return self._grad_norm

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Optional[float]:
        return self._grad_norm

    # ------------------------------------------------------------------ saving and loading
    def train(self, resume_from_checkpoint: "str | os.PathLike | bool | None" = None,
              trial: "Any | None" = None, ignore_keys_for_eval: Optional[List[str]] = None) -> Any:
        """Trainer.train, resuming from complete checkpoints only ([Note: complete Trainer
        checkpoints]): ``resume_from_checkpoint=True`` takes the newest complete one in
        ``output_dir``; a path to one that is not complete is a ValueError, before anything
        changes. Afterwards the model holds its values ([Note: the model after train()])."""
        self._check_open("train")
        if isinstance(resume_from_checkpoint, bool):
            resume_from_checkpoint = self._last_resumable_checkpoint() if resume_from_checkpoint else None
        elif resume_from_checkpoint is not None:
            resume_from_checkpoint = os.fspath(resume_from_checkpoint)
            _require_resumable(resume_from_checkpoint)
        self._training = True
        try:
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                   ignore_keys_for_eval=ignore_keys_for_eval)
        finally:
            self._training = False
        self._restore_model()
        return output

    def evaluate(self, *args: Any, **kwargs: Any) -> Dict[str, float]:
        """Trainer's; afterwards the model holds its values ([Note: the model after train()])."""
        metrics = super().evaluate(*args, **kwargs)
        if not self._training:
            self._restore_model()
        return metrics

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's; afterwards the model holds its values ([Note: the model after train()])."""
        output = super().predict(*args, **kwargs)
        if not self._training:
            self._restore_model()
        return output

    def _restore_model(self) -> None:
        """[Note: the model after train()] When ``train()``, or ``evaluate()`` / ``predict()``
        called outside it, returns, the model's parameters hold their current values in their
        dtypes from before wrap (``engine.restore_model()``, [Note: restored parameters]):
        ``trainer.model.<param>`` reads what ``engine.state_dict()`` holds, also after
        load_best_model_at_end (whose checkpoint load let go of every unit, leaving NaN
        placeholders) and with bf16 (whose compute copies are bfloat16), until the model's
        next forward. Where the values would not fit in host memory the parameters keep what
        the engine gave them (placeholders, compute copies) and a warning (once) says how to
        read the values."""
        try:
            self.engine.restore_model()
        except ValueError as error:
            if not self._warned_restore:
                self._warned_restore = True
                warnings.warn(f"trainer.model's parameters do not hold their values between passes (NaN "
                              f"placeholders, [Note: released parameters]): {error}", RuntimeWarning, stacklevel=3)

    def _last_resumable_checkpoint(self) -> str:
        """The newest ``checkpoint-N`` in output_dir that OffloadTrainer can resume from,
        warning with the newer ones it skips."""
        output_dir = self.args.output_dir
        try:
            entries = os.listdir(output_dir)
        except FileNotFoundError:
            raise ValueError(f"No valid checkpoint found in output directory ({output_dir}): it does not "
                             "exist") from None
        checkpoints = [os.path.join(output_dir, entry) for entry in entries]
        checkpoints = sorted((c for c in checkpoints if _checkpoint_step(c) is not None), key=_checkpoint_step,
                             reverse=True)
        skipped = []
        for checkpoint in checkpoints:
            problems = resumable_problems(checkpoint)
            if not problems:
                if skipped:
                    warnings.warn(f"resume_from_checkpoint=True: resuming from {checkpoint!r}, the newest complete "
                                  f"checkpoint; skipped the newer {'; '.join(skipped)}. A skipped directory is "
                                  "left as it is; the run's save of that step replaces it",
                                  UserWarning, stacklevel=3)
                return checkpoint
            skipped.append(f"{checkpoint!r} ({', '.join(problems)})")
        raise ValueError(f"No valid checkpoint found in output directory ({output_dir}): none that OffloadTrainer "
                         f"can resume from" + (f": {'; '.join(skipped)}" if skipped else " (no checkpoint-N directory)"))

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """Trainer's, made complete by a marker written last ([Note: complete Trainer checkpoints])."""
        run_dir = self._get_output_dir(trial=trial)
        checkpoint_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            _unmark(checkpoint_dir)
        # [Note: OffloadTrainer with several ranks] 3: no rank writes before the marker is out
        self.accelerator.wait_for_everyone()
        # The Trainer's rotation would run before the marker: it sees a copy of the arguments
        # without save_total_limit (the caller's stay untouched, and _save writes them).
        args = self._args_outside_save = self.args
        self.args = copy.copy(args)
        self.args.save_total_limit = None
        self.args.push_to_hub = False  # pushed below, once complete: the pushed folder holds the marker
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args, self._args_outside_save = args, None
        self.accelerator.wait_for_everyone()  # every rank's files (RNG states) are written
        if self.args.should_save:
            _mark_complete(checkpoint_dir, engine_checkpoint=not self.args.save_only_model)
            if self.args.push_to_hub:
                self._push_from_checkpoint(checkpoint_dir)
            self._rotate_complete_checkpoints(run_dir, checkpoint_dir)
        self.accelerator.wait_for_everyone()  # every rank sees the checkpoint complete

    def _rotate_complete_checkpoints(self, run_dir: str, saved_dir: str) -> None:
        """[Note: complete Trainer checkpoints] step 4: trainer_utils.rotate_checkpoints over
        complete checkpoints (in the Trainer's order, oldest first, keeping the one just
        saved and the best), after removing incomplete ones of steps before ``saved_dir``'s."""
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return
        saved_step = _checkpoint_step(saved_dir)
        complete = []
        for checkpoint in sort_checkpoints(run_dir, use_mtime=True):
            step = _checkpoint_step(checkpoint)
            if step is None:
                continue
            if not checkpoint_missing(checkpoint):
                complete.append(checkpoint)
            elif step < saved_step:
                _remove_checkpoint(checkpoint)
        protected = {os.path.abspath(saved_dir)}
        if self.state.best_model_checkpoint is not None:
            protected.add(os.path.abspath(self.state.best_model_checkpoint))
        num_to_remove = len(complete) - max(limit, len(protected))
        for checkpoint in complete:
            if num_to_remove <= 0:
                break
            if os.path.abspath(checkpoint) not in protected:
                _remove_checkpoint(checkpoint)
                num_to_remove -= 1

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Trainer.save_model, with _save called on every rank: the weights are read
        collectively ([Note: OffloadTrainer with several ranks] 4). transformers 5.2x's Trainer
        does so too; 5.17's called _save on the main process alone, and the other rank never
        joined its all-gathers."""
        self._save(output_dir if output_dir is not None else self.args.output_dir)
        if self.args.push_to_hub and not _internal_call:  # as Trainer.save_model
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[dict] = None) -> None:
        """Hugging Face weights streamed from the tiers (engine.save_pretrained); a PEFT model
        saves its adapters with its own save_pretrained. Then what Trainer._save adds."""
        self._check_open("save_model")
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # Every rank reads the weights, rank 0 writes them ([Note: OffloadTrainer with several ranks] 4)
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
        if isinstance(self.model, PreTrainedModel) or not hasattr(self.model, "save_pretrained"):
            self.engine.save_pretrained(output_dir)
        else:  # peft: the adapters only, read through the wrapped model's state_dict
            self.model.save_pretrained(output_dir, is_main_process=self.args.should_save)
        if not self.args.should_save:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif getattr(self.data_collator, "tokenizer", None) is not None:
            self.data_collator.tokenizer.save_pretrained(output_dir)
        torch.save(self._args_outside_save or self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint (every state, the optimizer's param groups, counters and
        RNGs), optimizer.pt where small ([Note: optimizer.pt beside the engine's checkpoint]),
        and the scheduler's state."""
        engine_checkpoint_dir = os.path.join(output_dir, ENGINE_CHECKPOINT_DIR)
        self.engine.save_checkpoint(engine_checkpoint_dir)
        if self.args.should_save:
            write_optimizer_pt(self._adam, self.engine, output_dir, engine_checkpoint_dir)
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        """Only checks that the checkpoint is complete and holds an engine checkpoint: it is
        loaded, weights and optimizer together, once the scheduler exists
        (_load_optimizer_and_scheduler)."""
        _require_resumable(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        # After the scheduler's creation, which set the param groups' learning rates to its
        # first value: the engine's checkpoint puts the saved ones back.
        self.engine.load_checkpoint(os.path.join(checkpoint, ENGINE_CHECKPOINT_DIR))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _load_best_model(self) -> None:
        """load_best_model_at_end: the best checkpoint's engine states."""
        self._load_from_checkpoint(self.state.best_model_checkpoint)
        self.engine.load_checkpoint(os.path.join(self.state.best_model_checkpoint, ENGINE_CHECKPOINT_DIR))
