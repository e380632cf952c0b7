"""The OpenAI-compatible HTTP front of an `Ingress`: completions, chat, models, health.

Like the gRPC servicer, it only translates: JSON bodies to one typed request
for `Front.submit`, ingress deltas to OpenAI response objects (or SSE
chunks), and `IngressError` codes to HTTP statuses with OpenAI-style error
JSON (`errors.WIRE_STATUS`). Authentication, tenant pools, routing,
admission, failover and aborts are the ingress's, shared with gRPC.

- `protocol`: the request bodies as pydantic models, validated into `OpenAIRequest`.
- `formatting`: response objects, usage, logprobs, error bodies.
- `streaming`: the whole or SSE answer of one request, and disconnects.
- `server`: routes and handlers, body limits, the uvicorn protocol, the socket.
"""

from pagefleet.cluster.openai.server import HttpServer, build_app, start_http_server

__all__ = ["HttpServer", "build_app", "start_http_server"]
