"""The device a worker computes on (`worker.actor.resolve_device`), in real Ray tasks.

A local Ray advertises one GPU (the machine needs none), so a task can hold a GPU
that torch may or may not be able to use.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from pagefleet.cluster.app import start_local_ray, stop_local_ray
from pagefleet.worker.actor import resolve_device


@pytest.fixture(scope="module")
def ray_with_a_gpu() -> Iterator[None]:
    start_local_ray(num_cpus=1, num_gpus=1, logging_level="ERROR")
    try:
        yield
    finally:
        stop_local_ray()  # SIGKILL: Ray's own stop waits on processes that ignore SIGTERM


@ray.remote
def _resolved(device: str) -> tuple[str, list[Any]]:
    return resolve_device(device), ray.get_gpu_ids()


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1"])
def test_an_explicit_device_is_used_as_given(device: str) -> None:
    assert resolve_device(device) == device


def test_auto_computes_on_cpu_without_a_gpu_from_ray(ray_with_a_gpu: None) -> None:
    assert ray.get(_resolved.options(num_gpus=0).remote("auto"), timeout=60) == ("cpu", [])


def test_an_explicit_cpu_holding_a_ray_gpu_computes_on_cpu(ray_with_a_gpu: None) -> None:
    device, gpus = ray.get(_resolved.options(num_gpus=1).remote("cpu"), timeout=60)
    assert (device, len(gpus)) == ("cpu", 1)


def test_auto_holding_a_ray_gpu_computes_on_cuda_only_where_torch_has_cuda(ray_with_a_gpu: None) -> None:
    # On a CPU build (or a node that only advertises GPUs) that is cpu, not a worker
    # that dies on "Torch not compiled with CUDA enabled".
    device, gpus = ray.get(_resolved.options(num_gpus=1).remote("auto"), timeout=60)
    assert (device, len(gpus)) == ("cuda" if torch.cuda.is_available() else "cpu", 1)
