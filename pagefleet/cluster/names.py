"""Names the cluster's parts find each other by: the Ray namespace, Serve names, actor names.

A leaf module (imports nothing of pagefleet), so the driver, the Serve
application and the membership actor share these without importing each other.
"""

from __future__ import annotations

NAMESPACE = "pagefleet"  # the Ray namespace of every named actor
APP_NAME = "pagefleet"  # the Serve application
INGRESS_NAME = "pagefleet-ingress"  # the Serve deployment of the gRPC/HTTP ingress
WORKERS_NAME = "pagefleet-workers"  # the Serve deployment that owns the workers (`serve run`)
MEMBERSHIP_NAME = "pagefleet-membership"  # the actor that owns and scales the workers
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's marker resource of the head node


def worker_actor_name(worker_id: str) -> str:
    """The named Ray actor of a worker."""
    return f"pagefleet-worker-{worker_id}"
