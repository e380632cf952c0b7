"""Sending one request's answer: whole JSON or SSE chunks, and aborting on a client disconnect.

A client that disconnects (mid-stream, or while waiting for a non-streamed
answer) cancels its request: the response watches the connection and, on
`http.disconnect`, cancels the task reading the ingress stream, whose
`finally` aborts the request on the worker (its blocks return to the pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pagefleet.cluster.api import ErrorCode, IngressError, StreamDelta
from pagefleet.cluster.errors import WIRE_STATUS
from pagefleet.cluster.openai.formatting import Choice, ResponseFormat, best, error_body

logger = logging.getLogger(__name__)


def _sse(data: Mapping[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


class GenerationResponse(Response):
    """Streams (or collects) one request's deltas; a client disconnect aborts the request.

    The status line is sent only after the first delta arrives, so errors the
    ingress raises before the first token (bad input, full queue, no worker)
    still get their HTTP status and error JSON, also for `stream: true`.
    """

    def __init__(
        self,
        deltas: AsyncGenerator[StreamDelta, None],
        fmt: ResponseFormat,
        *,
        stream: bool,
        include_usage: bool,
        candidates: int = 1,
        choices: int = 1,
    ) -> None:
        """`candidates` completions stream in; the `choices` best of them are answered
        (all of them, in order, when the two are equal)."""
        super().__init__()
        self._deltas = deltas
        self._fmt = fmt
        self._stream = stream
        self._include_usage = include_usage
        self._candidates = candidates
        self._choices = choices

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self._respond(send))
        watch = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Disconnected: cancelling `work` raises CancelledError inside the
            # ingress stream, whose `finally` aborts the request on the worker.
            for task in (work, watch):
                task.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)
        if work.done() and not work.cancelled() and work.exception() is not None:
            raise work.exception()  # type: ignore[misc]

    async def _respond(self, send: Send) -> None:
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._relay(tracked)
        except Exception as exc:
            # A bug, not a client error: still answer in OpenAI's error shape if we can.
            logger.exception("OpenAI HTTP request failed")
            if started:
                raise
            message = f"internal error: {type(exc).__name__}: {exc}"
            await _send_json(send, 500, error_body(ErrorCode.INTERNAL, message))

    async def _relay(self, send: Send) -> None:
        async with contextlib.aclosing(self._deltas) as deltas:
            try:
                first = await anext(deltas)
            except IngressError as exc:
                await _send_error(send, exc)
                return
            if self._stream:
                await self._send_stream(first, deltas, send)
            else:
                await self._send_whole(first, deltas, send)

    async def _send_whole(
        self, first: StreamDelta, deltas: AsyncIterator[StreamDelta], send: Send
    ) -> None:
        choices = [Choice(index) for index in range(self._candidates)]
        choices[first.index].add(first)
        last = first
        try:
            async for delta in deltas:
                choices[delta.index].add(delta)
                last = delta
        except IngressError as exc:
            await _send_error(send, exc)
            return
        await _send_json(send, 200, self._fmt.final(best(choices, self._choices), last))

    async def _send_stream(
        self, first: StreamDelta, deltas: AsyncIterator[StreamDelta], send: Send
    ) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),  # proxies must not buffer the stream
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def body(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        if self._fmt.chat:  # OpenAI's first chat chunk of each choice carries the role
            for index in range(self._candidates):
                await body(_sse(self._fmt.chunk("", None, index=index, first=True)))
        last = first
        try:
            delta: StreamDelta | None = first
            while delta is not None:
                last = delta
                # A token that ends inside a multi-byte character has no text yet.
                if delta.text or delta.finish_reason is not None or delta.logprobs:
                    chunk = self._fmt.chunk(
                        delta.text, delta.finish_reason, index=delta.index, logprobs=delta.logprobs
                    )
                    await body(_sse(chunk))
                delta = await anext(deltas, None)
        except IngressError as exc:  # mid-stream (e.g. no worker left after a failover)
            await body(_sse(error_body(exc.code, exc.message)))
        else:
            if self._include_usage:
                await body(_sse(self._fmt.usage_chunk(last)))
        await body(_sse("[DONE]"))
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _wait_for_disconnect(receive: Receive) -> None:
    # The body was read already, so the next message is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_json(send: Send, status: int, body: Mapping[str, Any]) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def _send_error(send: Send, exc: IngressError) -> None:
    await _send_json(send, WIRE_STATUS[exc.code].http, error_body(exc.code, exc.message))


__all__ = ["GenerationResponse"]
