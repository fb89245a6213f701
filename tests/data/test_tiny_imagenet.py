"""Tiny ImageNet reader on a miniature tiny-imagenet-200 tree of JPEGs made with Pillow."""
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from shmlearn.data import load_dataset
from shmlearn.errors import BadInput

WNIDS = ["n02124075", "n04067472", "n01443537"]  # file order, deliberately not sorted


def save_jpeg(path: Path, color, mode="RGB", size=64):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, (size, size), color).save(path, "JPEG", quality=95)


def make_tree(root: Path) -> Path:
    """2 train images per class (solid colors), 3 val images; returns the tiny-imagenet-200 dir."""
    top = root / "tiny-imagenet-200"
    top.mkdir(parents=True)
    (top / "wnids.txt").write_text("\n".join(WNIDS) + "\n")
    for k, wnid in enumerate(WNIDS):
        for j in range(2):
            save_jpeg(top / "train" / wnid / "images" / f"{wnid}_{j}.JPEG", (80 * k, 100 * j, 200))
        (top / "train" / wnid / f"{wnid}_boxes.txt").write_text("")  # present in the real tree
    save_jpeg(top / "val" / "images" / "val_0.JPEG", (250, 0, 0))
    save_jpeg(top / "val" / "images" / "val_1.JPEG", 128, mode="L")  # some originals are grayscale
    save_jpeg(top / "val" / "images" / "val_2.JPEG", (0, 0, 250))
    (top / "val" / "val_annotations.txt").write_text(
        f"val_0.JPEG\t{WNIDS[2]}\t0\t0\t63\t63\n"
        f"val_1.JPEG\t{WNIDS[0]}\t1\t2\t30\t40\n"
        f"val_2.JPEG\t{WNIDS[1]}\t5\t5\t60\t60\n")
    return top


def pillow(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).transpose(2, 0, 1)


@pytest.mark.parametrize("parent", [True, False])
def test_reads_tree(tmp_path, parent):
    top = make_tree(tmp_path)
    ds = load_dataset("tiny-imagenet", str(tmp_path if parent else top))
    assert ds.spec.input_shape == (3, 64, 64) and ds.spec.num_outputs == 3
    assert ds.train_x.shape == (6, 3, 64, 64) and ds.train_x.dtype == torch.uint8
    assert ds.train_y.tolist() == [0, 0, 1, 1, 2, 2]  # class index = line in wnids.txt
    assert ds.test_y.tolist() == [2, 0, 1]
    # Exactly what Pillow decodes, laid out channels-first, in file order.
    train_files = [top / "train" / w / "images" / f"{w}_{j}.JPEG" for w in WNIDS for j in range(2)]
    for i, path in enumerate(train_files):
        np.testing.assert_array_equal(ds.train_x[i].numpy(), pillow(path))
    # And the colors survive (JPEG is lossy, so within a few levels).
    assert np.abs(ds.train_x[5].float().mean((1, 2)).numpy() - (160, 100, 200)).max() < 4
    assert np.abs(ds.test_x[0].float().mean((1, 2)).numpy() - (250, 0, 0)).max() < 4
    assert ds.test_x[1].float().std((1, 2)).max() < 1 and abs(float(ds.test_x[1].float().mean()) - 128) < 2
    assert len(ds.mean) == 3 and len(ds.std) == 3


def load_error(path, match):
    with pytest.raises(BadInput, match=match) as e:
        load_dataset("tiny-imagenet", str(path))
    assert "\n" not in str(e.value)


def test_bad_images(tmp_path):
    top = make_tree(tmp_path)
    bad = top / "train" / WNIDS[1] / "images" / f"{WNIDS[1]}_1.JPEG"
    bad.write_bytes(b"not a jpeg")
    load_error(top, rf"{re.escape(str(bad))}: cannot decode image")
    save_jpeg(bad, (1, 2, 3))
    bad.write_bytes(bad.read_bytes()[:300])  # cut off mid-scan
    load_error(top, rf"{re.escape(str(bad))}: cannot decode image")
    save_jpeg(bad, (1, 2, 3), size=32)
    load_error(top, rf"{re.escape(str(bad))}: image is 32x32, expected 64x64")


def test_bad_layout(tmp_path):
    load_error(tmp_path, r"tiny-imagenet: no wnids.txt in ")
    top = make_tree(tmp_path)
    annotations = top / "val" / "val_annotations.txt"
    text = annotations.read_text()
    annotations.write_text(text.replace(WNIDS[0], "n99999999"))
    load_error(top, rf"{re.escape(str(annotations))}:2: expected 'file<TAB>wnid<TAB>bbox' with a wnid from wnids.txt")
    annotations.write_text(text.replace("val_2.JPEG", "val_9.JPEG"))
    load_error(top, rf"{re.escape(str(annotations))}:3: no image .*val_9.JPEG")
    annotations.unlink()
    load_error(top, rf"{re.escape(str(annotations))}: cannot read")
    (top / "train" / WNIDS[2] / "images").rename(top / "elsewhere")
    load_error(top, "tiny-imagenet: no folder " + re.escape(str(top / "train" / WNIDS[2] / "images")))
    with pytest.raises(BadInput, match="--data-dir: tiny-imagenet needs a --data-dir"):
        load_dataset("tiny-imagenet")
