"""What splitting a rank's tokens into chunks costs the expert compute by itself, on one GPU with
no exchange: the ``chunking`` section of ``ray-moe bench layer``.

An overlap that pipelines the exchange with the experts in chunks (``moe.pipeline_chunks``) wins
only if what it hides exceeds what chunking adds: the same pairs in several smaller grouped GEMMs
(each with its own launch, tail and per-expert partial tiles) and, in backward, each weight
gradient summed over chunks. Two measurements, both against the unchunked layer:

- the Triton experts' forward on all T tokens' pairs against the sum of the same pairs split by
  token into chunks of the given relative sizes;
- the MoE layer's training step (forward + backward) over the local transport, sequential against
  pipelined with those chunks (its exchange is a copy on the side stream: what is left is the
  chunking's own cost).
"""

from __future__ import annotations

import torch

from ray_moe.bench.layer.problem import LayerShape, layer_problem, log, median_ms, ray_moe_layer
from ray_moe.chunks import token_chunks

SPLITS: tuple[tuple[int, ...], ...] = ((1, 1), (1, 6, 1), (3, 1), (1, 1, 1, 1))


def chunking_rows(shape: LayerShape, dtype: torch.dtype, seed: int, warmup_ms: int, rep_ms: int,
                  splits: tuple[tuple[int, ...], ...] = SPLITS) -> list[dict]:
    """Rows: per split, the experts' forward in chunks and the pipelined layer's step, each in
    milliseconds and as a ratio to the unchunked one (> 1: chunking costs that much more)."""
    from ray_moe.kernels.expert_ffn import expert_ffn_triton
    from ray_moe.model.router import route

    device = torch.device("cuda")
    prob = layer_problem(shape, device, dtype, seed)
    x, w13, w2 = prob["x"], prob["w13"], prob["w2"]
    with torch.no_grad():
        weight, slot, _ = route(x, prob["router"], shape.K, need_probs=False)
    slot, weight = slot.to(torch.int32).contiguous(), weight.float().contiguous()
    sec = f"chunking T={shape.T} E={shape.E}"
    rows: list[dict] = []
    with torch.no_grad():
        whole = median_ms(lambda: expert_ffn_triton(x, slot, weight, w13, w2), warmup_ms, rep_ms)
    rows.append({"section": sec, "what": "experts' forward, all tokens", "ms": whole, "ratio": 1.0})
    for split in splits:
        parts = []
        with torch.no_grad():
            for a, b in token_chunks(shape.T, split):
                parts.append(median_ms(lambda a=a, b=b: expert_ffn_triton(x[a:b], slot[a:b], weight[a:b], w13, w2),
                                       warmup_ms, rep_ms))
        name = "-".join(map(str, split))
        rows.append({"section": sec, "what": f"experts' forward in chunks {name}", "ms": sum(parts),
                     "ratio": sum(parts) / whole, "chunks_ms": [round(p, 3) for p in parts]})
        log(f"chunking: forward {name}: {sum(parts):.3f} ms against {whole:.3f}")
    xg, grad = x.detach().requires_grad_(), prob["grad"]
    steps = {}
    for split in ((1,), *splits):
        layer = ray_moe_layer(shape, prob, pipeline_chunks=split if len(split) > 1 else 1)
        params = (xg, layer.router, layer.w13, layer.w2)

        def step(layer=layer, params=params):
            torch.autograd.grad(layer(xg)[0], params, grad)

        step()  # compiles, and the per-shape choice of the expert implementation
        steps[split] = median_ms(step, warmup_ms, rep_ms)
        name = "sequential" if len(split) == 1 else f"pipelined, chunks {'-'.join(map(str, split))}"
        rows.append({"section": sec, "what": f"layer step (fwd+bwd), {name}", "ms": steps[split],
                     "ratio": steps[split] / steps[(1,)]})
        log(f"chunking: layer step {name}: {steps[split]:.3f} ms")
        del layer
        torch.cuda.empty_cache()
    return rows
