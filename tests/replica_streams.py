"""Streams pinned to one ingress replica: several replicas share a port (SO_REUSEPORT),
and the kernel hands each new connection to one of them."""

from __future__ import annotations

import contextlib
from typing import Any

import grpc

from pagefleet.cluster.client import build_request
from pagefleet.cluster.proto import pagefleet_pb2 as pb
from pagefleet.cluster.proto import pagefleet_pb2_grpc as pb_grpc

# The initial metadata naming the replica that serves a call.
REPLICA_KEY = "x-pagefleet-replica"


class Stream:
    """A Generate call on a fresh connection: which replica took it, and its messages."""

    def __init__(self, target: str, prompt: str | list[int], **sampling: Any) -> None:
        # A local subchannel pool: a new TCP connection per stream, which the kernel
        # hands to one of the replicas listening on the port.
        self.channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        s = pb_grpc.GenerationStub(self.channel)
        self.call = s.Generate(build_request(prompt, sampling), timeout=120)
        self.replica = dict(self.call.initial_metadata())[REPLICA_KEY]
        self.messages: list[pb.GenerateResponse] = []

    def first_token(self) -> pb.GenerateResponse:
        while not self.messages or not self.messages[-1].token_ids:
            self.messages.append(next(self.call))
        return self.messages[-1]

    def rest(self) -> list[pb.GenerateResponse]:
        self.messages += list(self.call)
        self.channel.close()
        return self.messages


def stream_on(target: str, replica: str | None, prompt: str, *, avoid: bool = False, **sampling: Any) -> Stream:
    """A stream served by `replica` (or, with `avoid`, by any other); new connections
    until the kernel hands one to it."""
    for _ in range(60):
        stream = Stream(target, prompt, **sampling)
        if replica is None or (stream.replica == replica) != avoid:
            return stream
        stream.call.cancel()
        stream.channel.close()
    raise AssertionError(f"60 connections and none reached the wanted replica ({replica}, avoid={avoid})")


def replicas_reached(target: str) -> int:
    """How many replicas 8 fresh connections reach (a dying replica's refusals skipped)."""
    replicas = set()
    for _ in range(8):
        with contextlib.suppress(grpc.RpcError):  # a connection to a dying replica
            s = Stream(target, "hello", max_tokens=1)
            s.rest()
            replicas.add(s.replica)
    return len(replicas)
