"""What Horovod's Ray examples take from torchvision and TensorBoard, for a machine with
neither (and no network): ``datasets.MNIST`` is scikit-learn's bundled digits (8x8, 1797
images) scaled up to MNIST's 28x28, the first 1500 for training and the rest for testing;
``transforms`` has the two transforms the examples use; ``SummaryWriter`` writes each
scalar as a line of JSON in ``{logdir}/scalars.jsonl``."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch

TRAIN_IMAGES = 1500


class MNIST(torch.utils.data.Dataset):
    """torchvision's ``datasets.MNIST(root, train=, download=, transform=)``: each item an
    image (a 28x28 ``uint8`` array, as a PIL image would give ``ToTensor``) and its digit."""

    def __init__(self, root, train=True, download=False, transform=None):
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
        images = torch.nn.functional.interpolate(images, size=(28, 28), mode="bilinear")
        images = (images.squeeze(1) * 255).round().to(torch.uint8)
        labels = torch.tensor(digits.target)
        part = slice(None, TRAIN_IMAGES) if train else slice(TRAIN_IMAGES, None)
        self.data, self.targets, self.transform = images[part], labels[part], transform

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        image = self.data[index].numpy()
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[index])


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, image):
        for transform in self.transforms:
            image = transform(image)
        return image


class ToTensor:
    """An HxW ``uint8`` array to a 1xHxW float tensor in [0, 1]."""

    def __call__(self, image):
        return torch.from_numpy(image).float().div(255).unsqueeze(0)


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = mean[0], std[0]

    def __call__(self, tensor):
        return (tensor - self.mean) / self.std


datasets = SimpleNamespace(MNIST=MNIST)
transforms = SimpleNamespace(Compose=Compose, ToTensor=ToTensor, Normalize=Normalize)


class SummaryWriter:
    """TensorBoard's ``SummaryWriter(logdir)``, for ``add_scalar`` only."""

    def __init__(self, logdir):
        os.makedirs(logdir, exist_ok=True)
        self.path = os.path.join(logdir, "scalars.jsonl")

    def add_scalar(self, tag, value, step):
        with open(self.path, "a") as out:
            out.write(json.dumps({"tag": tag, "value": float(value), "step": step}) + "\n")
