"""Typed errors. Anything a user, a peer or the network can cause raises one of these."""

from __future__ import annotations


class MoriioRayError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(MoriioRayError, ValueError):
    """A config value (or a combination of values) is invalid. The message names the field."""


class BackendUnavailable(MoriioRayError, RuntimeError):
    """The selected transfer backend cannot run here (a missing package or device)."""


class TransferError(MoriioRayError):
    """A KV transfer failed. Subclasses say why."""


class TransferTimeout(TransferError, TimeoutError):
    """A transfer did not finish within its timeout."""


class PeerLost(TransferError):
    """The peer closed, died or was replaced (its epoch moved on) while a transfer needed it."""


class SegmentOutOfBounds(TransferError, IndexError):
    """A segment lies outside its registered region. The message names the segment."""


class TokenRejected(TransferError):
    """The peer refused our cluster token."""


class StaleDescriptor(TransferError):
    """A descriptor comes from an older epoch than the one already known for that engine."""


class IncompatiblePeer(TransferError):
    """The peer uses another backend, schema version or host that this agent cannot reach."""


class CapacityError(MoriioRayError):
    """A request can never fit in the engine (prompt plus output longer than the cache or model)."""


class InvalidRequest(MoriioRayError, ValueError):
    """A request carries invalid parameters (sampling values, empty prompt, ...)."""


class RequestFailed(MoriioRayError):
    """The engine could not serve one request (a fault in its sampling or stop checks); the
    request ends with this error, and the engine goes on serving the others."""


class EngineFailed(MoriioRayError):
    """A worker's engine itself failed (a device error, out of memory): every request on it ends
    with this error, and the coordinator replaces the worker. Retry the request."""


class DeadlineExceeded(MoriioRayError, TimeoutError):
    """A remote call did not answer within its deadline."""


class RequestCancelled(MoriioRayError):
    """The request was cancelled (client disconnect or explicit cancel)."""


class Overloaded(MoriioRayError):
    """Too many requests are in flight; retry later."""
