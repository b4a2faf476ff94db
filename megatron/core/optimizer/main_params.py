"""fp32 main ("master") copies of half-precision model parameters, megatron's mixed-precision
bookkeeping, as plain functions any optimizer can reuse (the plain and the distributed one).

For a bf16/fp16 model parameter p with its fp32 gradient g = p.main_grad (DDP's buffer):

    main = fp32 copy of p           (make_main_param; the optimizer steps ``main``)
    main.grad <- g                  (copy_model_grads_to_main_grads; g is already fp32: a view)
    main <- optimizer update(main)  (in fp32)
    p <- round(main)                (copy_main_params_to_model_params)

so updates smaller than p's rounding step accumulate in ``main`` instead of being lost.

The distributed optimizer keeps the same bookkeeping for a flat range ``[a, b)`` of p
(``make_main_shard``): an fp32 view of ``p.view(-1)[a:b]`` when p is fp32 (stepped in place),
else an fp32 copy of it; the attributes are copied the same way (``copy_main_attributes``).
"""

from typing import List, Optional, Sequence

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)
_COPIED_ATTRIBUTES = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "shared",
    "allreduce",
    "expert_tp_duplicate",
)


def make_main_param(model_param: torch.nn.Parameter) -> torch.nn.Parameter:
    """An fp32 ``Parameter`` holding ``model_param``'s values, carrying its tensor-parallel
    attributes and ``shared`` (gradient-norm bookkeeping reads them), and recorded as
    ``model_param.main_param``."""
    main_param = torch.nn.Parameter(model_param.detach().clone().float())
    copy_main_attributes(model_param, main_param)
    model_param.main_param = main_param
    return main_param


def make_main_shard(model_param: torch.nn.Parameter, start: int, end: int) -> torch.Tensor:
    """The fp32 tensor an optimizer steps for elements ``[start, end)`` of ``model_param``
    (flattened): a view when the parameter is fp32, else an fp32 copy; it carries the
    parameter's tensor-parallel attributes and ``shared``."""
    flat = model_param.detach().view(-1)[start:end]
    main = flat if flat.dtype == torch.float32 else flat.clone().float()
    copy_main_attributes(model_param, main)
    return main


def copy_main_attributes(model_param: torch.Tensor, main: torch.Tensor) -> None:
    """Give ``main`` the attributes the gradient statistics read (tensor-parallel ones and
    ``shared``) from ``model_param``."""
    for attr in _COPIED_ATTRIBUTES:
        if hasattr(model_param, attr):
            setattr(main, attr, getattr(model_param, attr))


def model_grad(model_param: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient of ``model_param``: DDP's ``main_grad`` when it has one, else ``.grad``."""
    grad = getattr(model_param, "main_grad", None)
    return model_param.grad if grad is None else grad


def copy_model_grads_to_main_grads(
    model_params: Sequence[torch.Tensor], main_params: Sequence[torch.Tensor]
) -> None:
    """``main.grad = float32(model gradient)`` (a view when it is fp32 already, as DDP's
    ``main_grad`` with ``grad_reduce_in_fp32``); the model parameter's ``.grad`` is freed."""
    for param, main_param in zip(model_params, main_params):
        grad = model_grad(param)
        main_param.grad = None if grad is None else grad.float()
        param.grad = None


@torch.no_grad()
def copy_main_params_to_model_params(
    model_params: Sequence[torch.Tensor], main_params: Sequence[torch.Tensor]
) -> None:
    """``model <- main`` rounded to the model's dtype (one foreach copy)."""
    _foreach_copy([p.data for p in model_params], [m.data for m in main_params])


@torch.no_grad()
def copy_model_params_to_main_params(
    model_params: Sequence[torch.Tensor], main_params: Sequence[torch.Tensor]
) -> None:
    """``main <- model`` (after the model's weights were loaded or changed)."""
    _foreach_copy([m.data for m in main_params], [p.data for p in model_params])


def _foreach_copy(destinations: List[torch.Tensor], sources: List[torch.Tensor]) -> None:
    if destinations:
        torch._foreach_copy_(destinations, sources)
