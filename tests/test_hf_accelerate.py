"""An offload engine under accelerate ([Note: accelerate around the engine]): the README's
recipe (offload.integrations.accelerate.prepare, engine.backward, engine.step, the prepared
scheduler) logs the losses and learning rates of a plain accelerate loop and ends at its
weights; an accelerator whose settings cannot work is refused by name before anything is
prepared."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from transformers import LlamaConfig, LlamaForCausalLM

import offload
from offload.integrations.accelerate import prepare
from hf_support import CONFIG, REL_TOL, TokenDataset
from support import free_port, max_rel_error, reference_optimizer_step

WORLD = 2
# Two ranks against one process on the same rows: each rank's loss is its row's mean and the
# all-reduce adds the two ranks' gradients, where one process sums every token's in one
# pass, so the gradients differ by a few ulps; Adam's normalisation carries that furthest
# on the embedding rows of rare tokens, as torch's sqrt above. Measured after 6 steps: 2.8e-5
# at stage 0 (the losses within REL_TOL). A real bug (a missed or doubled reduction) is > 1e-3.
RANKS_REL_TOL = 1e-4

# The plain loop's AdamW steps with IEEE sqrt (support.reference_optimizer_step): torch's
# CPU sqrt (MKL's vsSqrt) is not correctly rounded, the engine's Adam uses IEEE sqrt, and
# otherwise runs _single_tensor_adam's ops in its order ([Note: how exact the tests are] in
# tests/test_optim_cpu_adam.py). With it the plain loop's losses and weights are the engine's
# bit for bit; with torch's own sqrt the weights differ by up to 1.9e-5 relative after 3
# updates with accumulation 2 (8.0e-6 after 6 without; the embedding rows of rare tokens,
# whose tiny gradients Adam's normalisation amplifies most), the losses by ~1e-7.


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps its state in process-wide singletons: each test builds its own."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def parts(accumulation):
    """The tiny Llama, AdamW, a warmup schedule (so a learning rate the engine did not read
    would show) and a loader of 12 rows."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    loader = torch.utils.data.DataLoader(TokenDataset(12, seed=1), batch_size=2)
    return model, optimizer, scheduler, loader


def train(accelerator, model, optimizer, scheduler, loader, backward, step):
    losses, rates = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            backward(loss)
            step()
            scheduler.step()
            losses.append(loss.item())
            rates.append(scheduler.get_last_lr()[0])
    return losses, rates


def plain_accelerate(accumulation):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model, optimizer, scheduler, loader = accelerator.prepare(*parts(accumulation))

    def step():
        reference_optimizer_step(optimizer)
        optimizer.zero_grad()
    losses, rates = train(accelerator, model, optimizer, scheduler, loader, accelerator.backward, step)
    return losses, rates, {k: v.clone() for k, v in model.state_dict().items()}


def engine_alone(accumulation, config):
    """The same training through the engine without accelerate: the scheduler steps at the
    end of each accumulation window, as accelerate's prepared scheduler does."""
    model, optimizer, scheduler, loader = parts(accumulation)
    losses, rates = [], []
    with offload.wrap(model, optimizer, config=config) as engine:
        for i, batch in enumerate(loader):
            loss = model(**batch).loss
            engine.backward(loss)
            engine.step()
            if (i + 1) % accumulation == 0:
                scheduler.step()
            losses.append(loss.item())
            rates.append(scheduler.get_last_lr()[0])
        return losses, rates, engine.state_dict()


@pytest.mark.parametrize("accumulation, tiers", [(1, "host"), (2, "host"), (2, "nvme")])
def test_the_recipe_trains_as_plain_accelerate(accumulation, tiers, tmp_path):
    """Bit for bit the engine's own loop (accelerate adds nothing to the numbers), and the
    plain accelerate loop's losses, learning rates and weights bit for bit (its AdamW with
    IEEE sqrt, as the engine's Adam)."""
    want_losses, want_rates, want_weights = plain_accelerate(accumulation)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()

    model, optimizer, scheduler, loader = parts(accumulation)
    config = dict(device="cpu", gradient_accumulation_steps=accumulation, param_tier=tiers, optimizer_tier=tiers,
                  swap_dir=str(tmp_path / "swap"))
    with offload.wrap(model, optimizer, config=config) as engine:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
        model, optimizer, loader, scheduler = prepare(accelerator, engine, model, optimizer, loader, scheduler)
        losses, rates = train(accelerator, model, optimizer, scheduler, loader, engine.backward, engine.step)
        weights = engine.state_dict()
    alone_losses, alone_rates, alone_weights = engine_alone(accumulation, config)
    assert (losses, rates) == (alone_losses, alone_rates)
    assert all(torch.equal(weights[k], alone_weights[k]) for k in alone_weights)
    assert len(losses) == 6
    assert rates == want_rates
    assert losses == want_losses
    assert weights.keys() == want_weights.keys()
    assert all(torch.equal(weights[k], want_weights[k]) for k in want_weights)


@pytest.mark.parametrize("setting, accelerator_kwargs, message", [
    ("mixed_precision", dict(mixed_precision="bf16"), r"mixed_precision='bf16': accelerate's autocast"),
    ("gradient_accumulation_steps", dict(gradient_accumulation_steps=4),
     r"gradient_accumulation_steps=4: the engine updates every 2 engine.step\(\) calls"),
    ("dynamo_backend", dict(dynamo_backend="inductor"), r"dynamo_backend='inductor': accelerate would compile"),
])
def test_settings_that_cannot_work_are_refused_by_name_before_anything_is_prepared(
        setting, accelerator_kwargs, message):
    model, optimizer, scheduler, loader = parts(2)
    with offload.wrap(model, optimizer, config=dict(device="cpu", gradient_accumulation_steps=2)) as engine:
        forward_before = model.forward
        accelerator = Accelerator(cpu=True, **{"gradient_accumulation_steps": 2, **accelerator_kwargs})
        with pytest.raises(ValueError, match=message):
            prepare(accelerator, engine, model, optimizer, loader, scheduler)
        assert accelerator._models == [] and accelerator._optimizers == [] and accelerator._dataloaders == []
        assert model.forward == forward_before  # no autocast around it



def test_accelerators_own_backward_is_refused_naming_engine_backward():
    """The unchanged accelerate loop would not train (loss.backward() gives the engine no
    gradients): it stops at accelerator.backward, and the prepared optimizer changes nothing."""
    model, optimizer, scheduler, loader = parts(1)
    with offload.wrap(model, optimizer, config=dict(device="cpu")) as engine:
        accelerator = Accelerator(cpu=True)
        model, optimizer, loader, scheduler = prepare(accelerator, engine, model, optimizer, loader, scheduler)
        before = engine.state_dict()
        with pytest.raises(ValueError, match=r"outside engine.backward\(loss\) \(loss.backward\(\), "
                                             r"accelerator.backward\(loss\)"):
            accelerator.backward(model(**next(iter(loader))).loss)
        optimizer.step()
        optimizer.zero_grad()
        after = engine.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def _rank_worker(rank, port, spec, out_dir):
    """One of WORLD processes as a launcher starts them: the process group (gloo, initialized
    first as tests/test_hf_trainer_ranks.py does), the Accelerator, then wrap
    (``wrap_first``: wrap before the process group and its environment exist: one rank),
    then prepare and the README's loop, without a scheduler."""
    torch.set_num_threads(1)  # two ranks share the machine's cores
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    loader = torch.utils.data.DataLoader(TokenDataset(12, seed=1), batch_size=1)
    config = dict(device="cpu", stage=spec["stage"], param_tier="host", optimizer_tier="host")
    engine = offload.wrap(model, optimizer, config=config) if spec.get("wrap_first") else None
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo")
    result = {}
    try:
        accelerator = Accelerator(cpu=True)
        result["distributed_type"] = accelerator.distributed_type.value
        engine = engine or offload.wrap(model, optimizer, config=config)
        with engine:
            try:
                model, optimizer, loader = prepare(accelerator, engine, model, optimizer, loader)
            except ValueError as error:
                result["refused"] = str(error)
                result["prepared"] = (accelerator._models, accelerator._optimizers, accelerator._dataloaders)
                return
            result["model_type"] = type(model).__name__
            losses = []
            for batch in loader:
                loss = model(**batch).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            result["losses"] = losses
            result["state"] = engine.state_dict()
        # the engine's own loop on the same ranks and rows, without accelerate
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        rows = TokenDataset(12, seed=1)
        with offload.wrap(model, optimizer, config=config) as engine:
            losses = []
            for i in range(rank, len(rows), WORLD):
                row = rows[i]
                loss = model(**{k: v[None] for k, v in row.items()}).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            result["alone_losses"] = losses
            result["alone_state"] = engine.state_dict()
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def run_ranks(spec, out_dir):
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(_rank_worker, args=(free_port(), spec, str(out_dir)), nprocs=WORLD, join=True,
                       start_method="forkserver")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("stage", [0, 2])
def test_the_recipe_on_two_processes_trains_as_one_process_on_the_whole_batch(stage, tmp_path):
    """accelerate hands rank r the r-th of each pair of 1-row batches; the engine averages
    the ranks' gradients (no DistributedDataParallel around the model): bit for bit the
    engine's own loop on those ranks and rows, and one process's on the pairs within the
    parity of ranks against one process: the ranks' mean loss within REL_TOL, the weights
    within RANKS_REL_TOL; the ranks' weights equal."""
    results = run_ranks(dict(stage=stage), tmp_path)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    want = []
    with offload.wrap(model, optimizer, config=dict(device="cpu", param_tier="host", optimizer_tier="host")) as engine:
        for batch in torch.utils.data.DataLoader(TokenDataset(12, seed=1), batch_size=2):
            loss = model(**batch).loss
            engine.backward(loss)
            engine.step()
            want.append(loss.item())
        want_state = engine.state_dict()
    for result in results:
        assert result["distributed_type"] == "MULTI_CPU"
        assert result["model_type"] == "LlamaForCausalLM"  # not DistributedDataParallel
        assert len(result["losses"]) == 6
        assert result["losses"] == result["alone_losses"]
        assert all(torch.equal(result["state"][k], result["alone_state"][k]) for k in want_state)
    mean_losses = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"])]
    assert mean_losses == pytest.approx(want, rel=REL_TOL)
    assert max_rel_error(results[0]["state"], want_state) < RANKS_REL_TOL
    assert all(torch.equal(results[0]["state"][k], results[1]["state"][k]) for k in want_state)


def test_an_engine_wrapped_before_the_process_group_is_refused_naming_the_order(tmp_path):
    """Wrapped before the process group and its environment existed, each process's engine is
    a replica of its own: prepare refuses, naming the order, before anything is prepared."""
    for result in run_ranks(dict(stage=0, wrap_first=True), tmp_path):
        assert result["distributed_type"] == "MULTI_CPU"
        assert "distributed_type=MULTI_CPU: 2 processes train, and the engine was wrapped with 1 rank(s)" \
            in result["refused"]
        assert "wrap once the process group exists (build the Accelerator first" in result["refused"]
        assert result["prepared"] == ([], [], [])
