"""Hugging Face weights in and out: parameters keep their shapes after wrap ([Note: released
parameters]), wrap(..., weights=PATH) fills the tiers from safetensors files ([Note: weights
into the tiers]) and Engine.save_pretrained writes what from_pretrained loads ([Note:
weights out]). Tiny transformers models, built from configs and saved into tmp dirs."""
import contextlib
import errno
import json
import os
import shutil
import warnings

import pytest
import safetensors.torch
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import offload
from offload.gpt import GPT, GPTConfig
from offload.io.safetensors import SafetensorsFile, SafetensorsWriter

from support import assert_same_state, gpt_loss

VOCAB = 128
MODELS = {
    # untied, grouped-query attention, a rotary buffer computed by the model's initializer
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False)),
    # tied input and output embeddings: one tensor in the file for two parameter names
    "gpt2": (GPT2LMHeadModel, lambda: GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)),
}
TIERS = {"host": dict(param_tier="host", optimizer_tier="host"),
         "nvme": dict(param_tier="nvme", optimizer_tier="nvme")}


@pytest.fixture(autouse=True)
def _quiet_transformers():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="transformers")
        yield


def saved(kind, directory, seed=0, **save_kwargs):
    """A freshly initialized model of ``kind`` saved to ``directory``; returns its class, config."""
    cls, make_config = MODELS[kind]
    torch.manual_seed(seed)
    cls(make_config()).save_pretrained(directory, **save_kwargs)
    return cls, make_config()


def meta_model(cls, config):
    with torch.device("meta"):
        return cls(config)


def config_for(tiers, tmp_path, **extra):
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    return dict(TIERS[tiers], swap_dir=str(swap), **extra)


def ids(seed=0):
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- shapes
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("meta", [False, True], ids=["eager", "meta"])
@pytest.mark.parametrize("tiers", ["host", "nvme"])
def test_parameters_keep_shape_dtype_numel_and_device_after_wrap(dtype, meta, tiers, tmp_path):
    """[Note: released parameters] p.shape, p.dtype, p.numel() as before wrap, whatever the
    compute dtype; while its unit is on the device a parameter shows its compute copy."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=2)
    if meta:
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    model.blocks[1].requires_grad_(False)
    before = {n: (p.shape, p.dtype, p.numel(), p.requires_grad) for n, p in model.named_parameters()}
    assert {d for _, d, _, _ in before.values()} == {torch.float32}
    with offload.wrap(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]),
                      config=config_for(tiers, tmp_path, device_budget=100_000, dtype=dtype)) as engine:
        after = {n: (p.shape, p.dtype, p.numel(), p.requires_grad) for n, p in model.named_parameters()}
        assert after == before
        assert all(p.device == engine.device for p in model.parameters())
        seen = {}

        def record(module, args):
            seen.update((n, p.dtype) for n, p in module.named_parameters())
        hook = engine.module.blocks[0].register_forward_pre_hook(record)  # after the engine's fetch
        engine.backward(gpt_loss(engine, torch.randint(0, 64, (2, 17))))
        hook.remove()
        assert seen and set(seen.values()) == {engine.compute_dtype}  # the compute copy, in forward
        engine.step()  # (fp16: the first step overflows and is skipped, its device copies kept)
        engine.state_dict()  # the step's updates done
        assert {n: (p.shape, p.numel(), p.requires_grad) for n, p in model.named_parameters()} == \
            {n: (shape, numel, grad) for n, (shape, _, numel, grad) in before.items()}
        for u in engine.units:
            on_device = u.compute_state == offload.units.Residency.LOADED
            for e in u.spec.entries:
                assert e.param.dtype == (engine.compute_dtype if on_device else before[e.fqn][1]), e.fqn


@pytest.mark.parametrize("meta", [False, True], ids=["eager", "meta"])
def test_parameters_of_mixed_dtypes_keep_each_their_own(meta):
    """One placeholder scratch per dtype: fp32, bf16 and fp16 parameters in one model each
    report theirs after wrap and after a step, whatever the engine's compute dtype."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=2)
    with torch.device("meta" if meta else "cpu"):
        model = GPT(cfg)
    model.blocks[1].to(torch.bfloat16)
    model.blocks[0].ln1.to(torch.float16)
    before = {n: p.dtype for n, p in model.named_parameters()}
    assert set(before.values()) == {torch.float32, torch.bfloat16, torch.float16}
    with offload.wrap(model, torch.optim.AdamW(model.parameters()), config=TIERS["host"]) as engine:
        assert {n: p.dtype for n, p in model.named_parameters()} == before
        engine.backward(gpt_loss(engine, torch.randint(0, 64, (2, 17))))
        engine.step()
        engine.state_dict()
        assert {n: p.dtype for n, p in model.named_parameters()} == before


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_model_dtype_is_the_compute_dtype_inside_forward_so_masks_fit_the_scores(dtype, tmp_path):
    """transformers reads model.dtype (the first parameter's) to build attention masks
    (torch.finfo(dtype).min): the embeddings' unit is on the device for all of forward, so
    there it is the compute dtype and an fp16 mask stays finite in fp16 scores; outside a
    pass, the dtype from before wrap."""
    cls, config = MODELS["llama"][0], MODELS["llama"][1]()
    torch.manual_seed(0)
    model = cls(config)
    ids_ = ids()
    mask = torch.ones_like(ids_)
    mask[0, :3] = 0  # left padding: a mask with finfo.min in it
    seen = []
    with offload.wrap(model, torch.optim.AdamW(model.parameters()), config=dict(TIERS["host"], dtype=dtype)) as engine:
        assert model.dtype == torch.float32
        model.model.layers[0].register_forward_pre_hook(lambda module, args: seen.append(model.dtype))
        for _ in range(2):
            out = engine(input_ids=ids_, attention_mask=mask, labels=ids_)
            engine.backward(out.loss)
            engine.step()
            assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    assert set(seen) == {engine.compute_dtype}


def test_a_transformers_model_reports_its_parameter_count_after_wrap(tmp_path):
    cls, config = MODELS["llama"][0], MODELS["llama"][1]()
    model = cls(config)
    total, trainable = model.num_parameters(), model.num_parameters(only_trainable=True)
    with offload.wrap(model, torch.optim.AdamW(model.parameters()), config=TIERS["host"]):
        assert model.num_parameters() == total and model.num_parameters(only_trainable=True) == trainable
        assert sum(p.numel() for p in model.parameters()) == total


def test_an_in_place_write_into_a_released_parameter_raises_and_changes_nothing(tmp_path):
    """add_ (and every write torch checks for overlap) raises at once; fill_/zero_, which
    torch lets through, raise at the next forward, naming the parameter. Either way the
    engine's values are untouched: the run then goes on as an undisturbed one."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=2)
    batch = torch.randint(0, 64, (2, 17))
    states = []
    for disturb in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg)
        with offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                          config=config_for("nvme", tmp_path, device_budget=100_000)) as engine:
            engine.backward(gpt_loss(engine, batch))
            engine.step()
            if disturb:
                name, weight = next(iter(model.blocks[0].named_parameters()))
                name = f"blocks.0.{name}"
                with pytest.raises(RuntimeError, match="single memory location"):
                    weight.data.add_(1.0)
                weight.data.zero_()
                with pytest.raises(RuntimeError, match=f"{name}.*written in place while their unit was not"):
                    engine(batch[:, :-1], batch[:, 1:])
            engine.backward(gpt_loss(engine, batch))
            engine.step()
            states.append(engine.state_dict())
    assert_same_state(states[1], states[0])


# ---------------------------------------------------------------------- weights in
@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("tiers", ["host", "nvme"])
def test_weights_into_a_meta_model_give_the_logits_of_from_pretrained(kind, tiers, tmp_path):
    cls, config = saved(kind, tmp_path / "model")
    reference = cls.from_pretrained(tmp_path / "model").eval()
    with torch.no_grad():
        want = reference(ids()).logits
    model = meta_model(cls, config)
    with offload.wrap(model, torch.optim.AdamW(model.parameters()), config=config_for(tiers, tmp_path),
                      weights=tmp_path / "model") as engine:
        engine.eval()
        with torch.no_grad():
            got = engine(ids()).logits
        assert torch.equal(got, want)
        state = engine.state_dict()
    for k, v in reference.state_dict().items():
        assert torch.equal(state[k], v), k


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_weights_in_bf16_track_the_fp32_logits(kind, tmp_path):
    cls, config = saved(kind, tmp_path / "model")
    reference = cls.from_pretrained(tmp_path / "model").eval()
    with torch.no_grad():
        want = reference(ids()).logits
    model = meta_model(cls, config)
    with offload.wrap(model, torch.optim.AdamW(model.parameters()), config=dict(TIERS["host"], dtype="bf16"),
                      weights=tmp_path / "model") as engine:
        engine.eval()
        with torch.no_grad():
            got = engine(ids()).logits.float()
        state = engine.state_dict()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    for k, v in reference.state_dict().items():  # the fp32 masters hold the file's values exactly
        if v.is_floating_point() and k in state and state[k].dtype == torch.float32:
            assert torch.equal(state[k], v), k


def test_weights_from_shards_with_an_index_or_from_one_file_and_into_an_eager_model(tmp_path):
    cls, config = saved("llama", tmp_path / "sharded", max_shard_size="40KB")
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    reference = cls.from_pretrained(tmp_path / "sharded").eval()
    with torch.no_grad():
        want = reference(ids()).logits
    single = tmp_path / "one.safetensors"
    safetensors.torch.save_file(reference.state_dict(), str(single))
    for source, model in [(tmp_path / "sharded", meta_model(cls, config)),
                          (single, meta_model(cls, config)),
                          (tmp_path / "sharded", cls(config))]:  # random values, overwritten
        with offload.wrap(model, torch.optim.AdamW(model.parameters()), config=TIERS["host"],
                          weights=source) as engine:
            engine.eval()
            with torch.no_grad():
                assert torch.equal(engine(ids()).logits, want), source


def test_training_from_weights_equals_training_the_from_pretrained_model(tmp_path):
    cls, config = saved("llama", tmp_path / "model")
    states = []
    for use_weights in (True, False):
        model = meta_model(cls, config) if use_weights else cls.from_pretrained(tmp_path / "model")
        with offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                          config=TIERS["host"],
                          weights=tmp_path / "model" if use_weights else None) as engine:
            for step in range(2):
                batch = ids(step)
                engine.backward(engine(batch, labels=batch).loss)
                engine.step()
            states.append(engine.state_dict())
    assert_same_state(states[0], states[1])


def _edited(tmp_path, edit):
    """The llama weights with ``edit(tensors)`` applied, as one file."""
    cls, config = saved("llama", tmp_path / "model")
    tensors = safetensors.torch.load_file(str(tmp_path / "model" / "model.safetensors"))
    edit(tensors)
    path = tmp_path / "edited.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    return cls, config, path


@pytest.mark.parametrize("case, message", [
    ("missing", r"missing \(no tensor for the parameter\): \['model.layers.1.mlp.up_proj.weight'\]"),
    ("unexpected", r"unexpected \(no parameter or buffer of that name\): \['model.extra.weight'\]"),
    ("mis-shaped", r"mis-shaped: \['lm_head.weight: file \(128, 32\), model \(128, 64\)'\]"),
])
def test_weights_that_do_not_match_are_refused_before_anything_changes(case, message, tmp_path):
    def edit(tensors):
        if case == "missing":
            del tensors["model.layers.1.mlp.up_proj.weight"]
        elif case == "unexpected":
            tensors["model.extra.weight"] = torch.zeros(3)
        else:
            tensors["lm_head.weight"] = tensors["lm_head.weight"][:, :32].clone()
    cls, config, path = _edited(tmp_path, edit)
    model = meta_model(cls, config)
    params = dict(model.named_parameters())
    config_dict = config_for("nvme", tmp_path)
    with pytest.raises(ValueError, match=message):
        offload.wrap(model, torch.optim.AdamW(model.parameters()), config=config_dict, weights=path)
    assert all(p is params[n] and p.is_meta for n, p in model.named_parameters())
    assert os.listdir(config_dict["swap_dir"]) == []


@pytest.mark.parametrize("where", ["nothing", "a directory without weights", "a .bin file"])
def test_weights_paths_that_hold_no_safetensors_are_refused(where, tmp_path):
    cls, config = MODELS["gpt2"][0], MODELS["gpt2"][1]()
    path = {"nothing": tmp_path / "absent", "a directory without weights": tmp_path,
            "a .bin file": tmp_path / "pytorch_model.bin"}[where]
    if where == "a .bin file":
        path.write_bytes(b"x")
    model = meta_model(cls, config)
    with pytest.raises(ValueError, match="weights: .*(neither|holds neither)"):
        offload.wrap(model, torch.optim.AdamW(model.parameters()), config=TIERS["host"], weights=path)


def _index_dir(path, shards):
    """A model directory whose index maps tensor ``name`` to each shard file name given."""
    path.mkdir()
    weight_map = {f"t{i}": name for i, name in enumerate(shards)}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_a_shard_that_is_not_a_regular_file_is_refused_naming_it_without_blocking(kind, tmp_path):
    """A FIFO listed as a shard made wrap(weights=) wait forever in open(); a directory
    failed with "Is a directory" and no path."""
    import signal

    out = _index_dir(tmp_path / "model", ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    safetensors.torch.save_file({"t0": torch.zeros(2)}, str(out / "model-00001-of-00002.safetensors"))
    odd = out / "model-00002-of-00002.safetensors"
    {"fifo": lambda: os.mkfifo(odd), "directory": odd.mkdir, "device": lambda: odd.symlink_to("/dev/zero")}[kind]()
    cls, config = MODELS["gpt2"][0], MODELS["gpt2"][1]()
    model = meta_model(cls, config)

    def hung(*args):
        raise TimeoutError("wrap(weights=) blocked on the shard")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        with pytest.raises(ValueError, match=f"model-00002-of-00002.safetensors' is a {kind}, not a regular file"
                           .replace("a fifo", "a FIFO")):
            offload.wrap(model, torch.optim.AdamW(model.parameters()), config=TIERS["host"], weights=out)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_weights_take_model_safetensors_over_an_index_as_from_pretrained_does(tmp_path):
    """A directory holding both (a save switching layout, or another tool's leftovers):
    wrap(weights=) loads what from_pretrained loads."""
    cls, config = saved("llama", tmp_path / "model")
    saved("llama", tmp_path / "other", seed=1, max_shard_size="40KB")
    for f in os.listdir(tmp_path / "other"):
        if f.startswith("model-") or f.endswith(".index.json"):
            os.rename(tmp_path / "other" / f, tmp_path / "model" / f)
    want = cls.from_pretrained(tmp_path / "model").state_dict()
    model = meta_model(cls, config)
    with offload.wrap(model, torch.optim.AdamW(model.parameters()), config=TIERS["host"],
                      weights=tmp_path / "model") as engine:
        state = engine.state_dict()
    for k, v in want.items():
        assert torch.equal(state[k], v), k


def test_conversions_of_integers_bools_and_fp8_into_floating_parameters(tmp_path):
    """Integers or bools into a float parameter are refused naming the tensor, the file and
    both dtypes; fp8 loads with a warning giving its precision; other conversions are silent."""
    from offload.io.safetensors import WeightFiles

    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"ints": torch.arange(4), "flags": torch.ones(4, dtype=torch.bool),
                                 "fp8": torch.ones(4).to(torch.float8_e4m3fn), "half": torch.ones(4).half()},
                                str(path))
    with WeightFiles(path) as files:
        for name, dtype in [("ints", "torch.int64"), ("flags", "torch.bool")]:
            with pytest.raises(ValueError, match=f"tensor '{name}' of '{path}' is {dtype}, and the parameter it "
                                                 "would load into is torch.float32"):
                files.check_conversion(name, torch.float32)
        with pytest.warns(UserWarning, match="'fp8' of .* is torch.float8_e4m3fn and loads into a torch.bfloat16 "
                                             r"parameter: its values keep fp8 precision \(3 mantissa bits\)"):
            files.check_conversion("fp8", torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            files.check_conversion("half", torch.float32)
            files.check_conversion("ints", torch.int32, "buffer")


def test_integer_weights_into_a_float_parameter_are_refused_by_wrap(tmp_path):
    def edit(tensors):
        tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.int32)
    cls, config, path = _edited(tmp_path, edit)
    model = meta_model(cls, config)
    with pytest.raises(ValueError, match="tensor 'lm_head.weight' of .*edited.safetensors' is torch.int32"):
        offload.wrap(model, torch.optim.AdamW(model.parameters()), config=TIERS["host"], weights=path)


# ---------------------------------------------------------------------- weights out
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_save_pretrained_gives_from_pretrained_the_trained_weights_exactly(kind, tmp_path):
    cls, config = saved(kind, tmp_path / "model")
    model = meta_model(cls, config)
    with offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                      config=config_for("nvme", tmp_path, dtype="bf16"), weights=tmp_path / "model") as engine:
        for step in range(2):
            batch = ids(step)
            engine.backward(engine(batch, labels=batch).loss)
            engine.step()
        state = engine.state_dict()
        engine.save_pretrained(tmp_path / "sharded", max_shard_size=60_000)
        engine.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    files = sorted(os.listdir(tmp_path / "sharded"))
    assert "config.json" in files and "model.safetensors.index.json" in files and "model.safetensors" not in files
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f for f in files if f.startswith("model-")]
    loaded = cls.from_pretrained(tmp_path / "sharded").state_dict()
    for k, v in loaded.items():
        if k in state:
            assert v.dtype == torch.float32 and torch.equal(v, state[k]), k
    loaded = cls.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16).state_dict()
    for k, v in loaded.items():
        if k in state:
            assert torch.equal(v, state[k].to(torch.bfloat16)), k


def test_save_pretrained_over_an_earlier_save_in_the_other_layout_leaves_no_stale_file(tmp_path):
    cls, config = saved("llama", tmp_path / "model")
    model = meta_model(cls, config)
    out = tmp_path / "out"
    with offload.wrap(model, torch.optim.AdamW(model.parameters()), config=TIERS["host"],
                      weights=tmp_path / "model") as engine:
        engine.save_pretrained(out, max_shard_size=40_000)
        shards = {f for f in os.listdir(out) if f.startswith("model-")}
        engine.save_pretrained(out)
        assert not shards & set(os.listdir(out)) and "model.safetensors.index.json" not in os.listdir(out)
        engine.save_pretrained(out, max_shard_size=40_000)
        assert "model.safetensors" not in os.listdir(out)
        state = engine.state_dict()
    for k, v in cls.from_pretrained(out).state_dict().items():
        assert torch.equal(v, state[k]), k


@contextlib.contextmanager
def llama_engine(tmp_path):
    cls, config = saved("llama", tmp_path / "model")
    model = meta_model(cls, config)
    with offload.wrap(model, torch.optim.AdamW(model.parameters()), config=TIERS["host"],
                      weights=tmp_path / "model") as engine:
        yield cls, engine


def test_a_directory_mixing_files_of_two_saves_is_refused_naming_the_shard(tmp_path):
    """[Note: save ids] One shard of another save of the same model among the shards: a
    ValueError naming it, not a model loaded with 1 tensor of one save and the rest of the
    other. Files without ids (other tools') load as before."""
    with llama_engine(tmp_path) as (cls, engine):
        engine.save_pretrained(tmp_path / "a", max_shard_size=40_000)
        engine.save_pretrained(tmp_path / "b", max_shard_size=40_000)
    shard = "model-00002-of-00012.safetensors"
    shutil.copy(tmp_path / "b" / shard, tmp_path / "a" / shard)
    model = meta_model(cls, cls.config_class.from_pretrained(tmp_path / "a"))
    with pytest.raises(ValueError, match=f"weights: '{tmp_path / 'a' / shard}' is from another save than "
                                         f"'{tmp_path / 'a' / 'model.safetensors.index.json'}'"):
        offload.wrap(model, torch.optim.AdamW(model.parameters()), config=TIERS["host"], weights=tmp_path / "a")


def test_save_pretrained_keeps_what_else_the_directory_holds(tmp_path):
    """A Trainer's output_dir holds its checkpoint-N directories beside the final weights."""
    out = tmp_path / "out"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "checkpoint-3" / "trainer_state.json").write_text("{}")
    (out / "tokenizer.json").write_text("{}")
    with llama_engine(tmp_path) as (cls, engine):
        engine.save_pretrained(out, max_shard_size=40_000)
        engine.save_pretrained(out)
    assert sorted(os.listdir(out)) == ["checkpoint-3", "config.json", "generation_config.json", "model.safetensors",
                                       "tokenizer.json"]
    assert (out / "checkpoint-3" / "trainer_state.json").read_text() == "{}"


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_save_pretrained_writes_nothing_through_planted_symlinks_and_makes_private_files(umask, tmp_path):
    """Symbolic links planted at the names a save writes (its partial files, config.json)
    are never written through; the files are 0600 and a directory it creates 0700, as a
    checkpoint's, whatever the umask."""
    victim = tmp_path / "victim"
    victim.write_text("root's file")
    out = tmp_path / "out"
    out.mkdir()
    planted = ["config.json", "generation_config.json", "model.safetensors.partial",
               "model.safetensors.index.json.partial"] + \
        [f"model-{k:05d}-of-{n:05d}.safetensors.partial" for n in range(2, 16) for k in range(1, n + 1)]
    for name in planted:
        (out / name).symlink_to(victim)
    old_umask = os.umask(umask)
    try:
        with llama_engine(tmp_path) as (cls, engine):
            engine.save_pretrained(out, max_shard_size=40_000)
            engine.save_pretrained(out)
            engine.save_pretrained(tmp_path / "new" / "model", max_shard_size=40_000)
    finally:
        os.umask(old_umask)
    assert victim.read_text() == "root's file"
    for directory in (out, tmp_path / "new" / "model"):
        for name in os.listdir(directory):
            if not (directory / name).is_symlink():
                assert os.stat(directory / name).st_mode & 0o777 == 0o600, name
    assert not (out / "config.json").is_symlink()
    assert os.stat(tmp_path / "new" / "model").st_mode & 0o777 == 0o700


@pytest.mark.parametrize("dtype", ["bfloat16", torch.int8, torch.float64, "fp8"])
def test_save_pretrained_refuses_a_bad_argument_before_writing_anything(dtype, tmp_path):
    with llama_engine(tmp_path) as (cls, engine):
        with pytest.raises(ValueError, match=r"dtype: expected torch.float32, torch.bfloat16, torch.float16, "
                                             r"'fp32', 'bf16', 'fp16' or None, got "):
            engine.save_pretrained(tmp_path / "out", dtype=dtype)
        with pytest.raises(ValueError, match="max_shard_size"):
            engine.save_pretrained(tmp_path / "out", max_shard_size=0)
        (tmp_path / "file").write_text("x")
        with pytest.raises(ValueError, match="save_pretrained: .*file' exists and is not a directory"):
            engine.save_pretrained(tmp_path / "file")
    assert not (tmp_path / "out").exists() and (tmp_path / "file").read_text() == "x"


def test_save_pretrained_takes_the_dtype_as_the_config_spells_it(tmp_path):
    from offload.io.safetensors import WeightFiles

    with llama_engine(tmp_path) as (cls, engine):
        engine.save_pretrained(tmp_path / "bf16", dtype="bf16")
        engine.save_pretrained(tmp_path / "torch-bf16", dtype=torch.bfloat16)
    with WeightFiles(tmp_path / "bf16") as a, WeightFiles(tmp_path / "torch-bf16") as b:
        assert {d for d, _ in a.shapes.values()} == {torch.bfloat16}
        assert all(torch.equal(a.read(k), b.read(k)) for k in a.shapes)


FULL_DISK_WORKER = """
import errno, json, os, resource, signal, sys
import torch
import offload
from offload.gpt import GPT, GPTConfig

out = sys.argv[1]
model = GPT(GPTConfig(vocab_size=512, seq_len=8, d_model=64, num_heads=2, num_layers=1))
engine = offload.wrap(model, torch.optim.AdamW(model.parameters()), config=dict(param_tier="host", optimizer_tier="host"))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (64_000, 64_000))
try:
    engine.save_pretrained(out)
except OSError as error:
    print(json.dumps({"errno": error.errno, "filename": error.filename, "message": str(error)}))
"""


def test_a_write_that_fails_keeps_its_errno_names_the_file_and_leaves_nothing(tmp_path):
    """A real failed write (a file-size limit: EFBIG, as ENOSPC would be) in save_pretrained."""
    import subprocess
    import sys

    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-c", FULL_DISK_WORKER, str(out)], capture_output=True, text=True,
                            timeout=240, env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(
                                offload.__file__))))
    assert result.returncode == 0, result.stderr
    error = json.loads(result.stdout.strip().splitlines()[-1])
    assert error["errno"] == errno.EFBIG, error
    assert error["filename"] and os.path.basename(error["filename"]) == "model.safetensors", error
    assert "save_pretrained could not write" in error["message"], error
    assert os.listdir(out) == []


@pytest.mark.parametrize("shard", [None, 40_000], ids=["one-file", "sharded"])
def test_offload_export_format_safetensors_writes_a_model_directory_from_a_checkpoint(shard, tmp_path):
    """`offload export CKPT OUT --format safetensors`: the model directory save_pretrained
    writes, from a checkpoint (config.json copied beside by the user)."""
    import shutil
    import subprocess
    import sys

    cls, config = saved("gpt2", tmp_path / "model")
    model = meta_model(cls, config)
    with offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config_for("nvme", tmp_path),
                      weights=tmp_path / "model") as engine:
        batch = ids()
        engine.backward(engine(batch, labels=batch).loss)
        engine.step()
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        state = engine.state_dict()
    out = tmp_path / "exported"
    args = [sys.executable, "-m", "offload", "export", str(tmp_path / "ckpt"), str(out), "--format", "safetensors"]
    if shard:
        args += ["--max-shard-size", str(shard)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=240,
                            env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(offload.__file__))))
    assert result.returncode == 0, result.stderr
    assert ("model.safetensors.index.json" in os.listdir(out)) == bool(shard)
    shutil.copy(tmp_path / "model" / "config.json", out)
    for k, v in cls.from_pretrained(out).state_dict().items():
        assert torch.equal(v, state[k]), k


# ---------------------------------------------------------------------- the format
def test_safetensors_files_round_trip_with_the_safetensors_package(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(5),
               "d": torch.tensor(True), "e": torch.randn(2, 3).half(), "empty": torch.empty(0, 4)}
    theirs = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(tensors, str(theirs), metadata={"format": "pt"})
    f = SafetensorsFile(str(theirs))
    assert f.metadata == {"format": "pt"}
    for k, v in tensors.items():
        assert torch.equal(f.read(k), v), k
    f.close()
    ours = tmp_path / "ours.safetensors"
    writer = SafetensorsWriter(str(ours), [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()])
    for k, v in tensors.items():
        writer.write(k, v)
    assert not ours.exists()  # only once finished
    writer.finish()
    for k, v in safetensors.torch.load_file(str(ours)).items():
        assert torch.equal(v, tensors[k]), k


def _file(header, data=b""):
    text = header.encode()
    return len(text).to_bytes(8, "little") + text + data


@pytest.mark.parametrize("content, message", [
    (b"\x01\x00", "shorter than its 8-byte header length"),
    ((100).to_bytes(8, "little") + b"{}", "header length 100 does not fit"),
    (_file("[]"), "not a JSON object"),
    (_file('{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', bytes(8)), "do not hold"),
    (_file('{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}}', bytes(16)), "do not hold"),
    (_file('{"a":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}}', bytes(4)), "known dtype"),
    (_file('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
           '"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', bytes(12)), "'a' and 'b' overlap"),
], ids=["short", "header-length", "not-an-object", "past-the-end", "wrong-size", "dtype", "overlap"])
def test_a_broken_safetensors_file_is_refused_naming_it(content, message, tmp_path):
    path = tmp_path / "broken.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"broken.safetensors.*{message}"):
        SafetensorsFile(str(path))


# ---------------------------------------------------------------------- memory
RSS_WORKER = """
import json, resource, sys
import torch
torch.set_num_threads(1)
import offload
from offload.gpt import GPT, GPTConfig
from offload.io.safetensors import SafetensorsWriter
args = json.loads(sys.argv[1])
cfg = GPTConfig(vocab_size=8192, seq_len=64, d_model=1024, num_heads=16, num_layers=args["layers"])
with torch.device("meta"):
    model = GPT(cfg)
if args["write"]:  # random weights, streamed a tensor at a time
    shapes = [(n, torch.float32, tuple(p.shape)) for n, p in model.named_parameters()]
    writer = SafetensorsWriter(args["path"], shapes)
    for name, _, shape in shapes:
        writer.write(name, torch.randn(shape))
    writer.finish()
    sys.exit(0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
engine = offload.wrap(model, torch.optim.AdamW(model.parameters()), config=dict(
    param_tier="nvme", optimizer_tier="nvme", swap_dir=args["swap"], device_budget="200MiB"), weights=args["path"])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
engine.close()
print(json.dumps({"before": before * 1024, "peak": peak * 1024}))
"""


@pytest.mark.slow
def test_weights_into_nvme_tiers_hold_a_few_units_of_ram_whatever_the_model_size(tmp_path):
    """[Note: weights into the tiers] A 1.1 GiB model (fp32, 18 blocks of 48 MiB) and a
    0.3 GiB one (4 blocks) with the same units, loaded through weights= with every state
    on NVMe: the larger one's peak RSS exceeds the smaller one's by less than two blocks
    (96 MiB), i.e. it does not grow with the model, though the larger holds 0.8 GiB more
    weights. Each in its own process (ru_maxrss is per process)."""
    import subprocess
    import sys

    peaks = {}
    for layers in (4, 18):
        path = str(tmp_path / f"gpt{layers}.safetensors")
        swap = tmp_path / f"swap{layers}"
        swap.mkdir()
        common = dict(layers=layers, path=path, swap=str(swap))
        for write in (True, False):
            out = subprocess.run([sys.executable, "-c", RSS_WORKER, json.dumps(dict(common, write=write))],
                                 capture_output=True, text=True, timeout=600)
            assert out.returncode == 0, out.stderr
        peaks[layers] = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
        os.unlink(path)
    block_bytes = 12 * 1024 * 1024 * 4
    assert peaks[18] - peaks[4] < 2 * block_bytes, (peaks, "peak RSS grows with the model")
