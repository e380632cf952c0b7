"""Temporary re-export: the wire formats live in `pagefleet.worker.events`."""

from pagefleet.worker.events import *  # noqa: F403
from pagefleet.worker.events import EventDecodeError, KVEventBatch, LoadReport  # noqa: F401
