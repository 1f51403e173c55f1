"""One entry point from a config and its resolved architecture to a model shard, with
``model.init_from``'s weights loaded (this rank's tensors only)."""

from __future__ import annotations

import torch

from ray_moe.arch import ResolvedArch
from ray_moe.comm.base import Transport
from ray_moe.config import Config
from ray_moe.model.interface import LanguageModel


def build_model(config: Config, arch: ResolvedArch, transport: Transport,
                device: torch.device | str = "cpu") -> LanguageModel:
    """The :class:`~ray_moe.model.decoder.Decoder` of ``arch`` (resolved once, on the driver:
    :meth:`ray_moe.config.Config.resolve_arch`) for this rank (``transport``'s rank of its world
    size). With ``model.init_from`` the weights come from that directory (the tensor names this
    rank opened are kept in ``model.source_tensors``), else from the model's own generator.
    """
    from ray_moe.model.decoder import Decoder
    from ray_moe.model.hf import load_pretrained

    model = Decoder(arch.spec, config, transport, device, init=not config.model.init_from)
    model.source_tensors = ()
    if config.model.init_from:
        model.source_tensors = tuple(load_pretrained(model, config.model.init_from, arch.hf_config))
    return model
