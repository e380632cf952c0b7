"""pagefleet: serve LLMs from a Ray cluster with a paged KV cache.

`from pagefleet import LLM, SamplingParams` is the offline API (`StructuredOutput`
for `SamplingParams.structured`). The names are
loaded lazily so that `import pagefleet.kernels` needs only torch and triton.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutput", "__version__"]

if TYPE_CHECKING:
    from pagefleet.worker.llm import LLM
    from pagefleet.worker.outputs import RequestOutput
    from pagefleet.worker.sampling_params import SamplingParams
    from pagefleet.worker.structured_output import StructuredOutput

_LAZY = {
    "LLM": "pagefleet.worker.llm",
    "SamplingParams": "pagefleet.worker.sampling_params",
    "RequestOutput": "pagefleet.worker.outputs",
    "StructuredOutput": "pagefleet.worker.structured_output",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagefleet' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
