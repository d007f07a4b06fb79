"""CUDA-only checks (skipped without a GPU): the same bit-exactness as on the CPU, through the side
stream, events and pinned memory of :mod:`soup_plugin_streaming.cuda`. ``cuda_check.py`` runs these and
two larger cases as one script."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _needs_cuda():
    import torch  # here, not at collection: collecting the whole repository must not import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _check_module():
    spec = importlib.util.spec_from_file_location(
        "soup_streaming_cuda_check", Path(__file__).with_name("cuda_check.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMALL = [
    "llama fp32 ram pinned 2 buffers",
    "qwen2 bf16 disk 3 buffers",
    "mistral bf16 ram pageable 2 buffers",
    "tied llama fp32 disk pageable",
    "llama nf4+dq bf16 ram 2 buffers",
    "qwen2 nf4 fp32 disk 3 buffers",
]


@pytest.mark.parametrize("case", SMALL)
def test_streamed_equals_resident_on_cuda(case, tmp_path, monkeypatch):
    import torch

    module = _check_module()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cuda.matmul.allow_tf32 = False
    results = module.run_case(case, module.CASES[case], tmp_path, "cuda")
    failed = [(check, detail) for check, ok, detail in results if not ok]
    assert not failed, failed


def test_pinning_and_the_copy_stream(checkpoints, store_root):
    import torch

    from soup_plugin_streaming import testing
    from soup_plugin_streaming.cuda import CudaTransfer, host_allocator

    allocate, outcome = host_allocator(True, print, what="test")
    assert allocate((4, 4), torch.float32).is_pinned() and outcome == ["pinned"]
    allocate, outcome = host_allocator(False, print, what="test")
    assert not allocate((4,), torch.float32).is_pinned() and outcome == ["pageable"]
    s, runtime = testing.streamed(checkpoints["llama"], store_root, device="cuda", tier="ram", pin=True)
    transfer = runtime.pool.transfer
    assert isinstance(transfer, CudaTransfer) and transfer.stream != torch.cuda.current_stream()
    assert all(t.is_pinned() for t in runtime.store.host(0).values())
    ids = testing.batch(s.config.vocab_size, device="cuda")
    s(input_ids=ids, labels=ids).loss.backward()
    assert runtime.pool.stats["loads"] == 4 and all(e.query() for e in transfer.events)
