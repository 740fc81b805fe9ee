"""The ops are forward-only (inference): their backward is moe_ops::no_backward, which raises when it runs.

With no autograd formula at all, torch.compile of a layer in grad mode (the default outside no_grad and
inference_mode, e.g. a router whose weight requires grad) fails at compile time: AOTAutograd traces the
backward of every op whose inputs require grad. Registered this way, the backward traces (one more op,
with a fake impl, saving nothing from the forward), so the forward compiles and runs in grad mode as it
does under no_grad; running the backward raises a RuntimeError naming the op.
"""
from __future__ import annotations

import torch


@torch.library.custom_op("moe_ops::no_backward", mutates_args=())
def no_backward(grad: torch.Tensor, op: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Stands for the gradient of an input [shape] of `op`; raises: moe_ops has no backward."""
    raise RuntimeError(
        f"{op}: no backward; the moe_ops ops are forward-only (inference). Run the layer under "
        "torch.no_grad() or torch.inference_mode(), or keep its inputs and weights from requiring grad"
    )


@no_backward.register_fake
def _no_backward_fake(grad, op, shape, dtype):
    return grad.new_empty(shape, dtype=dtype)


def _setup_context(ctx, inputs, output):
    # Only the inputs' shapes and dtypes: nothing is kept alive for a backward that cannot run.
    ctx.input_meta = [(list(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in inputs]


def register(op) -> None:
    """Give the custom op `op` the raising backward above for each of its inputs that needs a gradient."""
    name = op._qualname

    def backward(ctx, *grads):
        grad = next(g for g in grads if g is not None)
        return tuple(
            no_backward(grad, name, meta[0], meta[1]) if needed and meta is not None else None
            for needed, meta in zip(ctx.needs_input_grad, ctx.input_meta)
        )

    op.register_autograd(backward, setup_context=_setup_context)
