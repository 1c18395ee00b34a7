"""DeviceUploader: a step's index arrays reach the device exactly, each view 16-byte aligned
(Triton specializes kernels on pointer alignment: misaligned views at batch-dependent offsets
compiled new kernel variants while serving). The CUDA path needs a GPU (run on the H200 with the
front-door benchmark); the CPU path is checked everywhere."""

import numpy as np
import pytest
import torch

from paphos.worker.input_batch import DeviceUploader


def arrays(num_seqs: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(num_seqs)
    return (
        rng.integers(0, 1000, num_seqs + 1), rng.integers(0, 1000, num_seqs),
        rng.integers(0, 1000, (num_seqs, 3)),
    )


def check(device: torch.device) -> None:
    uploader = DeviceUploader(device)
    for num_seqs in (1, 2, 3, 5, 64, 255):
        for dtype in (np.int32, np.int64):
            host = arrays(num_seqs)
            parts = uploader.upload(host, dtype)
            for part, expected in zip(parts, host, strict=True):
                assert part.device.type == device.type and part.shape == expected.shape
                assert np.array_equal(part.cpu().numpy(), expected.astype(dtype))
                if device.type == "cuda":
                    assert part.data_ptr() % 16 == 0


def test_cpu_upload_is_exact() -> None:
    check(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_upload_is_exact_and_aligned() -> None:
    check(torch.device("cuda"))
