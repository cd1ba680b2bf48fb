"""A rank's piece of a stored tensor (``WeightReader.take(..., part=Part(dim, index, count))``, what a tensor-parallel
rank reads) is exactly that cut of the whole tensor: from safetensors (which reads only its bytes) and from a
``pytorch_model.bin``, for every dimension and piece; and from FP8 block-quantized weights, whose pieces start and
end inside 128 x 128 scale blocks, on their edges and in the partial blocks at the tensors' ends. A piece that does
not fit is refused with an error naming the key, the stored shape and the part."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tandem.models import CheckpointError
from tandem.models.loading import Part, WeightReader
from tests.models.test_fp8 import FP8_CONFIG, quantize

TENSORS = {  # shapes with several divisors along each dimension
    "a.weight": (12, 8),
    "a.bias": (12,),
    "b.weight": (4, 6, 2),
}
FP8_SHAPES = {  # [rows, columns]: partial edge blocks (320 = 2 * 128 + 64, 200 = 128 + 72)
    "q.weight": (320, 200),
    "o.weight": (256, 384),  # whole blocks only
}
FP8_CUTS = {  # key -> dim -> piece counts: pieces whose edges fall inside 128-blocks, on their edges, in edge blocks
    "q.weight": {0: (2, 4, 5, 10), 1: (2, 4, 5, 8)},  # rows by 64 (inside block 0, on 128, ...), columns by 100, 25
    "o.weight": {0: (2, 4), 1: (2, 3, 4, 6)},  # rows by 128 (on the edges), 64; columns by 192, 128, 96, 64
}


def _parts(shape: tuple[int, ...]):
    """Every piece of every even cut of every dimension of ``shape``."""
    for dim, size in enumerate(shape):
        for count in range(1, size + 1):
            if size % count == 0:
                yield from (Part(dim, index, count) for index in range(count))


def _cut(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    piece = tensor.shape[part.dim] // part.count
    return tensor.narrow(part.dim, part.index * piece, piece)


@pytest.fixture(params=["safetensors", "bin"])
def checkpoint(request, tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {key: torch.randn(shape, generator=generator) for key, shape in TENSORS.items()}
    (tmp_path / "config.json").write_text("{}")
    if request.param == "safetensors":
        save_file(tensors, tmp_path / "model.safetensors")
    else:
        torch.save(tensors, tmp_path / "pytorch_model.bin")
    return tmp_path, tensors


def test_a_part_is_the_cut_of_the_whole_tensor(checkpoint):
    path, tensors = checkpoint
    reader = WeightReader(path)
    for key, whole in tensors.items():
        for part in _parts(whole.shape):
            piece = reader.take(key, tuple(_cut(whole, part).shape), part=part)
            assert torch.equal(piece, _cut(whole, part)), (key, part)


def test_a_part_that_does_not_fit_is_refused_with_the_part(checkpoint):
    path, _ = checkpoint
    reader = WeightReader(path)
    with pytest.raises(CheckpointError, match=r"'a\.weight' \(stored \(12, 8\)\) has a part .*dim=0.* \(6, 8\), exp"):
        reader.take("a.weight", (4, 8), part=Part(0, 1, 2))  # the expected shape is a part's
    with pytest.raises(CheckpointError, match=r"'a\.weight' \(12, 8\) along dim 1: 8 does not divide over 3 ranks"):
        reader.take("a.weight", part=Part(1, 0, 3))
    for bad in (Part(2, 0, 1), Part(0, 2, 2)):  # no such dimension; no such piece
        with pytest.raises(CheckpointError, match=r"'a\.weight' \(12, 8\) has no part"):
            reader.take("a.weight", part=bad)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """FP8 weights with their block scales, and a float32 ``norm`` beside them (unquantized, as published)."""
    path = tmp_path_factory.mktemp("fp8")
    generator = torch.Generator().manual_seed(1)
    tensors = {"norm.weight": torch.randn(200, generator=generator)}
    for key, shape in FP8_SHAPES.items():
        weight, scale = quantize(torch.randn(shape, generator=generator))
        tensors |= {key: weight, key + "_scale_inv": scale}
    (path / "config.json").write_text(json.dumps({"quantization_config": FP8_CONFIG}))
    save_file(tensors, path / "model.safetensors")
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_part_is_the_cut_of_the_whole_dequantized_tensor(fp8_checkpoint, dtype):
    reader = WeightReader(fp8_checkpoint, dtype=dtype)
    for key, shape in FP8_SHAPES.items():
        whole = reader.take(key, shape)
        for dim, counts in FP8_CUTS[key].items():
            for count in counts:
                for index in range(count):
                    part = Part(dim, index, count)
                    piece = reader.take(key, tuple(_cut(whole, part).shape), part=part)
                    assert piece.dtype == dtype and torch.equal(piece, _cut(whole, part)), (key, part)
    reader.take("norm.weight", part=Part(0, 1, 2))
    reader.finish()  # the scales were read with their weights' parts
