"""torchvision's three names that pytorch/examples' VAE uses, for a machine without torchvision,
over the Fashion-MNIST files Debian ships (/usr/share/datasets/fashion-mnist): no download.

    from fashion_mnist import datasets, transforms, save_image

* datasets.FashionMNIST(root, train=True, transform=None): torchvision's signature; items
  (transform(image), label), the image a uint8 (28, 28) tensor where torchvision gives a PIL image.
  root holds the four IDX .gz files (Debian's layout) or root/FashionMNIST/raw/ does (torchvision's).
* transforms.ToTensor(): uint8 (H, W) -> float32 (1, H, W) in [0, 1], as torchvision's.
* save_image(tensor, fp, nrow=8, padding=2): torchvision's grid (black 2-pixel gaps) as a PNG,
  written with Pillow (a shmlearn dependency); makes fp's folder if it is missing.

This is the VAE port's data change (examples/vae.py, docs/ports.md): kept here, outside the port,
so the port differs from the original by its training code only.
"""
import gzip
import os
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

DEBIAN = "/usr/share/datasets/fashion-mnist"
FILES = {True: ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         False: ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


def read_idx(path):
    """An IDX file (gzip) as a numpy array: magic 0x0000 08 D (unsigned bytes, D dimensions), D
    big-endian uint32 sizes, then the data."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes")
    dims = raw[3]
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=dims, offset=4))
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * dims)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {data.size} bytes of data for shape {shape}")
    return data.reshape(shape)


class FashionMNIST(torch.utils.data.Dataset):
    """Fashion-MNIST's train (60,000) or test (10,000) split, as torchvision.datasets.FashionMNIST."""

    def __init__(self, root=DEBIAN, train=True, transform=None, target_transform=None, download=False):
        if download:
            raise ValueError("FashionMNIST(download=True): this stand-in reads local files only "
                             f"(Debian's are in {DEBIAN})")
        folder = root if os.path.isfile(os.path.join(root, FILES[train][0])) else os.path.join(root, "FashionMNIST", "raw")
        images, labels = (os.path.join(folder, name) for name in FILES[train])
        if not os.path.isfile(images) or not os.path.isfile(labels):
            raise FileNotFoundError(f"FashionMNIST: {FILES[train][0]} and {FILES[train][1]} are in neither "
                                    f"{root} nor {os.path.join(root, 'FashionMNIST', 'raw')}")
        self.data = torch.from_numpy(read_idx(images).copy())  # (N, 28, 28) uint8
        self.targets = torch.from_numpy(read_idx(labels).astype(np.int64))
        if len(self.data) != len(self.targets):
            raise ValueError(f"FashionMNIST: {len(self.data)} images but {len(self.targets)} labels in {folder}")
        self.transform, self.target_transform = transform, target_transform
        self._labels = self.targets.tolist()  # int(self.targets[i]) costs more than the rest of an item

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        img, target = self.data[index], self._labels[index]
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target


class ToTensor:
    """uint8 (H, W) or (H, W, C) -> float32 (C, H, W) divided by 255, as torchvision's ToTensor."""

    def __call__(self, pic):
        t = torch.as_tensor(np.asarray(pic)) if not isinstance(pic, torch.Tensor) else pic
        t = t.unsqueeze(0) if t.dim() == 2 else t.permute(2, 0, 1)
        return t.float().div_(255)  # float() made a new tensor: divide it in place


def save_image(tensor, fp, nrow=8, padding=2):
    """Images (B, C, H, W) in [0, 1] as one PNG grid of `nrow` columns, `padding` black pixels
    around each, as torchvision.utils.save_image."""
    images = tensor.detach().cpu().float().clamp(0, 1)
    if images.dim() == 3:
        images = images.unsqueeze(0)
    b, c, h, w = images.shape
    cols = min(nrow, b)
    rows = -(-b // cols)
    grid = torch.zeros(c, rows * (h + padding) + padding, cols * (w + padding) + padding)
    for i in range(b):
        y, x = padding + (i // cols) * (h + padding), padding + (i % cols) * (w + padding)
        grid[:, y:y + h, x:x + w] = images[i]
    pixels = grid.mul(255).add(0.5).clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    if os.path.dirname(str(fp)):
        os.makedirs(os.path.dirname(str(fp)), exist_ok=True)
    Image.fromarray(pixels[:, :, 0] if c == 1 else pixels).save(fp)


datasets = SimpleNamespace(FashionMNIST=FashionMNIST)
transforms = SimpleNamespace(ToTensor=ToTensor)
