"""One entry point from a config to a model shard: the byte-level model or an HF family's decoder,
with ``model.init_from``'s weights loaded (this rank's tensors only)."""

from __future__ import annotations

import torch
from torch import nn

from ray_moe.comm.base import Transport
from ray_moe.config import Config


def build_model(config: Config, transport: Transport, device: torch.device | str = "cpu") -> nn.Module:
    """The model of ``config.model.arch`` for this rank (``transport``'s rank of its world size).

    byte: :class:`~ray_moe.model.transformer.MoETransformer`. An HF family:
    :class:`~ray_moe.model.decoder.Decoder` from the resolved HF config; with ``model.init_from``
    the weights come from that directory (the tensor names this rank opened are kept in
    ``model.source_tensors``), else from the model's own generator.
    """
    if config.model.arch == "byte":
        from ray_moe.model.transformer import MoETransformer

        return MoETransformer(config, transport, device)
    from ray_moe.model.decoder import Decoder
    from ray_moe.model.hf import load_pretrained

    spec, hf_config = config.model.resolve_hf()
    model = Decoder(spec, config, transport, device, init=not config.model.init_from)
    model.source_tensors = ()
    if config.model.init_from:
        model.source_tensors = tuple(load_pretrained(model, config.model.init_from, hf_config))
    return model

