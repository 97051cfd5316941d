"""The models ``gcomp bench --overhead`` trains, and a synthetic batch for each (no data is downloaded).

- ``resnet50``: torchvision's ResNet-50 (25.6 M parameters, 224 × 224 images), where torchvision is installed
  (``pip install 'gcomp[vision]'``); channels-last on CUDA;
- ``decoder[:WIDTH,DEPTH]``: a causal Transformer decoder defined here, GPT-2-small-sized by default (width 768,
  12 layers, 12 heads, vocabulary 50,257, 256 tokens: 124 M parameters);
- ``mlp[:W1,W2,...]``: a small MLP on 64 features (the CPU's default: what CI runs).
"""
from __future__ import annotations

import torch
from torch import nn

from gcomp.bench.workloads import CharLM

MODELS = ("resnet50", "decoder", "mlp")
GPT2_SMALL = {"vocab": 50257, "context": 256, "width": 768, "depth": 12, "heads": 12}


def _numbers(spec: str) -> list[int]:
    _, _, rest = spec.partition(":")
    try:
        return [int(v) for v in rest.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--model {spec!r}: the sizes after ':' must be whole numbers") from None


def build(spec: str, seed: int = 0) -> tuple[nn.Module, str]:
    """The model of ``spec`` (``MODELS``, with sizes after ``:``), seeded; and the kind of batch it takes."""
    name = spec.partition(":")[0]
    torch.manual_seed(seed)
    if name == "resnet50":
        try:
            import torchvision
        except ImportError:
            raise ValueError("--model resnet50 needs torchvision (pip install 'gcomp[vision]'); or use --model "
                             "decoder") from None
        return torchvision.models.resnet50(weights=None), "image"
    if name == "decoder":
        sizes = _numbers(spec)
        config = dict(GPT2_SMALL)
        if sizes:
            if len(sizes) != 2 or min(sizes) < 1:
                raise ValueError(f"--model {spec!r}: decoder:WIDTH,DEPTH (e.g. decoder:128,2)")
            config.update(width=sizes[0], depth=sizes[1], heads=max(1, sizes[0] // 64), vocab=1024, context=64)
        return CharLM(**config, tied=True), "tokens"
    if name == "mlp":
        widths = _numbers(spec) or [512, 512]
        layers: list[nn.Module] = []
        for a, b in zip([64] + widths, widths):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(widths[-1], 10)), "features"
    raise ValueError(f"--model {spec!r}: --overhead trains {', '.join(MODELS)}")


def batch(model: nn.Module, kind: str, size: int, device: torch.device, seed: int) -> tuple:
    """A synthetic batch ``(inputs, targets)`` for ``model``, drawn from ``seed`` on the CPU, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    if kind == "image":
        x = torch.randn(size, 3, 224, 224, generator=g)
        y = torch.randint(0, 1000, (size,), generator=g)
    elif kind == "tokens":
        vocab, context = model.embed.num_embeddings, model.pos.shape[1]
        x = torch.randint(0, vocab, (size, context), generator=g)
        y = torch.randint(0, vocab, (size, context), generator=g)
    else:
        x = torch.randn(size, 64, generator=g)
        y = torch.randint(0, 10, (size,), generator=g)
    x, y = x.to(device), y.to(device)
    if kind == "image" and device.type == "cuda":
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y


def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
