"""Generated gRPC modules of the `pagefleet.v1` API (source: pagefleet.proto)."""

from __future__ import annotations

from pathlib import Path

PROTO_PATH = Path(__file__).with_name("pagefleet.proto")
