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
   Trainer's own AdamW (``create_optimizer``: the decay / no-decay groups and the
   hyperparameters of the TrainingArguments) and wraps model and AdamW into ``self.engine``.
   ``gradient_accumulation_steps``, ``max_grad_norm`` and ``bf16`` become the engine's
   config; the engine's device is the Trainer's ``args.device``.
2. Accelerate neither moves the model nor wraps its forward in autocast (the engine places
   every state and computes in its own dtype); the Trainer's ``_move_model_to_device`` does
   nothing (a meta model cannot move).
3. ``training_step`` runs the model's forward (through the engine's hooks) and
   ``compute_loss`` as the Trainer does, normalizes the loss as ``Trainer.training_step``
   does (by ``num_items_in_batch`` across the accumulation window, or by the window's
   length), and hands it to ``engine.backward`` times ``gradient_accumulation_steps``
   (which the engine divides by again), then calls ``engine.step()``: every accumulation
   window's last call clips (the engine's global norm) and updates. A window cut short at
   the end of an epoch is closed with ``engine.step()`` calls without a backward.
4. The Trainer's ``optimizer.step()`` and ``zero_grad()`` then do nothing
   (``EngineAdam``); its gradient clipping reports the norm the engine measured (gradients
   never reach ``p.grad``); its LR scheduler sets the param groups the engine's Adam reads.
5. Checkpoints (``save_steps``): the Trainer writes ``checkpoint-N/`` as usual (Hugging Face
   weights from ``engine.save_pretrained``, RNG states, trainer state, scheduler) with the
   engine's checkpoint in ``checkpoint-N/offload/`` in place of ``optimizer.pt``;
   ``resume_from_checkpoint`` loads it once the scheduler exists (its param groups, learning
   rates included, come from the checkpoint).
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

import offload
from offload.config import OffloadConfig

__all__ = ["OffloadTrainer", "EngineAdam", "ENGINE_CHECKPOINT_DIR"]

ENGINE_CHECKPOINT_DIR = "offload"
"""Where the engine's checkpoint goes inside a Trainer's ``checkpoint-N`` directory."""

SUPPORTED_OPTIMS = ("adamw_torch", "adamw_torch_fused")
"""TrainingArguments.optim values the engine runs: torch's AdamW (the engine's CPU Adam
replaces its kernel, fused or not)."""

ADAM_CLASSES = (torch.optim.Adam, offload.CPUAdam)  # torch.optim.AdamW is an Adam
"""Optimizers the engine runs (its CPU Adam reads their param groups)."""

# OffloadConfig fields that TrainingArguments decides, with the TrainingArguments name.
_FIELDS_FROM_ARGS = {"gradient_accumulation_steps": "gradient_accumulation_steps",
                     "max_grad_norm": "max_grad_norm", "dtype": "bf16"}


class EngineAdam(torch.optim.Optimizer):
    """The optimizer the Trainer holds: the AdamW given to ``offload.wrap``, seen through its
    param groups and state (so the Trainer's LR scheduler sets the learning rates the
    engine's Adam reads), with a ``step()`` and ``zero_grad()`` that do nothing, since the
    engine has updated in ``training_step`` ([Note: the Trainer's loop around the engine]).
    Like accelerate's AcceleratedOptimizer it does not call ``Optimizer.__init__``."""

    def __init__(self, adam: torch.optim.Optimizer) -> None:
        self.adam = adam

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
        raise RuntimeError("the optimizer's state lives in the engine's tiers: save it with "
                           "trainer.engine.save_checkpoint(DIR) (the Trainer's checkpoints do)")

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        raise RuntimeError("the optimizer's state lives in the engine's tiers: load it with "
                           "trainer.engine.load_checkpoint(DIR) (resume_from_checkpoint does)")

    def __repr__(self) -> str:
        return f"EngineAdam({self.adam!r})"


def unsupported_settings(args: TrainingArguments, config: OffloadConfig, *, model_init: Any, optimizer: Any,
                         optimizer_cls_and_kwargs: Any) -> List[str]:
    """Every setting OffloadTrainer cannot honour, as 'name=value: why' ([] when none)."""
    problems = []
    optim = getattr(args.optim, "value", args.optim)
    if optim not in SUPPORTED_OPTIMS:
        problems.append(f"optim={optim!r}: the engine runs Adam/AdamW on the CPU; use "
                        f"{' or '.join(map(repr, SUPPORTED_OPTIMS))}")
    if args.optim_args:
        problems.append(f"optim_args={args.optim_args!r}: the engine's AdamW takes no extra arguments")
    if optimizer_cls_and_kwargs is not None and not (
            isinstance(optimizer_cls_and_kwargs[0], type) and issubclass(optimizer_cls_and_kwargs[0], ADAM_CLASSES)):
        problems.append(f"optimizer_cls_and_kwargs={optimizer_cls_and_kwargs[0]!r}: the engine runs "
                        "torch.optim.Adam/AdamW or offload.CPUAdam only")
    if optimizer is not None and not isinstance(optimizer, ADAM_CLASSES):
        problems.append(f"optimizers=({type(optimizer).__name__}, ...): the engine runs torch.optim.Adam/AdamW "
                        "or offload.CPUAdam only")
    named = [
        ("deepspeed", args.deepspeed, "the engine does what DeepSpeed would"),
        ("fsdp", args.fsdp, "the engine shards across ranks itself (stage=) and is not FSDP"),
        ("parallelism_config", args.parallelism_config, "one process trains one engine"),
        ("torch_compile", args.torch_compile, "compiled graphs bypass the engine's per-unit hooks"),
        ("fp16", args.fp16, "the engine would scale the loss and skip overflowed steps itself, but the "
                            "Trainer holds the LR schedule only for accelerate's own GradScaler skips; use bf16=True"),
        ("fp16_full_eval", args.fp16_full_eval, "the engine evaluates in its own dtype"),
        ("bf16_full_eval", args.bf16_full_eval, "the engine evaluates in its own dtype"),
        ("use_liger_kernel", args.use_liger_kernel, "it replaces modules after the engine cut the model into units"),
        ("auto_find_batch_size", args.auto_find_batch_size, "an engine cannot retry a failed step"),
        ("model_init", model_init, "the engine wraps the model given at construction"),
    ]
    problems += [f"{name}={value!r}: {why}" for name, value, why in named if value]
    if args.world_size > 1 or args.n_gpu > 1:
        problems.append(f"world_size={args.world_size}, n_gpu={args.n_gpu}: OffloadTrainer trains on one "
                        "process and one device")
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


class OffloadTrainer(Trainer):
    """A ``transformers.Trainer`` that trains through ``offload.wrap`` ([Note: the Trainer's
    loop around the engine]). Takes the Trainer's arguments, plus ``offload_config`` (an
    OffloadConfig, a dict or a JSON path: where the states live, without the fields that
    TrainingArguments decide) and ``weights`` (a Hugging Face model directory or a
    .safetensors file whose tensors become the parameters' values; with a model built on
    the meta device). ``self.engine`` is the Engine; ``close()`` removes its swap files."""

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
        problems = unsupported_settings(args, config, model_init=model_init, optimizer=optimizers[0],
                                        optimizer_cls_and_kwargs=optimizer_cls_and_kwargs)
        if problems:
            raise ValueError("OffloadTrainer cannot honour these settings:\n  " + "\n  ".join(problems))
        config = dataclasses.replace(config, device=str(args.device), **trainer_owned_fields(args))
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
        self.optimizer = EngineAdam(adam)
        self._grad_norm: Optional[float] = None  # the last optimizer step's, see _measured_grad_norm
        self._warned_grad_norm = False
        self._closed = False

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
    def _build_accelerator_args(self, **kwargs: Any) -> Dict[str, Any]:
        # [Note: the Trainer's loop around the engine] step 2
        accelerator_args = super()._build_accelerator_args(**kwargs)
        accelerator_args.update(device_placement=False, mixed_precision="no")
        return accelerator_args

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """Nothing to do: the engine puts every state on its tier and brings units to the device."""

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
        if self.loss_is_scaled_for_ga is not None:
            loss_is_scaled_for_ga = self.loss_is_scaled_for_ga
        else:  # as Trainer.training_step decides it
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
    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[dict] = None) -> None:
        """Hugging Face weights streamed from the tiers (engine.save_pretrained); a PEFT model
        saves its adapters with its own save_pretrained. Then what Trainer._save adds."""
        self._check_open("save_model")
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        if isinstance(self.model, PreTrainedModel) or not hasattr(self.model, "save_pretrained"):
            self.engine.save_pretrained(output_dir)
        else:  # peft: the adapters only, read through the wrapped model's state_dict
            self.model.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif getattr(self.data_collator, "tokenizer", None) is not None:
            self.data_collator.tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint (every state, the optimizer's param groups, counters and
        RNGs) in place of optimizer.pt, and the scheduler's state."""
        self.engine.save_checkpoint(os.path.join(output_dir, ENGINE_CHECKPOINT_DIR))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        """Only checks that the checkpoint holds an engine checkpoint: it is loaded, weights
        and optimizer together, once the scheduler exists (_load_optimizer_and_scheduler)."""
        engine_dir = os.path.join(resume_from_checkpoint, ENGINE_CHECKPOINT_DIR)
        if not os.path.isdir(engine_dir):
            raise ValueError(
                f"resume_from_checkpoint: {resume_from_checkpoint!r} holds no engine checkpoint "
                f"({ENGINE_CHECKPOINT_DIR}/); OffloadTrainer resumes from checkpoints it wrote "
                "without save_only_model")

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
