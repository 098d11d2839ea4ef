"""A small vision testbed for CNN quantization: scikit-learn's bundled 8x8 digits (no download),
a MobileNet-style CNN with BatchNorm and depthwise convolutions, and image-tensor loading.

Sun et al. 2019 (HFP8) studies trans-precision inference on MobileNetV2; ``TinyMobileNet`` has the
same ingredients (BN after every conv, depthwise 3x3, inverted residuals) at a size that trains in
seconds on a CPU.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .errors import DataError, UsageError

TEST_FRACTION = 0.2
BUILTIN_ARCHITECTURE = "digits-cnn"  # TinyMobileNet
DIGITS_SPEC = "digits"  # --calib-data keyword: the digits train split
IMAGE_SUFFIXES = (".pt", ".npz")


def load_digits_data(split: str = "train", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``float32 [N, 1, 8, 8]`` standardised with the train split's mean/std, and int64
    labels. The 80/20 train/test split is a fixed permutation of ``seed``."""
    if split not in ("train", "test"):
        raise UsageError(f"split must be 'train' or 'test', got {split!r}")
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32)).unsqueeze(1)
    labels = torch.from_numpy(digits.target.astype(np.int64))
    order = torch.from_numpy(np.random.RandomState(seed).permutation(len(labels)))
    n_test = int(round(len(labels) * TEST_FRACTION))
    train_idx, test_idx = order[n_test:], order[:n_test]
    mean, std = images[train_idx].mean(), images[train_idx].std()
    idx = train_idx if split == "train" else test_idx
    return (images[idx] - mean) / std, labels[idx]


def load_image_tensors(path: str | Path) -> torch.Tensor:
    """Calibration images from ``.pt`` (a tensor, or a dict with ``images``) or ``.npz`` (key
    ``images``, else the first array), as float32 ``[N, C, ...]`` (``[N, H, W]`` gains C=1)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"image file not found: {path}")
    suffix = p.suffix.lower()
    if suffix not in (".pt", ".npz"):
        raise DataError(f"image file {path}: unsupported type {suffix or '(none)'!r}; "
                        "use .pt or .npz")
    try:
        data = _read_pt(p) if suffix == ".pt" else _read_npz(p)
    except DataError:
        raise
    except Exception as e:  # corrupt archives raise anything from pickle/zip/numpy
        raise DataError(f"cannot read image file {path}: {e}") from None
    if data.dtype == torch.bool or data.is_complex() or not (
            data.is_floating_point() or data.dtype in _INT_DTYPES):
        raise DataError(f"image file {path}: images must be real numbers, got {data.dtype}")
    if data.dim() == 3:
        data = data.unsqueeze(1)
    if data.dim() < 4 or data.shape[0] == 0:
        raise DataError(f"image file {path}: expected images [N, C, H, W] (or [N, H, W]) with "
                        f"N > 0, got shape {tuple(data.shape)}")
    data = data.float()
    if not bool(torch.isfinite(data).all()):
        raise DataError(f"image file {path}: images contain NaN or inf")
    return data


_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _read_pt(p: Path) -> torch.Tensor:
    obj = torch.load(p, map_location="cpu", weights_only=True)
    if isinstance(obj, dict):
        if "images" not in obj:
            raise DataError(f"image file {p}: dict has no 'images' key (keys: "
                            f"{', '.join(map(str, obj)) or 'none'})")
        obj = obj["images"]
    if not torch.is_tensor(obj):
        raise DataError(f"image file {p}: expected a tensor or a dict with 'images', got "
                        f"{type(obj).__name__}")
    return obj


def _read_npz(p: Path) -> torch.Tensor:
    with np.load(p, allow_pickle=False) as archive:
        if not archive.files:
            raise DataError(f"image file {p}: the archive holds no arrays")
        key = "images" if "images" in archive.files else archive.files[0]
        arr = archive[key]
    if arr.dtype.kind not in "fiu":
        raise DataError(f"image file {p}: images must be real numbers, got {arr.dtype}")
    return torch.from_numpy(np.ascontiguousarray(arr))


def image_batches(images: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Calibration batches for ``fp8ptq.execution.in_memory.quantize_model``."""
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    return list(images.split(batch_size))


def is_image_spec(spec: str | None) -> bool:
    """Whether ``--calib-data`` names images (``digits``, ``.pt``, ``.npz``) rather than text."""
    return spec is not None and (spec == DIGITS_SPEC or
                                 Path(spec).suffix.lower() in IMAGE_SUFFIXES)


@dataclass
class ImageCalibrationSet:
    """Calibration images; the text-only facts of ``fp8ptq.io.data.CalibrationSet`` are None."""

    images: torch.Tensor  # float32 [num_samples, C, H, W]
    source: str
    sha256: str  # of the images as little-endian float32
    num_samples: int
    seed: int
    seq_len: None = None
    num_tokens: None = None
    windows: None = None
    start_ids: None = None


def build_image_calibration_set(spec: str | None, *, num_samples: int,
                                seed: int = 0) -> ImageCalibrationSet:
    """``num_samples`` images (a seeded random subset when there are more) from a ``.pt`` /
    ``.npz`` file (see ``load_image_tensors``) or ``digits`` (the train split of seed 0,
    standardised as in training). Images from files are used as they are: preprocess them as the
    model expects."""
    if spec is None:
        raise UsageError(f"an image model needs --calib-data: a .pt / .npz image file or "
                         f"'{DIGITS_SPEC}'")
    if not is_image_spec(spec):
        raise DataError(f"calibration data {spec!r} is not images: pass a .pt / .npz image file "
                        f"or '{DIGITS_SPEC}'")
    images = load_digits_data("train")[0] if spec == DIGITS_SPEC else load_image_tensors(spec)
    if images.shape[0] > num_samples:
        gen = torch.Generator().manual_seed(seed)
        images = images[torch.randperm(images.shape[0], generator=gen)[:num_samples].sort().values]
    images = images.contiguous()
    digest = hashlib.sha256(images.numpy().astype("<f4").tobytes()).hexdigest()
    return ImageCalibrationSet(images, spec, digest, images.shape[0], seed)


def _conv_bn(cin: int, cout: int, kernel: int = 1, stride: int = 1, groups: int = 1,
             act: type[nn.Module] | None = nn.ReLU6) -> list[nn.Module]:
    layers = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
              nn.BatchNorm2d(cout)]
    return layers + ([act()] if act is not None else [])


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand, depthwise 3x3, linear 1x1 project (+ identity skip)."""

    def __init__(self, cin: int, cout: int, stride: int = 1, expand: int = 2):
        super().__init__()
        hidden = cin * expand
        self.block = nn.Sequential(
            *_conv_bn(cin, hidden),
            *_conv_bn(hidden, hidden, 3, stride, groups=hidden),
            *_conv_bn(hidden, cout, act=None),
        )
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.block(x)
        return x + y if self.residual else y


class TinyMobileNet(nn.Module):
    """The built-in ``digits-cnn`` architecture (``BUILTIN_ARCHITECTURE``)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 16):
        super().__init__()
        # enough to rebuild the architecture without pickling it (checkpoints, state dicts)
        self.arch_kwargs = {"num_classes": num_classes, "in_channels": in_channels,
                            "width": width}
        self.features = nn.Sequential(
            *_conv_bn(in_channels, width, 3, act=nn.ReLU),
            InvertedResidual(width, 24, stride=2),
            InvertedResidual(24, 24),
            InvertedResidual(24, 32, stride=2),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(32, num_classes)

    def forward(self, x):
        return self.classifier(self.pool(self.features(x)).flatten(1))

    @classmethod
    def from_state_dict(cls, state: dict) -> TinyMobileNet:
        """The network a ``state_dict()`` of this class describes (sizes read off the shapes)."""
        try:
            stem, head = state["features.0.weight"], state["classifier.weight"]
            model = cls(num_classes=head.shape[0], in_channels=stem.shape[1],
                        width=stem.shape[0])
            model.load_state_dict(state)
        except (KeyError, AttributeError, IndexError, RuntimeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(f"the state dict does not fit the built-in {BUILTIN_ARCHITECTURE} "
                             f"architecture: {first}") from None
        return model.eval()


def train_digits_cnn(epochs: int = 20, seed: int = 0, batch_size: int = 64,
                     lr: float = 1e-2) -> TinyMobileNet:
    """A ``TinyMobileNet`` trained on the digits train split of ``seed`` (Adam); returned in eval
    mode. A few seconds on one CPU core."""
    images, labels = load_digits_data("train", seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):  # seed the weight init, leave the global RNG alone
        torch.manual_seed(seed)
        model = TinyMobileNet()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(labels), generator=gen).split(batch_size):
            opt.zero_grad()
            loss_fn(model(images[idx]), labels[idx]).backward()
            opt.step()
        sched.step()
    return model.eval()


@torch.no_grad()
def predict(model: nn.Module, images: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """Logits in eval mode (the model's mode is restored)."""
    was_training = model.training
    model.eval()
    try:
        return torch.cat([model(x) for x in images.split(batch_size)])
    finally:
        model.train(was_training)


def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Top-1 accuracy."""
    return float((predict(model, images).argmax(-1) == labels).float().mean())


def relative_output_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """E||Z - Z_ref||^2 / E||Z_ref||^2: the quantization error at the model output."""
    return float((logits - reference).pow(2).mean() / reference.pow(2).mean())

