"""``model.dense_precision: fp8``: the blocks' dense linears trained in FP8 through torchao's
float8 training (``torchao.float8.convert_to_float8_training``, its default recipe: dynamic
tensorwise scales, E4M3 inputs and weights, E5M2 output gradients; torchtitan's ``float8``).

What is converted (:func:`fp8_dense_filter`): every ``nn.Linear`` inside the decoder blocks
(``layers.*``): the attention projections (q/k/v/o, MLA's low-rank ones), the shared experts and
the dense MLPs, where both of a weight's dimensions are multiples of 16 (FP8 GEMMs need them);
the rest keep the model dtype. Not converted: the LM head (the fused loss reads its weight
directly, and its logits are the loss's precision), the embeddings and the routers (parameters,
not linears); the routed experts have their own FP8 path (``moe.expert_precision``).

A :class:`torchao.float8.Float8Linear` keeps the ``nn.Linear``'s parameters (same tensors, same
names), so checkpoints, ``model.init_from`` and ZeRO see no difference; it saves its input in
the model dtype for backward and quantises per GEMM (no state between steps). On the CPU the
GEMMs are emulated (torchao's ``emulate``: the same quantised values multiplied in float32).
"""

from __future__ import annotations

import torch
from torch import nn

from ray_moe.config import ConfigError

DENSE_PRECISIONS = ("bf16", "fp8")  # model.dense_precision
FP8_DIM_MULTIPLE = 16  # both dimensions of an FP8 GEMM's weight (torch._scaled_mm)
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm_89) and Hopper (sm_90)
BLOCKS_PREFIX = "layers."  # the decoder blocks' module names (model.decoder.Decoder.layers)


def device_error(device: torch.device | str) -> str | None:
    """Why the FP8 dense linears cannot run on ``device``, or None (the CPU emulates them)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_MIN_CAPABILITY:
        return (f"model.dense_precision=fp8 needs a GPU with FP8 tensor cores (sm_89 or newer, e.g. H100), but "
                f"{torch.cuda.get_device_name(device)} is sm_{cap[0]}{cap[1]}; use model.dense_precision=bf16")
    return None


def fp8_dense_filter(module: nn.Module, name: str) -> bool:
    """True for the linears :func:`convert_dense_to_fp8` converts: an ``nn.Linear`` named
    ``layers.*`` whose weight's dimensions are both multiples of :data:`FP8_DIM_MULTIPLE`."""
    if not isinstance(module, nn.Linear) or not name.startswith(BLOCKS_PREFIX):
        return False
    out_features, in_features = module.weight.shape
    return out_features % FP8_DIM_MULTIPLE == 0 and in_features % FP8_DIM_MULTIPLE == 0


def fp8_dense_names(model: nn.Module) -> list[str]:
    """The module names of ``model`` that :func:`fp8_dense_filter` selects, in module order."""
    return [name for name, module in model.named_modules() if fp8_dense_filter(module, name)]


def convert_dense_to_fp8(model: nn.Module, device: torch.device | str) -> tuple[str, ...]:
    """Swap the selected linears of ``model`` (:func:`fp8_dense_filter`) for torchao's
    ``Float8Linear`` in place, keeping their parameters; returns their names. Raises
    :class:`ConfigError` (one line) without torchao or on a GPU without FP8 tensor cores."""
    error = device_error(device)
    if error:
        raise ConfigError(error)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise ConfigError(f"model.dense_precision=fp8 trains the dense linears through torchao's float8 training, "
                          f"which does not import here ({exc}); install torchao or use "
                          "model.dense_precision=bf16") from None

    names = tuple(fp8_dense_names(model))
    config = Float8LinearConfig(emulate=torch.device(device).type != "cuda")
    convert_to_float8_training(model, module_filter_fn=fp8_dense_filter, config=config)
    return names
