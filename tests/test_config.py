"""offload.config: OffloadConfig from a dict or a JSON file, and errors that name the field."""
import json

import pytest

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
