"""Each dequantizer against the ``gguf`` package's own reference, on tensors written with GGUFWriter.

The test quantizes random values with ``gguf.quants``, writes them into a GGUF file, reads them
back through ``GGUFFile`` and expands them with ``gguf_dequant``; the result must be bit-identical
to ``gguf.quants.dequantize`` of the same bytes, and close to the original values.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from moriio_ray.engine.gguf_dequant import dequantize
from moriio_ray.engine.gguf_file import GGUFFile
from moriio_ray.errors import ConfigError
from tests.unit.gguf_writer import encode

# type -> largest error against the float32 input, relative to the largest |value| of its 32-block
# (Q8_0 rounds to max/127, Q4_0 to max/8, Q4_1 to (max - min)/15; the scales are float16)
TOLERANCE = {QT.F32: 0.0, QT.F16: 1e-3, QT.BF16: 8e-3, QT.Q8_0: 0.005, QT.Q4_0: 0.13, QT.Q4_1: 0.07}
SHAPES = {"matrix": (6, 96), "vector": (64,)}


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, QT]]) -> GGUFFile:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (values, qtype) in tensors.items():
        writer.add_tensor(name, encode(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda t: t.name)
def test_dequantize_equals_the_gguf_reference(qtype: QT, tmp_path: Path) -> None:
    rng = np.random.default_rng(int(qtype))
    tensors = {}
    for name, shape in SHAPES.items():
        values = rng.standard_normal(shape).astype(np.float32)
        values.reshape(-1)[::37] *= 8.0  # outliers: each block's scale must come from its own values
        tensors[name] = (values, qtype)
    f = _write(tmp_path / "t.gguf", tensors)
    for name, (values, _) in tensors.items():
        ggml_type, shape = f.tensor_info(name)
        assert ggml_type == int(qtype) and shape == values.shape
        raw = f.tensor_bytes(name)
        ours = dequantize(torch.from_numpy(raw), ggml_type, shape, name)
        rows = int(np.prod(shape[:-1]))  # the reference takes [rows, bytes per row]
        reference = gguf.quants.dequantize(raw.reshape(rows, -1), qtype).reshape(shape)
        assert ours.dtype == torch.float32 and tuple(ours.shape) == shape
        np.testing.assert_array_equal(ours.numpy(), reference.astype(np.float32))
        error = np.abs(ours.numpy() - values).reshape(-1, 32)
        block_max = np.abs(values).reshape(-1, 32).max(axis=1, keepdims=True)
        assert (error <= TOLERANCE[qtype] * block_max).all()


@pytest.mark.timeout(10)
def test_unsupported_types_and_sizes_are_config_errors() -> None:
    raw = torch.zeros(84, dtype=torch.uint8)
    with pytest.raises(ConfigError, match=r"'w' has type Q2_K, which is not supported; supported: F32, F16"):
        dequantize(raw, int(QT.Q2_K), (256,), "w")
    with pytest.raises(ConfigError, match=r"Q8_0 and shape \(64,\) needs 68 bytes, the file holds 84"):
        dequantize(raw, int(QT.Q8_0), (64,), "w")
