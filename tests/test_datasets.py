"""Datasets: the tiny ImageNet generator, the ImageNet and ImageFolder readers (local, file:// and
memory:// through fsspec), the transforms, DataLoader workers, and the TOML registry.

The tiny tree is generated once per module; its truth (which class every image
shows) comes from the generator's own functions, and decoded pixels are
compared with the generator's rendering, so a reader that pairs an image with
the wrong label fails.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

import phalanx.torch as pt
from phalanx import InvalidArgumentError
from phalanx.train import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DatasetRegistry,
    ImageFolder,
    ImageNet,
    ImageReadError,
    eval_transform,
    load_registry,
    make_tiny_imagenet,
    train_transform,
)
from phalanx.train import _tiny as tiny

CLASSES, TRAIN, VAL, SIZE, SEED = 4, 8, 4, (40, 48), 3
REPO = Path(__file__).resolve().parent.parent
TRAIN_DIR = ("ILSVRC", "Data", "CLS-LOC", "train")
VAL_DIR = ("ILSVRC", "Data", "CLS-LOC", "val")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "imagenet"
    return make_tiny_imagenet(path, classes=CLASSES, train_per_class=TRAIN, val_per_class=VAL, size=SIZE,
                              seed=SEED)


def synset_ids() -> list[str]:
    return [s for s, _ in tiny.synsets(CLASSES)]


def rendered(label: int, stream: list[int]) -> np.ndarray:
    pixels, _ = tiny.render(label, CLASSES, SIZE, np.random.default_rng([SEED, *stream]))
    return pixels.astype(np.float32)


def blocks(pixels: np.ndarray) -> np.ndarray:
    """Means of 8x8 blocks: what JPEG keeps of the pixel noise."""
    h, w, c = pixels.shape
    return pixels.reshape(h // 8, 8, w // 8, 8, c).mean(axis=(1, 3))


def assert_shows(image: torch.Tensor, expected: np.ndarray) -> None:
    """A decoded uint8 (3, H, W) image is the rendered one, up to JPEG loss."""
    assert image.dtype == torch.uint8 and tuple(image.shape) == (3, *SIZE)
    diff = np.abs(blocks(image.permute(1, 2, 0).numpy().astype(np.float32)) - blocks(expected)).mean()
    assert diff < 3, diff


def memory_copy(local: str, name: str) -> str:
    """Copy a local tree into fsspec's in-process memory filesystem; returns its URL."""
    import fsspec

    fs = fsspec.filesystem("memory")
    for dirpath, _, files in os.walk(local):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), local).replace(os.sep, "/")
            with open(os.path.join(dirpath, f), "rb") as src:
                fs.pipe(f"/{name}/{rel}", src.read())
    return f"memory://{name}"


def relative(samples: list[tuple[str, int]], prefix: str) -> list[tuple[str, int]]:
    out = []
    for path, label in samples:
        assert path.startswith(prefix), (path, prefix)
        out.append((path[len(prefix):].lstrip("/").replace(os.sep, "/"), label))
    return out


# -- the tiny tree -------------------------------------------------------------------------------------

def test_tiny_tree_has_the_imagenet_layout(root: str) -> None:
    mapping = Path(root, "LOC_synset_mapping.txt").read_text().splitlines()
    assert mapping[0] == "n01440764 tench, Tinca tinca" and len(mapping) == CLASSES
    assert all(re.fullmatch(r"n\d{8} \S.*", line) for line in mapping)
    for name, count in (("LOC_train_solution.csv", CLASSES * TRAIN * 3 // 4), ("LOC_val_solution.csv", CLASSES * VAL)):
        lines = Path(root, name).read_text().splitlines()
        assert lines[0] == "ImageId,PredictionString" and len(lines) == 1 + count
        for line in lines[1:]:
            image_id, prediction = line.split(",")
            synset, *box = prediction.split(" ")
            assert synset in synset_ids() and len(box) == 4
            x1, y1, x2, y2 = map(int, box)
            assert 0 <= x1 < x2 < SIZE[1] and 0 <= y1 < y2 < SIZE[0]
    for synset in synset_ids():
        files = sorted(os.listdir(os.path.join(root, *TRAIN_DIR, synset)))
        assert files == sorted(f"{synset}_{i}.JPEG" for i in range(1, TRAIN + 1))
    val = sorted(os.listdir(os.path.join(root, *VAL_DIR)))
    assert val == [f"ILSVRC2012_val_{i:08d}.JPEG" for i in range(1, CLASSES * VAL + 1)]
    with Image.open(os.path.join(root, *VAL_DIR, val[0])) as image:
        assert image.format == "JPEG" and image.size == (SIZE[1], SIZE[0]) and image.mode == "RGB"
    assert json.loads(Path(root, tiny.MARKER).read_text())["classes"] == CLASSES


def test_tiny_tree_is_deterministic_and_idempotent(root: str, tmp_path: Path) -> None:
    args = dict(classes=CLASSES, train_per_class=TRAIN, val_per_class=VAL, size=SIZE, seed=SEED)
    again = make_tiny_imagenet(tmp_path / "again", **args)
    for rel in ("LOC_val_solution.csv", "LOC_train_solution.csv",
                os.path.join(*VAL_DIR, "ILSVRC2012_val_00000003.JPEG"),
                os.path.join(*TRAIN_DIR, "n01443537", "n01443537_2.JPEG")):
        assert Path(root, rel).read_bytes() == Path(again, rel).read_bytes(), rel
    other = make_tiny_imagenet(tmp_path / "other", **{**args, "seed": SEED + 1})
    rel = os.path.join(*VAL_DIR, "ILSVRC2012_val_00000003.JPEG")
    assert Path(root, rel).read_bytes() != Path(other, rel).read_bytes()

    # a complete tree is left alone; a different one is refused
    victim = Path(again, *TRAIN_DIR, "n01440764", "n01440764_1.JPEG")
    victim.write_bytes(b"left alone")
    assert make_tiny_imagenet(tmp_path / "again", **args) == str(tmp_path / "again")
    assert victim.read_bytes() == b"left alone"
    with pytest.raises(InvalidArgumentError, match="already holds a tiny ImageNet"):
        make_tiny_imagenet(tmp_path / "again", **{**args, "classes": 2})
    # an interrupted tree (no marker) is completed
    os.remove(Path(again, tiny.MARKER))
    make_tiny_imagenet(tmp_path / "again", **args)
    assert victim.read_bytes() == Path(root, *TRAIN_DIR, "n01440764", "n01440764_1.JPEG").read_bytes()
    assert not [p for p in Path(again).rglob("*") if ".tmp-" in p.name]


def test_tiny_tree_arguments_are_checked(tmp_path: Path) -> None:
    for kwargs, match in [({"classes": 0}, "classes"), ({"classes": 1001}, "classes"),
                          ({"train_per_class": 0}, "train_per_class"), ({"size": (8, 64)}, "size"),
                          ({"seed": -1}, "seed"), ({"val_per_class": 1.5}, "val_per_class")]:
        with pytest.raises(InvalidArgumentError, match=match):
            make_tiny_imagenet(tmp_path / "x", **kwargs)
    with pytest.raises(InvalidArgumentError, match="local directory"):
        make_tiny_imagenet("s3://bucket/tiny")
    assert [s for s, _ in tiny.synsets(22)][20:] == ["n90000020", "n90000021"]


def test_tiny_tree_command_line(tmp_path: Path) -> None:
    target = tmp_path / "cli"
    done = subprocess.run([sys.executable, "-m", "phalanx.train._tiny", str(target), "--classes", "3",
                           "--train-per-class", "2", "--val-per-class", "1", "--size", "32"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "3 classes, 6 train and 3 validation images" in done.stdout
    assert len(ImageNet(target, "train")) == 6 and len(ImageNet(target, "val")) == 3
    bad = subprocess.run([sys.executable, "-m", "phalanx.train._tiny", str(tmp_path / "bad"), "--classes", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "classes must be" in bad.stderr


# -- ImageNet ----------------------------------------------------------------------------------------

def test_imagenet_train_labels_come_from_the_folders(root: str) -> None:
    data = ImageNet(root, "train")
    assert len(data) == CLASSES * TRAIN
    assert data.classes == synset_ids() and data.class_to_idx == {s: i for i, s in enumerate(synset_ids())}
    assert data.names[0] == "tench, Tinca tinca"
    assert data.samples == sorted(data.samples, key=lambda s: (s[1], s[0]))
    for path, label in data.samples:
        synset = data.classes[label]
        assert path.startswith(os.path.join(root, *TRAIN_DIR, synset, synset + "_"))
    assert data.targets == [label for _, label in data.samples]
    for index in (0, 9, len(data) - 1):
        image, label = data[index]
        i = int(data.samples[index][0].rsplit("_", 1)[1].split(".")[0])
        assert_shows(image, rendered(label, [tiny._TRAIN, label, i]))
    assert isinstance(data[0][1], int)


def test_imagenet_val_labels_agree_with_the_generator(root: str) -> None:
    data = ImageNet(root, "val")
    truth = tiny.val_classes(CLASSES, VAL, SEED)
    assert len(data) == CLASSES * VAL and len(set(truth)) == CLASSES
    for n, (path, label) in enumerate(data.samples, 1):
        assert path == os.path.join(root, *VAL_DIR, f"ILSVRC2012_val_{n:08d}.JPEG")
        assert label == truth[n - 1]
    for index in range(0, len(data), 5):
        image, label = data[index]
        assert_shows(image, rendered(label, [tiny._VAL, index + 1]))


def test_imagenet_class_subsets_are_reindexed_in_mapping_order(root: str) -> None:
    full = ImageNet(root, "val")
    first = ImageNet(root, "val", classes=2)
    assert first.classes == synset_ids()[:2] and len(first) == 2 * VAL
    assert first.samples == [s for s in full.samples if s[1] < 2]
    picked = ImageNet(root, "val", classes=[synset_ids()[3], synset_ids()[1]])
    assert picked.classes == [synset_ids()[1], synset_ids()[3]]
    assert picked.names == [full.names[1], full.names[3]]
    assert picked.samples == [(p, {1: 0, 3: 1}[label]) for p, label in full.samples if label in (1, 3)]
    train = ImageNet(root, "train", classes=[synset_ids()[2]])
    assert len(train) == TRAIN and set(train.targets) == {0}
    with pytest.raises(InvalidArgumentError, match="unknown synset ids 'n99999999'.*known: 'n01440764'"):
        ImageNet(root, "val", classes=["n99999999"])
    with pytest.raises(InvalidArgumentError, match="out of range: there are 4 classes"):
        ImageNet(root, "val", classes=5)
    with pytest.raises(InvalidArgumentError, match="more than once"):
        ImageNet(root, "val", classes=[synset_ids()[0]] * 2)


def test_imagenet_csv_index_takes_the_listed_train_images(root: str) -> None:
    data = ImageNet(root, "train", index="csv")
    listed = {line.split(",")[0] for line in Path(root, "LOC_train_solution.csv").read_text().splitlines()[1:]}
    assert len(data) == len(listed) == CLASSES * TRAIN * 3 // 4
    assert {os.path.basename(p)[:-5] for p, _ in data.samples} == listed
    folders = ImageNet(root, "train")
    assert set(data.samples) < set(folders.samples)
    assert data.samples == sorted(data.samples, key=lambda s: (s[1], s[0]))
    assert ImageNet(root, "train", index="csv", classes=1).samples == [s for s in data.samples if s[1] == 0]


def test_imagenet_errors_say_what_is_wrong(root: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="split must be 'train' or 'val', got 'test'"):
        ImageNet(root, "test")
    with pytest.raises(InvalidArgumentError, match="index must be 'folders'"):
        ImageNet(root, index="lmdb")
    with pytest.raises(InvalidArgumentError, match="no LOC_synset_mapping.txt in .*Kaggle"):
        ImageNet(tmp_path)
    with pytest.raises(InvalidArgumentError, match="transform must be a callable"):
        ImageNet(root, transform="resize")
    with pytest.raises(InvalidArgumentError, match="storage_options=.* are for fsspec URLs"):
        ImageNet(root, storage_options={"anon": True})
    broken = shutil.copytree(root, tmp_path / "broken")
    shutil.rmtree(Path(broken, *TRAIN_DIR, "n01484850"))
    with pytest.raises(InvalidArgumentError, match="no images in .* for 'n01484850'"):
        ImageNet(broken, "train")
    assert len(ImageNet(broken, "train", classes=2)) == 2 * TRAIN
    Path(broken, *VAL_DIR, "ILSVRC2012_val_00000002.JPEG").write_bytes(b"not a jpeg")
    data = ImageNet(broken, "val")
    with pytest.raises(ImageReadError, match="ILSVRC2012_val_00000002.JPEG.*sample 1"):
        data[1]
    os.remove(Path(broken, "LOC_train_solution.csv"))
    with pytest.raises(InvalidArgumentError, match="no LOC_train_solution.csv.*index='folders'"):
        ImageNet(broken, "train", index="csv")
    Path(broken, "LOC_val_solution.csv").write_text("ImageId,PredictionString\nILSVRC2012_val_00000001,n0000 1\n")
    with pytest.raises(InvalidArgumentError, match="line 2: synset 'n0000' is not in LOC_synset_mapping.txt"):
        ImageNet(broken, "val")


# -- ImageFolder -------------------------------------------------------------------------------------

def test_image_folder_reads_a_folder_per_class(root: str, tmp_path: Path) -> None:
    top = tmp_path / "flowers"
    for name, n in (("rose", 3), ("daisy", 2), ("tulip", 1)):
        (top / name / "deeper").mkdir(parents=True)
        for i in range(n):
            Image.new("RGB", (10 + i, 8), (40 * i, 0, 0)).save(top / name / f"{i}.JPG")
        Image.new("L", (5, 5)).save(top / name / "deeper" / "extra.png")
        (top / name / "notes.txt").write_text("not an image")
    (top / "stray.jpg").write_bytes(b"outside any class")
    (top / "rose" / "._0.JPG").write_bytes(b"macOS metadata")
    (top / ".ipynb_checkpoints").mkdir()
    (top / ".ipynb_checkpoints" / "x.jpg").write_bytes(b"hidden")
    data = ImageFolder(top)
    assert data.classes == ["daisy", "rose", "tulip"] and data.class_to_idx["tulip"] == 2
    assert relative(data.samples, str(top)) == [
        ("daisy/0.JPG", 0), ("daisy/1.JPG", 0), ("daisy/deeper/extra.png", 0),
        ("rose/0.JPG", 1), ("rose/1.JPG", 1), ("rose/2.JPG", 1), ("rose/deeper/extra.png", 1),
        ("tulip/0.JPG", 2), ("tulip/deeper/extra.png", 2)]
    image, label = data[4]
    assert label == 1 and image.shape == (3, 8, 11) and image.dtype == torch.uint8
    assert tuple(data[2][0][:, 0, 0]) == (0, 0, 0) and data[2][0].shape == (3, 5, 5)  # grey -> RGB
    assert len(ImageFolder(top, extensions=(".png",))) == 3
    subset = ImageFolder(top, classes=["tulip", "daisy"])
    assert subset.classes == ["daisy", "tulip"] and set(subset.targets) == {0, 1} and len(subset) == 5

    imagenet = ImageFolder(os.path.join(root, *TRAIN_DIR))
    assert imagenet.samples == ImageNet(root, "train").samples and imagenet.classes == synset_ids()

    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgumentError, match="no class folders in"):
        ImageFolder(tmp_path / "empty")
    (tmp_path / "empty" / "cat").mkdir()
    with pytest.raises(InvalidArgumentError, match="no images .* in the class folder.* 'cat'"):
        ImageFolder(tmp_path / "empty")
    with pytest.raises(InvalidArgumentError, match="is not a directory"):
        ImageFolder(tmp_path / "missing")
    with pytest.raises(InvalidArgumentError, match="extensions must be"):
        ImageFolder(top, extensions=("jpg",))


# -- fsspec ------------------------------------------------------------------------------------------

def test_a_url_without_fsspec_is_a_missing_dependency(monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx import MissingDependencyError

    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec now fails
    monkeypatch.setitem(sys.modules, "fsspec.core", None)
    with pytest.raises(MissingDependencyError, match="needs fsspec: pip install fsspec") as info:
        ImageNet("s3://bucket/imagenet", "train")
    assert isinstance(info.value, ImportError)


def test_fsspec_urls_give_the_same_samples(root: str) -> None:
    url = memory_copy(root, "tiny-copy")
    for split, kwargs in (("train", {}), ("val", {}), ("train", {"index": "csv"}), ("train", {"classes": 2})):
        local = ImageNet(root, split, **kwargs)
        expected = relative(local.samples, root)
        for prefix in ("file://" + root, url):
            remote = ImageNet(prefix, split, **kwargs)
            assert relative(remote.samples, prefix) == expected, (prefix, split, kwargs)
            assert remote.classes == local.classes and remote.names == local.names
            for index in (0, len(local) - 1):
                assert torch.equal(remote[index][0], local[index][0])
                assert remote[index][1] == local[index][1]
    folder = ImageFolder(url + "/ILSVRC/Data/CLS-LOC/train")
    assert relative(folder.samples, url + "/ILSVRC/Data/CLS-LOC/train") == relative(
        ImageFolder(os.path.join(root, *TRAIN_DIR)).samples, os.path.join(root, *TRAIN_DIR))

    # the filesystem object is not pickled; a copy makes its own
    data = ImageNet(url, "val")
    data[0]
    copy = pickle.loads(pickle.dumps(data))
    assert copy._store._fs is None and torch.equal(copy[3][0], data[3][0])
    with pytest.raises(InvalidArgumentError, match="no LOC_synset_mapping.txt in 'memory://nothing-here'"):
        ImageNet("memory://nothing-here")


# -- transforms --------------------------------------------------------------------------------------

def photo(width: int = 120, height: int = 90, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    small = (rng.random((height // 10, width // 10, 3)) * 255).astype(np.uint8)
    return Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC)


def test_transforms_give_normalised_float_tensors() -> None:
    low = [(0 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD, strict=True)]
    high = [(1 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD, strict=True)]
    for transform in (train_transform(32), eval_transform(32), train_transform((24, 40)), eval_transform((24, 40))):
        out = transform(photo())
        assert out.dtype == torch.float32 and out.is_contiguous()
        assert tuple(out.shape) == ((3, 32, 32) if transform.size == (32, 32) else (3, 24, 40))
        for c in range(3):
            assert low[c] - 1e-5 <= out[c].min() and out[c].max() <= high[c] + 1e-5
    grey = Image.new("RGB", (50, 40), tuple(round(m * 255) for m in IMAGENET_MEAN))
    assert eval_transform(16)(grey).abs().max() < 0.01
    assert train_transform(16)(grey).abs().max() < 0.01
    plain = train_transform(8, mean=(0, 0, 0), std=(1, 1, 1))(Image.new("RGB", (20, 20), (255, 0, 51)))
    assert torch.allclose(plain[:, 3, 3], torch.tensor([1.0, 0.0, 0.2]))
    tensor_in = torch.from_numpy(np.array(photo())).permute(2, 0, 1)
    assert torch.equal(eval_transform(32)(tensor_in), eval_transform(32)(photo()))


def test_eval_transform_is_resize_then_centre_crop() -> None:
    image = photo(200, 150)
    out = eval_transform(56)(image)  # resize 64: 85 x 64, crop 56 x 56 at (14, 4)
    assert eval_transform(56).resize == 64 and eval_transform(224).resize == 256
    reference = image.resize((85, 64), Image.Resampling.BILINEAR).crop((14, 4, 70, 60))
    expected = (torch.from_numpy(np.asarray(reference, np.float32) / 255).permute(2, 0, 1)
                - torch.tensor(IMAGENET_MEAN)[:, None, None]) / torch.tensor(IMAGENET_STD)[:, None, None]
    assert (out - expected).abs().max() * 0.229 * 255 < 1.5  # within ~1 grey level
    assert torch.equal(out, eval_transform(56)(image))
    with pytest.raises(InvalidArgumentError, match="resize .* must be an int >= the crop size 56"):
        eval_transform(56, resize=50)


def test_train_transform_is_random_and_reproducible() -> None:
    image = photo()
    transform = train_transform(32)
    torch.manual_seed(7)
    first = [transform(image) for _ in range(4)]
    torch.manual_seed(7)
    again = [transform(image) for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])
    # the whole square image, flipped or not
    square = photo(64, 64)
    whole = train_transform(64, scale=(1, 1), ratio=(1, 1))
    plain = eval_transform(64, resize=64)(square)
    outs = [whole(square) for _ in range(20)]
    assert all(torch.allclose(o, plain, atol=1e-5) or torch.allclose(o, plain.flip(-1), atol=1e-5) for o in outs)
    assert any(torch.allclose(o, plain, atol=1e-5) for o in outs)
    assert any(torch.allclose(o, plain.flip(-1), atol=1e-5) for o in outs)
    assert all(torch.allclose(train_transform(64, scale=(1, 1), ratio=(1, 1), flip=False)(square), plain,
                              atol=1e-5) for _ in range(5))
    # crops stay inside the image and respect the area range
    torch.manual_seed(0)
    crop = train_transform(16, scale=(0.25, 0.5))
    for _ in range(200):
        left, top, right, bottom = crop.crop_box(120, 90)
        assert 0 <= left < right <= 120 and 0 <= top < bottom <= 90
        assert 0.2 <= (right - left) * (bottom - top) / (120 * 90) <= 0.55
    assert crop.crop_box(400, 10)[3] - crop.crop_box(400, 10)[1] == 10  # the fallback: centre, ratio-clamped


def test_transforms_pickle_and_check_arguments() -> None:
    for transform in (train_transform(24, scale=(0.5, 1)), eval_transform(24, resize=30)):
        copy = pickle.loads(pickle.dumps(transform))
        torch.manual_seed(1)
        a = transform(photo())
        torch.manual_seed(1)
        assert torch.equal(copy(photo()), a)
        assert "size=(24, 24)" in repr(copy)
    for bad, match in [(lambda: train_transform(0), "size"), (lambda: train_transform(scale=(0, 1)), "scale"),
                       (lambda: train_transform(scale=(0.9, 0.5)), "scale"), (lambda: eval_transform((1, 2, 3)), "size"),
                       (lambda: eval_transform(std=(1, 0, 1)), "std"), (lambda: train_transform(mean=(1, 2)), "mean")]:
        with pytest.raises(InvalidArgumentError, match=match):
            bad()
    with pytest.raises(InvalidArgumentError, match="expected a PIL image"):
        eval_transform(8)(np.zeros((8, 8, 3)))


# -- DataLoader workers ------------------------------------------------------------------------------

def loader_batches(data: ImageNet, context: object, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    loader = DataLoader(data, batch_size=5, num_workers=2, multiprocessing_context=context)
    return list(loader)


def test_dataloader_workers_decode_and_transform(root: str) -> None:
    data = ImageNet(root, "train", train_transform(24))
    batches = loader_batches(data, pt.dataloader_context(2), seed=3)
    assert [tuple(x.shape) for x, _ in batches[:1]] == [(5, 3, 24, 24)]
    assert torch.cat([y for _, y in batches]).tolist() == data.targets
    again = loader_batches(data, pt.dataloader_context(2), seed=3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))  # worker seeds follow torch's seed
    other = loader_batches(data, pt.dataloader_context(2), seed=4)
    assert not torch.equal(batches[0][0], other[0][0])


def test_dataloader_workers_started_by_forkserver(root: str) -> None:
    # what phalanx.torch.dataloader_context picks under MPI: the dataset must pickle
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(["torch", "phalanx.train._images"])  # workers start in ~1 s, not ~5 s
    data = ImageNet("file://" + root, "val", eval_transform(24, resize=28))
    batches = loader_batches(data, context, seed=0)
    assert torch.cat([y for _, y in batches]).tolist() == data.targets
    assert torch.equal(torch.cat([x for x, _ in batches])[7], data[7][0])


# -- the registry ------------------------------------------------------------------------------------

def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_registry_resolves_paths_and_opens_datasets(root: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    folders = tmp_path / "conf" / "data" / "folders"
    shutil.copytree(os.path.join(root, *TRAIN_DIR), folders / "training")
    shutil.copytree(os.path.join(root, *TRAIN_DIR), folders / "val")
    link = tmp_path / "conf" / "data" / "tiny"
    link.symlink_to(root)
    toml = write(tmp_path / "conf" / "datasets.toml", f"""
# datasets for the tests
[datasets.tiny]
format = "imagenet"
path = "data/tiny"
classes = 3
description = "the tiny tree"

[datasets.tiny-csv]
format = "imagenet"
path = "{root}"
index = "csv"
classes = ["n01443537", "n01440764"]

[datasets.folders]
format = "imagefolder"
path = "data/folders"
train = "training"

[datasets.remote]
format = "imagefolder"
path = "s3://bucket/flowers"
storage_options = {{ anon = true }}
""")
    monkeypatch.chdir(tmp_path)
    registry = load_registry(toml)
    assert registry.names() == ["folders", "remote", "tiny", "tiny-csv"] and list(registry) == registry.names()
    assert "tiny" in registry and "imagenet" not in registry and len(registry) == 4
    assert repr(registry) == f"DatasetRegistry({str(toml)!r}, datasets={registry.names()})"
    entry = registry.entry("tiny")
    assert entry == {"format": "imagenet", "path": str(link), "classes": 3, "description": "the tiny tree"}
    entry["classes"] = 1
    assert registry.entry("tiny")["classes"] == 3
    assert registry.entry("remote")["path"] == "s3://bucket/flowers"
    assert registry.entry("remote")["storage_options"] == {"anon": True}

    train = registry.open("tiny", "train", train_transform(16))
    assert isinstance(train, ImageNet) and train.classes == synset_ids()[:3] and len(train) == 3 * TRAIN
    assert train[0][0].shape == (3, 16, 16)
    val = registry.open("tiny", split="val")
    assert relative(val.samples, str(link)) == relative(ImageNet(root, "val", classes=3).samples, root)
    assert len(registry.open("tiny", "val", classes=1)) == VAL
    csv = registry.open("tiny-csv")
    assert csv.classes == synset_ids()[:2] and csv.index == "csv" and len(csv) == 2 * TRAIN * 3 // 4
    folder = registry.open("folders", "train")
    assert isinstance(folder, ImageFolder) and folder.root == str(folders / "training") and len(folder) == 32
    assert registry.open("folders", "val").root == str(folders / "val")
    with pytest.raises(InvalidArgumentError, match=r"no dataset 'tiny_csv' \(did you mean 'tiny-csv'\?\)"
                                                   r".*known: 'folders', 'remote', 'tiny', 'tiny-csv'"):
        registry.open("tiny_csv")
    with pytest.raises(InvalidArgumentError, match="split must be 'train' or 'val'"):
        registry.open("tiny", "test")
    with pytest.raises(InvalidArgumentError, match="unknown key 'clases'"):
        registry.open("tiny", "val", clases=2)

    # where the file is found: $PHALANX_DATASETS, else ./datasets.toml
    monkeypatch.setenv("PHALANX_DATASETS", str(toml))
    assert load_registry().names() == registry.names()
    monkeypatch.delenv("PHALANX_DATASETS")
    with pytest.raises(InvalidArgumentError, match=re.escape(str(tmp_path / "datasets.toml")) + r".*the default"):
        load_registry()
    monkeypatch.chdir(toml.parent)
    assert load_registry().entry("folders")["path"] == str(folders)
    monkeypatch.setenv("PHALANX_DATASETS", str(tmp_path / "nowhere.toml"))
    with pytest.raises(InvalidArgumentError, match=r"no dataset registry at .*nowhere.toml \(\$PHALANX_DATASETS\)"):
        load_registry()

    home = DatasetRegistry({"x": {"format": "imagefolder", "path": "~/pictures"}}, base_dir="/elsewhere")
    assert home.entry("x")["path"] == os.path.expanduser("~/pictures")
    assert DatasetRegistry({"x": {"format": "imagefolder", "path": "p"}}, base_dir="/b").entry("x")["path"] == "/b/p"


def test_registry_opens_fsspec_urls(root: str, tmp_path: Path) -> None:
    url = memory_copy(root, "registry-copy")
    registry = DatasetRegistry({
        "imagenet": {"format": "imagenet", "path": url, "classes": 2},
        "folders": {"format": "imagefolder", "path": url + "/ILSVRC/Data/CLS-LOC/", "val": "train"},
    })
    data = registry.open("imagenet", "val")
    assert relative(data.samples, url) == relative(ImageNet(root, "val", classes=2).samples, root)
    folders = registry.open("folders", "val")
    assert folders.root == url + "/ILSVRC/Data/CLS-LOC/train" and len(folders) == CLASSES * TRAIN


@pytest.mark.parametrize("text,match", [
    ("[datasets.a]\npath = 'x'\nformat = \n", r"not valid TOML: .*line 3"),
    ("[datasets.a]\nformat = 'imagenet'\n", r"\[datasets.a\] has no 'path'"),
    ("[datasets.a]\npath = 'x'\n", r"\[datasets.a\] has no 'format'"),
    ("[datasets.a]\npath = 'x'\nformat = 'image-net'\n",
     r"unknown format 'image-net' \(did you mean 'imagenet'\?\); known formats: 'imagenet', 'imagefolder'"),
    ("[datasets.a]\npath = 'x'\nformat = 'imagenet'\nclases = 3\n",
     r"\[datasets.a\]: unknown key 'clases' \(did you mean 'classes'\?\)"),
    ("[datasets.a]\npath = 'x'\nformat = 'imagenet'\ntrain = 'x'\n", r"unknown key 'train'; a 'imagenet' entry takes"),
    ("[datasets.a]\npath = 'x'\nformat = 'imagenet'\nclasses = 0\n", "classes must be"),
    ("[datasets.a]\npath = 'x'\nformat = 'imagenet'\nclasses = [1, 2]\n", "classes must be"),
    ("[datasets.a]\npath = 'x'\nformat = 'imagenet'\nindex = 'cvs'\n", r"index must be .*did you mean 'csv'"),
    ("[datasets.a]\npath = ''\nformat = 'imagenet'\n", "path must be a non-empty string"),
    ("[datasets.a]\npath = 'x'\nformat = 'imagefolder'\nval = 3\n", "val must be the val folder"),
    ("[datasets.a]\npath = 'x'\nformat = 'imagefolder'\nstorage_options = { anon = true }\n",
     "storage_options are for fsspec URLs"),
    ("[datasets.a]\npath = 's3://b/x'\nformat = 'imagefolder'\nstorage_options = 3\n",
     "storage_options must be a table"),
    ("[datasets.a]\npath = 'x'\nformat = 'imagefolder'\nextensions = 'jpg'\n", "extensions must be"),
    ("[dataset.a]\npath = 'x'\nformat = 'imagefolder'\n", r"unknown top-level key 'dataset' \(did you mean 'datasets'"),
    ("title = 'nothing'\n", "unknown top-level key 'title'"),
    ("", r"has no \[datasets.<name>\] tables"),
    ("datasets = 3\n", "'datasets' must be a table"),
    ("[datasets]\na = 3\n", r"\[datasets.a\] must be a table"),
])
def test_registry_errors_name_the_file_and_the_problem(tmp_path: Path, text: str, match: str) -> None:
    toml = write(tmp_path / "bad.toml", text)
    with pytest.raises(InvalidArgumentError, match=match) as caught:
        load_registry(toml)
    assert str(toml) in str(caught.value)


def test_example_registry(root: str, tmp_path: Path) -> None:
    example = REPO / "examples" / "datasets.toml"
    registry = load_registry(example)
    assert {"tiny-imagenet", "imagenet"} <= set(registry.names())
    entry = registry.entry("tiny-imagenet")
    assert entry["format"] == "imagenet" and entry["path"] == str(REPO / "examples" / "data" / "tiny-imagenet")
    assert registry.entry("imagenet")["format"] == "imagenet"
    # with the tree generated next to a copy of the file, the entry opens
    copy = Path(shutil.copy(example, tmp_path / "datasets.toml"))
    make_tiny_imagenet(tmp_path / "data" / "tiny-imagenet", classes=2, train_per_class=2, val_per_class=1, size=16)
    data = load_registry(copy).open("tiny-imagenet", "val", eval_transform(16))
    assert len(data) == 2 and data[0][0].shape == (3, 16, 16)
