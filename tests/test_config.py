"""offload.config: OffloadConfig from a dict or a JSON file, and errors that name the field."""
import json
import os

import pytest
import torch

import offload


def test_config_from_dict_and_json(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"device_budget": "2MiB", "param_tier": "host", "dtype": "bf16"}))
    cfg = offload.OffloadConfig.from_any(str(path))
    assert cfg.device_budget == 2 * 2**20 and cfg.dtype == "bf16"
    assert offload.OffloadConfig.from_any({"host_budget": "1.5GiB"}).host_budget == int(1.5 * 2**30)


@pytest.mark.parametrize("values,field", [
    ({"param_tier": "gpu"}, "param_tier"),
    ({"optimizer_tier": "device"}, "optimizer_tier"),
    ({"dtype": "fp8"}, "dtype"),
    ({"device_budget": "lots"}, "device_budget"),
    ({"prefetch_bytes": "some"}, "prefetch_bytes"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ({"max_grad_norm": -1.0}, "max_grad_norm"),
    ({"param_tier": "nvme"}, "swap_dir"),
    ({"bogus": 1}, "bogus"),
    ({"device": "tpu"}, "device"),
])
def test_bad_config_names_the_field(values, field):
    with pytest.raises(ValueError, match=field):
        offload.OffloadConfig.from_any(values)


def test_unknown_key_lists_valid_fields():
    with pytest.raises(ValueError, match="valid fields are: .*device_budget"):
        offload.OffloadConfig.from_dict({"device_bugdet": 1})


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("values,field", [
    # stage: a bool or a float that compares equal to a stage is not one
    ({"stage": True}, "stage"),
    ({"stage": 1.0}, "stage"),
    ({"stage": 4}, "stage"),
    # fp16 loss scaling: inf (or NaN, or one no float32 holds) makes every step an overflow,
    # skipped forever without a word; a floor above the start makes the first overflow raise it
    ({"dtype": "fp16", "initial_loss_scale": INF}, "initial_loss_scale"),
    ({"dtype": "fp16", "initial_loss_scale": NAN}, "initial_loss_scale"),
    ({"dtype": "fp16", "initial_loss_scale": 1e39}, "initial_loss_scale"),
    ({"dtype": "fp16", "initial_loss_scale": 0.0}, "initial_loss_scale"),
    ({"dtype": "fp16", "min_loss_scale": INF}, "min_loss_scale"),
    ({"dtype": "fp16", "initial_loss_scale": 1.0, "min_loss_scale": 4.0}, "min_loss_scale"),
    ({"dtype": "fp16", "loss_scale_window": True}, "loss_scale_window"),
    # the native I/O engine's limits, refused here instead of inside wrap under internal names
    ({"io_queue_depth": 100000}, "io_queue_depth"),
    ({"io_queue_depth": 4097}, "io_queue_depth"),
    ({"io_queue_depth": 0}, "io_queue_depth"),
    ({"io_queue_depth": 32.0}, "io_queue_depth"),
    ({"io_block_bytes": "2GiB"}, "io_block_bytes"),
    ({"io_block_bytes": (1 << 30) + 4096}, "io_block_bytes"),
    ({"io_block_bytes": "1000KB"}, "io_block_bytes"),
    ({"io_block_bytes": "1MB2"}, "io_block_bytes"),
    ({"io_block_bytes": True}, "io_block_bytes"),
    # numbers that mean nothing
    ({"max_grad_norm": INF}, "max_grad_norm"),
    ({"max_grad_norm": NAN}, "max_grad_norm"),
    ({"max_grad_norm": 0}, "max_grad_norm"),
    ({"max_grad_norm": True}, "max_grad_norm"),
    ({"collective_timeout_seconds": INF}, "collective_timeout_seconds"),
    ({"collective_timeout_seconds": NAN}, "collective_timeout_seconds"),
    ({"collective_timeout_seconds": 0}, "collective_timeout_seconds"),
    ({"collective_timeout_seconds": 1e20}, "collective_timeout_seconds"),
    ({"host_budget": 0}, "host_budget"),
    ({"host_budget": "0GiB"}, "host_budget"),
    ({"device_budget": "2 GiBs"}, "device_budget"),
    ({"device_budget": "-1GiB"}, "device_budget"),
    ({"device_budget": 2e9}, "device_budget"),
    ({"prefetch_units": -1}, "prefetch_units"),
    ({"prefetch_units": True}, "prefetch_units"),
    ({"optimizer_pipeline_depth": 1}, "optimizer_pipeline_depth"),
    ({"optimizer_pipeline_depth": 3.0}, "optimizer_pipeline_depth"),
    ({"gradient_accumulation_steps": True}, "gradient_accumulation_steps"),
    # bools given as ints
    ({"prefetch": 1}, "prefetch"),
    ({"split_master": 0}, "split_master"),
    ({"skip_nonfinite_steps": "yes"}, "skip_nonfinite_steps"),
    ({"overlap_step_with_forward": None}, "overlap_step_with_forward"),
    # names
    ({"param_tier": "NVMe"}, "param_tier"),
    ({"optimizer_tier": "disk"}, "optimizer_tier"),
    ({"io_backend": "aio"}, "io_backend"),
    ({"dtype": "float16"}, "dtype"),
    ({"device": "cuda:"}, "device"),
    ({"unit_classes": None}, "unit_classes"),
    ({"unit_classes": 5}, "unit_classes"),
    ({"unit_classes": "Block"}, "unit_classes"),
    ({"unit_classes": [""]}, "unit_classes"),
    ({"param_tier": "nvme", "swap_dir": "/tmp/a\0b"}, "swap_dir"),
    ({"param_tier": "nvme", "swap_dir": b"/tmp"}, "swap_dir"),
    ({"optimizer_tier": "nvme", "swap_dir": ""}, "swap_dir"),
    ({"stage": 3, "param_tier": "device"}, "stage"),
])
def test_config_refuses_what_the_engine_cannot_use(values, field):
    """Every value that cannot work is a ValueError naming the field when the config is built
    (not later inside wrap, and not silently accepted); the message says what is accepted."""
    with pytest.raises(ValueError, match=f"^{field}: "):
        offload.OffloadConfig.from_any(values)


@pytest.mark.parametrize("values,accepted", [
    ({"stage": True}, "accepted values are 0, 1, 2, 3"),
    ({"io_queue_depth": 100000}, r"an int in \[1, 4096\]"),
    ({"io_block_bytes": "2GiB"}, "multiple of 4096 bytes from 4096 to 1073741824"),
    ({"dtype": "fp16", "initial_loss_scale": INF}, "finite number > 0 and <= 3.40282e"),
])
def test_config_error_states_the_accepted_range(values, accepted):
    with pytest.raises(ValueError, match=accepted):
        offload.OffloadConfig.from_any(values)


@pytest.mark.parametrize("values", [
    {"stage": 3, "param_tier": "nvme", "swap_dir": "/tmp"},
    {"io_queue_depth": 4096, "io_block_bytes": "1GiB"},
    {"io_queue_depth": 1, "io_block_bytes": 4096},
    {"dtype": "fp16", "initial_loss_scale": 2.0**24, "min_loss_scale": 2.0**24},
    {"dtype": "fp16", "initial_loss_scale": 1, "min_loss_scale": 0.5},
    {"max_grad_norm": 1},
    {"collective_timeout_seconds": 86400 * 365},
    {"unit_classes": ["Block"]},
    {"unit_classes": ("Block", "Head")},
    {"prefetch_units": 0, "prefetch_bytes": 0},
    {"device_budget": "1.5GiB", "host_budget": "512MB"},
])
def test_config_accepts_the_edges_of_each_range(values):
    config = offload.OffloadConfig.from_any(values)
    assert offload.OffloadConfig.from_any(config.to_dict()) == config


def test_config_takes_str_valued_enums():
    """Config systems hand over str-valued Enums; the exact-type check for stage must not
    refuse them."""
    import enum

    class Tier(str, enum.Enum):
        HOST = "host"

    config = offload.OffloadConfig(param_tier=Tier.HOST, optimizer_tier=Tier.HOST)
    assert config.param_tier == "host"


def test_config_limits_match_the_native_io_engine():
    """OffloadConfig's io_* limits are the native engine's: the largest accepted values start
    an IOEngine, one step beyond is refused by both."""
    from offload import config as config_module
    from offload.io import IOEngine
    block, depth = config_module.MAX_IO_BLOCK_BYTES, config_module.MAX_IO_QUEUE_DEPTH
    IOEngine(backend="threads", block_bytes=block, queue_depth=depth).close()
    for kwargs in ({"block_bytes": block + 4096}, {"queue_depth": depth + 1}):
        with pytest.raises(ValueError):
            IOEngine(backend="threads", **kwargs)
    for values in ({"io_block_bytes": block + 4096}, {"io_queue_depth": depth + 1}):
        with pytest.raises(ValueError):
            offload.OffloadConfig(**values)


def test_config_json_infinity_and_unreadable_files_name_the_problem(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text('{"dtype": "fp16", "initial_loss_scale": Infinity}')  # json.load takes it
    with pytest.raises(ValueError, match="^initial_loss_scale: "):
        offload.OffloadConfig.from_any(str(path))
    with pytest.raises(ValueError, match="^config: cannot read JSON file"):
        offload.OffloadConfig.from_any(str(tmp_path))  # a directory


@pytest.mark.parametrize("values,ignored", [
    ({"initial_loss_scale": 1024.0}, "initial_loss_scale"),
    ({"dtype": "bf16", "loss_scale_window": 10}, "loss_scale_window"),
    ({"prefetch": False, "prefetch_units": 4}, "prefetch_units"),
])
def test_config_warns_about_settings_it_ignores(values, ignored):
    with pytest.warns(UserWarning, match=f"ignored: {ignored}") as record:
        offload.OffloadConfig(**values)
    assert [w.filename for w in record] == [__file__]  # the user's line, not offload's


def test_the_ignored_settings_warning_points_at_the_wrap_that_built_the_config():
    """wrap(config=dict) builds the OffloadConfig inside offload (from_any): the warning
    still names the user's wrap() line."""
    from offload.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=2))
    with pytest.warns(UserWarning, match="ignored: speculative_updates") as record:
        engine = offload.wrap(model, torch.optim.AdamW(model.parameters()),
                              config=dict(device="cpu", param_tier="device", speculative_updates=True))
    engine.close()
    assert [w.filename for w in record if "ignored" in str(w.message)] == [__file__]


def test_a_test_not_marked_gpu_sees_the_cpu_whatever_the_machine_has():
    """tests/conftest.py: on a GPU machine (issue 37, finding 3) "auto" would resolve to CUDA
    and the CPU references would not compare; subprocesses see no GPU either."""
    assert offload.OffloadConfig(device="auto").resolved_device() == torch.device("cpu")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_several_ranks_on_a_node_each_take_the_gpu_of_their_local_rank():
    """Issue 37, finding 7: without an index in ``device``, torchrun's ranks each take
    cuda:LOCAL_RANK (they all took cuda:0 unless the script called set_device); one rank
    on the node takes the current device; a rank without a GPU of its own is refused."""
    from offload.config import cuda_index

    def current():
        return 0
    assert cuda_index({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, 4, current) == 3
    assert cuda_index({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, 8, lambda: 5) == 5
    assert cuda_index({}, 8, lambda: 2) == 2
    with pytest.raises(ValueError, match=r"device: LOCAL_RANK=2 of 4 ranks on this node, but this process sees 2 GPU"):
        cuda_index({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}, 2, current)
