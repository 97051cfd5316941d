"""Benchmark workloads: models defined here (there is no CPU torchvision) and datasets that need no download.

Models (``MODELS``): ``mlp`` (hidden widths as ``mlp:1024,1024``), ``resnet18`` and ``vgg19`` in their CIFAR
form (a narrower base width as ``resnet18:16``: the communication-bound vision workload on this machine),
``vit`` (a small vision transformer), ``charlm`` (a small character-level Transformer language model).
Datasets (``DATASETS``): ``digits`` (scikit-learn's bundled 8x8 handwritten digits), ``digits-transfer`` (the
same images split by class: pre-training sees only the digits 0-4, fine-tuning and testing only 5-9), ``text``
(the pydoc topics text Python ships, as characters), ``cifar10``/``cifar100`` (the standard python-pickle batches,
read from ``data_dir``), ``synthetic`` (a seeded random teacher task). Every dataset is a :class:`Data`.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

DATASETS = ("digits", "digits-transfer", "text", "cifar10", "cifar100", "synthetic")
MODELS = ("mlp", "resnet18", "vgg19", "vit", "charlm")


@dataclass
class Data:
    """Train and test tensors; ``shape`` is one example's input shape, ``classes`` the number of labels.
    ``pretrain`` is the pre-training set where it differs from ``train`` (another task), else None."""

    name: str
    train: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]
    shape: tuple[int, ...]
    classes: int
    pretrain: tuple[torch.Tensor, torch.Tensor] | None = None

    def shard(self, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s disjoint share of the training set, equal in size on every rank."""
        per_rank = len(self.train[1]) // world
        idx = torch.arange(rank, per_rank * world, world)
        return self.train[0][idx], self.train[1][idx]


# --- datasets ---------------------------------------------------------------------------------------------------

def load_data(name: str, *, data_dir: str | Path | None = None, seed: int = 0, context: int = 64) -> Data:
    """The dataset ``name`` (one of ``DATASETS``)."""
    if name == "digits":
        return _digits(seed)
    if name == "digits-transfer":
        return _digits_transfer(seed)
    if name == "synthetic":
        return _synthetic(seed)
    if name == "text":
        return _text(context)
    if name in ("cifar10", "cifar100"):
        return _cifar(name, data_dir)
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


def _split(x: np.ndarray, y: np.ndarray, seed: int) -> tuple:
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    cut = int(0.8 * len(y))
    return (torch.from_numpy(x[:cut]), torch.from_numpy(y[:cut])), (torch.from_numpy(x[cut:]), torch.from_numpy(y[cut:]))


def _digits(seed: int) -> Data:
    from sklearn.datasets import load_digits  # the harness's extra: imported only when used
    x, y = load_digits(return_X_y=True)
    x = (x.astype(np.float32) / 16.0 - 0.5) / 0.5
    train, test = _split(x.reshape(-1, 1, 8, 8), y.astype(np.int64), seed)
    return Data("digits", train, test, (1, 8, 8), 10)


def _digits_transfer(seed: int) -> Data:
    """Digits split by class into two tasks: pre-train on 0-4, fine-tune and test on 5-9. The pre-trained
    model predicts none of 5-9 at first (its test accuracy starts near 0), so fine-tuning has real work to do,
    while the features it learnt (strokes) carry over."""
    full = _digits(seed)

    def classes(split, low, high):
        keep = (split[1] >= low) & (split[1] <= high)
        return split[0][keep], split[1][keep]

    return Data("digits-transfer", classes(full.train, 5, 9), classes(full.test, 5, 9), full.shape, full.classes,
                pretrain=classes(full.train, 0, 4))


def _synthetic(seed: int, n: int = 4096, features: int = 64, classes: int = 10) -> Data:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    teacher = torch.randn(features, classes, generator=g)
    y = (x @ teacher).argmax(1)
    train, test = _split(x.numpy(), y.numpy(), seed)
    return Data("synthetic", train, test, (features,), classes)


def _text(context: int) -> Data:
    """Next-character prediction on the pydoc topics (the help texts Python ships): byte values as tokens."""
    from pydoc_data.topics import topics
    data = torch.tensor(list("\n".join(topics[k] for k in sorted(topics)).encode("ascii", "replace")),
                        dtype=torch.int64)
    n = (len(data) - 1) // context
    x = data[:n * context].view(n, context)
    y = data[1:n * context + 1].view(n, context)
    cut = int(0.9 * n)
    return Data("text", (x[:cut], y[:cut]), (x[cut:], y[cut:]), (context,), 256)


def _cifar(name: str, data_dir) -> Data:
    folder = Path(data_dir) if data_dir else None
    sub = "cifar-10-batches-py" if name == "cifar10" else "cifar-100-python"
    if folder is None or not folder.is_dir():
        raise FileNotFoundError(f"{name} needs --data-dir: a folder holding {sub}/ in the standard python-pickle "
                                "format (nothing is downloaded)")
    root = folder / sub if (folder / sub).is_dir() else folder
    files = ([f"data_batch_{i}" for i in range(1, 6)], ["test_batch"]) if name == "cifar10" else (["train"], ["test"])
    key = b"labels" if name == "cifar10" else b"fine_labels"

    def read(names):
        xs, ys = [], []
        for f in names:
            path = root / f
            if not path.exists():
                raise FileNotFoundError(f"{name}: {path} is missing (expected the standard python-pickle files)")
            with open(path, "rb") as fh:
                batch = pickle.load(fh, encoding="bytes")
            xs.append(np.asarray(batch[b"data"], dtype=np.uint8))
            ys.append(np.asarray(batch[key], dtype=np.int64))
        x = np.concatenate(xs).reshape(-1, 3, 32, 32).astype(np.float32) / 255.0
        mean = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32).reshape(1, 3, 1, 1)
        std = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32).reshape(1, 3, 1, 1)
        return torch.from_numpy((x - mean) / std), torch.from_numpy(np.concatenate(ys))

    return Data(name, read(files[0]), read(files[1]), (3, 32, 32), 10 if name == "cifar10" else 100)


# --- models -----------------------------------------------------------------------------------------------------

def make_model(spec: str, data: Data, seed: int = 0) -> nn.Module:
    """The model ``spec`` (``name`` or ``name:option``) for ``data``, its weights drawn from ``seed``."""
    name, _, option = spec.partition(":")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if name == "mlp":
            widths = tuple(int(w) for w in option.split(",")) if option else (256, 256)
            return mlp(int(np.prod(data.shape)), widths, data.classes)
        if name == "resnet18":
            return ResNet18(data.shape[0], data.classes, _width(spec, option, 64))
        if name == "vgg19":
            return vgg19(data.shape[0], data.classes, _width(spec, option, 64))
        if name == "vit":
            return ViT(data.shape, data.classes)
        if name == "charlm":
            return CharLM(data.classes, data.shape[0])
    raise ValueError(f"unknown model {spec!r}; choose one of {', '.join(MODELS)} (mlp:W1,W2 sets its widths)")


def _width(spec: str, option: str, default: int) -> int:
    """The base width of ``resnet18:W`` / ``vgg19:W`` (every layer scaled by W / 64), ``default`` without one."""
    if not option:
        return default
    if not option.isdigit() or int(option) < 1:
        raise ValueError(f"model {spec!r}: the option is a base width, a positive whole number (resnet18:16)")
    return int(option)


def mlp(inputs: int, widths: tuple[int, ...], classes: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    for a, b in zip((inputs,) + widths, widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1] if widths else inputs, classes))


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


class ResNet18(nn.Module):
    """ResNet18 in its CIFAR form (3x3 stem, no max-pool): 11.2M parameters for 10 classes at base width 64;
    ``width`` w scales every layer's channels by w / 64 (about (w / 64)^2 as many parameters)."""

    def __init__(self, channels: int = 3, classes: int = 10, width: int = 64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        blocks, cin = [], width
        for cout, stride in ((width, 1), (2 * width, 2), (4 * width, 2), (8 * width, 2)):
            blocks += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8 * width, classes))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def vgg19(channels: int = 3, classes: int = 10, width: int = 64) -> nn.Module:
    """VGG19 with batch norm in its CIFAR form (one classifier layer): 20M parameters at base width 64; ``width``
    w scales every layer's channels by w / 64."""
    plan = [v if v == "M" else v * width // 64
            for v in [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512,
                      "M"]]
    layers: list[nn.Module] = []
    cin = channels
    for v in plan:
        if v == "M":
            layers.append(nn.MaxPool2d(2, ceil_mode=True))  # ceil: small inputs (8x8 digits) keep a pixel
        else:
            layers += [nn.Conv2d(cin, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU()]
            cin = v
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


class ViT(nn.Module):
    """A small vision transformer: patches of 4 (2 for inputs under 16 pixels), width 128, depth 4, 4 heads."""

    def __init__(self, shape: tuple[int, ...], classes: int, width: int = 128, depth: int = 4, heads: int = 4):
        super().__init__()
        channels, size = shape[0], shape[-1]
        patch = 4 if size >= 16 else 2
        self.embed = nn.Conv2d(channels, width, patch, patch)
        tokens = (size // patch) ** 2
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.pos = nn.Parameter(torch.randn(1, tokens + 1, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1) + self.pos
        return self.head(self.norm(self.encoder(x)[:, 0]))


class CharLM(nn.Module):
    """A causal Transformer decoder, logits for every position: token and position embeddings, pre-norm layers.
    By default the race's small one over bytes (width 128, depth 2, 4 heads); ``tied=True`` ties the head to the
    token embedding, without a bias, as GPT-2 does (``gcomp bench --overhead``'s decoder)."""

    def __init__(self, vocab: int = 256, context: int = 64, width: int = 128, depth: int = 2, heads: int = 4,
                 tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(1, context, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=not tied)
        if tied:
            self.head.weight = self.embed.weight
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x):
        n = x.size(1)
        h = self.encoder(self.embed(x) + self.pos[:, :n], mask=self.causal[:n, :n], is_causal=True)
        return self.head(self.norm(h))


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for classifiers (N, C) and language models (N, T, V) alike."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


@torch.no_grad()
def accuracy(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], batch: int = 512) -> float:
    """Top-1 accuracy (per token for a language model) on ``data``, in eval mode."""
    was_training = model.training
    model.eval()
    hits = total = 0
    for i in range(0, len(data[1]), batch):
        logits = model(data[0][i:i + batch])
        y = data[1][i:i + batch]
        hits += int((logits.argmax(-1) == y).sum())
        total += y.numel()
    model.train(was_training)
    return hits / max(total, 1)
