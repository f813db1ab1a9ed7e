"""Stubs for offload._native, the compiled core (native/bindings/)."""

def num_threads() -> int: ...
def set_num_threads(num_threads: int) -> None: ...
def io_available_backends() -> list[str]: ...
def adam_step(
    param: int,
    grad: int,
    grad_dtype: int,
    exp_avg: int,
    exp_avg_sq: int,
    numel: int,
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    grad_scale: float,
    copy_out: int = 0,
    copy_out_dtype: int = 0,
) -> None: ...
def adam_selected_isa() -> str: ...
def adam_available_isas() -> list[str]: ...
def adam_set_isa(name: str) -> None: ...
