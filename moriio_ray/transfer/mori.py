"""The ``mori`` backend: a thin adapter over AMD's ``mori.io.IOEngine`` (RDMA or XGMI).

One IOEngine per agent, keyed by engine key + epoch + pid and bound to the node IP on port 0.
``register`` is ``register_torch_tensor``; descriptors carry MoRI's packed ``EngineDesc`` and
``MemoryDesc`` bytes; ``connect``/``disconnect`` are ``register_remote_engine`` /
``deregister_remote_engine``; each request is one ``batch_read``/``batch_write`` on a session cached
per (local region, remote region) pair.

Reaching other hosts: ``same_host_only`` is False because ``rdma`` reaches any host. ``xgmi`` moves
data over the GPU fabric of one host only, so ``connect`` refuses an xgmi peer on another host
with ``IncompatiblePeer`` (the flag is per class, the choice per config).

Dead peers: besides the coordinator's disconnect, the agent asks MoRI itself. While a transfer is
waited on (or polled with ``done()``), it drains ``IOEngine.pop_peer_failure()`` and checks the
transfer's sessions with ``alive()``; a failure naming a peer fails that peer's in-flight transfers
with ``PeerLost`` at once, instead of at ``transfer.timeout_s``.

Not run on AMD hardware here: it is written against amd-mori 1.2.4, its names are checked against
the API read from the real 1.2.4 wheel, and its logic is tested with a fake ``mori`` module.
"""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar

import torch

from moriio_ray.config import MoriConfig
from moriio_ray.errors import (
    BackendUnavailable,
    IncompatiblePeer,
    PeerLost,
    StaleDescriptor,
    TransferError,
)
from moriio_ray.transfer.base import Local, TransferAgent
from moriio_ray.transfer.desc import EngineDesc, MemoryDesc
from moriio_ray.transfer.handle import FutureTransfer, Transfer
from moriio_ray.transfer.mori_api import (
    backend_config,
    backend_type,
    decode_peer_info,
    encode_peer_info,
    import_mori_io,
    mori_engine_key,
)
from moriio_ray.transfer.mori_status import MoriTransfer, make_waiter, peer_failure_error
from moriio_ray.transfer.plan import TransferPlan

# (local mem_id, remote engine key, remote epoch, remote mem_id)
SessionKey = tuple[int, str, int, int]

_POLL_EVERY_S = 0.005  # how often done()/wait() ask MoRI for peer failures, at most
_MAX_EVENTS_PER_POLL = 64


class MoriAgent(TransferAgent):
    """A transfer agent on ``mori.io``; ``transfer.mori.backend`` picks rdma or xgmi."""

    name: ClassVar[str] = "mori"
    same_host_only: ClassVar[bool] = False  # rdma: any host; xgmi: refused across hosts in connect
    memory_kinds: ClassVar[frozenset[str]] = frozenset({"cuda"})  # ROCm torch calls HIP devices "cuda"
    checks_remote_bounds: ClassVar[bool] = True  # against the size the owner registered with MoRI

    def __init__(self, config: Any, key: str, *, epoch: int = 1, token: bytes | None = None) -> None:
        super().__init__(config, key, epoch=epoch, token=token)
        self._mori = import_mori_io()
        self.mori_config: MoriConfig = config.mori
        self.mori_key = mori_engine_key(key, epoch, self._pid())
        try:
            self._engine: Any = self._mori.IOEngine(
                self.mori_key, self._mori.IOEngineConfig(host=self._host(), port=0)
            )
            self._engine.create_backend(
                backend_type(self._mori, self.mori_config), backend_config(self._mori, self.mori_config)
            )
        except RuntimeError as exc:
            raise BackendUnavailable(
                f"transfer.mori: MoRI could not start a {self.mori_config.backend} engine here ({exc}); "
                "check the ROCm devices (and RDMA NICs for rdma), or choose transfer.mori.backend: "
                "xgmi for engines on one host"
            ) from exc
        self._waiter = make_waiter(self._engine)
        self._poll_lock = threading.Lock()  # one thread drains MoRI's failure queue at a time
        self._next_poll_s = 0.0
        self._local: dict[int, Any] = {}  # mem_id -> mori MemoryDesc
        self._remote_engines: dict[str, Any] = {}  # peer key -> mori EngineDesc
        self._sessions: dict[SessionKey, tuple[Any, int]] = {}
        self._live: list[MoriTransfer] = []  # not yet terminal: C++ may still write their statuses

    # -- memory ---------------------------------------------------------------------------------

    def _register(self, mem_id: int, tensor: torch.Tensor) -> bytes:
        try:
            mori_mem = self._engine.register_torch_tensor(tensor)
        except RuntimeError as exc:
            raise TransferError(
                f"MoRI could not register a {tensor.numel() * tensor.element_size()}-byte region on "
                f"{tensor.device} ({exc}); register device memory from agent.allocate"
            ) from exc
        self._local[mem_id] = mori_mem
        return bytes(mori_mem.pack())

    def _deregister(self, mem_id: int) -> None:
        for skey in [k for k in self._sessions if k[0] == mem_id]:
            del self._sessions[skey]
        mori_mem = self._local.pop(mem_id, None)
        if mori_mem is not None:
            self._engine.deregister_memory(mori_mem)

    # -- peers ----------------------------------------------------------------------------------

    def _engine_backend_data(self) -> bytes:
        return encode_peer_info(self.mori_config.backend, self._engine.get_engine_desc().pack())

    def _connect(self, desc: EngineDesc) -> None:
        info = decode_peer_info(desc.key, desc.backend_data)
        mine = self.mori_config.backend
        if info.kind != mine:
            raise IncompatiblePeer(
                f"peer {desc.key!r} runs MoRI backend {info.kind!r}, this agent {mine!r}; "
                "set the same transfer.mori.backend on every engine"
            )
        if mine == "xgmi" and not self._same_machine(desc):
            raise IncompatiblePeer(
                f"peer {desc.key!r} is on host {desc.host}, and MoRI xgmi reaches only GPUs of this host "
                f"({self._host()}); use transfer.mori.backend: rdma across hosts"
            )
        try:
            mori_desc = self._mori.EngineDesc.unpack(info.engine)
            self._engine.register_remote_engine(mori_desc)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise IncompatiblePeer(
                f"peer {desc.key!r}: MoRI refused its engine descriptor ({exc}); run the same amd-mori "
                "version on every engine"
            ) from exc
        self._remote_engines[desc.key] = mori_desc

    def _disconnect(self, desc: EngineDesc, reason: PeerLost) -> None:
        self._drain_failures()  # what MoRI queued about this peer belongs to this connection
        for transfer in self._live:
            if transfer.peer_key == desc.key:
                transfer.fail(reason)
        self._drop_sessions(desc.key)
        mori_desc = self._remote_engines.pop(desc.key, None)
        if mori_desc is not None:
            self._engine.deregister_remote_engine(mori_desc)

    # -- transfers ------------------------------------------------------------------------------

    def _transfer(
        self, op: str, local: Local, peer: EngineDesc, remote_mem: MemoryDesc, plan: TransferPlan
    ) -> Transfer:
        if remote_mem.engine_key != peer.key or remote_mem.epoch != peer.epoch:
            raise StaleDescriptor(
                f"region {remote_mem.mem_id} of {remote_mem.engine_key!r} epoch {remote_mem.epoch} is not a "
                f"region of the connected peer {peer.key!r} epoch {peer.epoch}; fetch its current descriptors"
            )
        if plan.num_segments == 0:  # MoRI would leave the status of an empty batch unset
            empty = FutureTransfer(0, 0, peer.key)
            empty.set_done()
            return empty
        transfer = MoriTransfer(
            num_bytes=plan.num_bytes,
            num_segments=plan.num_segments,
            peer_key=peer.key,
            waiter=self._waiter,
            deadline_s=time.monotonic() + self.config.timeout_s,
            poll=self._poll_failures,
        )
        with self._lock:
            self._live = [t for t in self._live if not t.statuses_terminal()]
            session, remote_bytes = self._session(local.mem, remote_mem, peer)
            # the size the owner registered with MoRI, not the MemoryDesc's claim (which may be forged)
            plan.check_remote(
                remote_bytes, f"region {remote_mem.mem_id} of {peer.key!r} as registered with MoRI"
            )
            issued_all = self._issue_segments(transfer, session, op, plan)
            self._live.append(transfer)
        if issued_all:
            transfer.finish_issuing()
        return transfer

    def _issue_segments(self, transfer: MoriTransfer, session: Any, op: str, plan: TransferPlan) -> bool:
        """Issue a transfer's segments (under the agent's lock); True when all of them are issued.

        The seam of the tests' holding double (tests/contract/hooks.py), which issues a first part
        here and the rest later, and then marks the transfer issued itself."""
        self._issue_batch(transfer, session, op, plan)
        return True

    @staticmethod
    def _issue_batch(transfer: MoriTransfer, session: Any, op: str, plan: TransferPlan) -> None:
        # MoRI takes std::vector<size_t>: plain lists of ints, as vLLM's connector passes them.
        lists = (plan.local_offsets.tolist(), plan.remote_offsets.tolist(), plan.sizes.tolist())
        issue = session.batch_read if op == "read" else session.batch_write
        status = issue(*lists, session.allocate_transfer_uid())
        transfer.add_batch(status, (session, *lists))

    def _session(self, local_mem: MemoryDesc, remote_mem: MemoryDesc, peer: EngineDesc) -> tuple[Any, int]:
        """The cached (session, remote region bytes as MoRI knows them) of a region pair."""
        skey = (local_mem.mem_id, remote_mem.engine_key, remote_mem.epoch, remote_mem.mem_id)
        cached = self._sessions.get(skey)
        if cached is not None and cached[0].alive():
            return cached
        try:
            remote = self._mori.MemoryDesc.unpack(remote_mem.backend_data)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise IncompatiblePeer(
                f"region {remote_mem.mem_id} of {remote_mem.engine_key!r} carries no MoRI memory "
                f"descriptor ({exc}); it was registered by another backend"
            ) from exc
        peer_engine = self._remote_engines[peer.key]
        if remote.engine_key != peer_engine.key:
            raise StaleDescriptor(
                f"region {remote_mem.mem_id} of {peer.key!r} belongs to MoRI engine {remote.engine_key!r}, "
                f"not to the connected {peer_engine.key!r}; fetch the peer's current descriptors"
            )
        session = self._engine.create_session(self._local[local_mem.mem_id], remote)
        if session is None:
            raise IncompatiblePeer(
                f"MoRI found no route from local region {local_mem.mem_id} to region {remote_mem.mem_id} "
                f"of {remote_mem.engine_key!r}; both engines need the same transfer.mori.backend"
            )
        if not session.alive():
            self._sessions.pop(skey, None)
            raise PeerLost(
                f"MoRI's new session to {peer.key!r} is not alive (a queue pair to it failed); the peer "
                "is unreachable; the coordinator replaces a dead peer, or reconnect it once it is back"
            )
        self._sessions[skey] = (session, int(remote.size))
        return self._sessions[skey]

    def _drop_sessions(self, peer_key: str) -> None:
        for skey in [k for k in self._sessions if k[1] == peer_key]:
            del self._sessions[skey]

    # -- peer failures that MoRI reports --------------------------------------------------------

    def _poll_failures(self) -> None:
        """Drain ``pop_peer_failure()`` and check live sessions; fail what can no longer finish."""
        now_s = time.monotonic()
        if self._closed or now_s < self._next_poll_s or not self._poll_lock.acquire(blocking=False):
            return
        try:
            self._next_poll_s = now_s + _POLL_EVERY_S
            with self._lock:
                if self._closed:
                    return
                self._drain_failures()
                for transfer in self._live:
                    if transfer.forced_error is None and not transfer.sessions_alive():
                        transfer.fail(
                            PeerLost(
                                f"MoRI's session to {transfer.peer_key!r} is no longer alive (a queue "
                                "pair to it failed); the transfer cannot finish; the coordinator "
                                "replaces a dead peer, or reconnect it once it is back"
                            )
                        )
        finally:
            self._poll_lock.release()

    def _drain_failures(self) -> None:
        """Handle what ``pop_peer_failure()`` has queued (the caller holds ``self._lock``)."""
        for _ in range(_MAX_EVENTS_PER_POLL):
            event = self._engine.pop_peer_failure()
            if event is None:  # nothing observed to fail (not a promise that peers are healthy)
                return
            self._on_peer_failure(event)

    def _on_peer_failure(self, event: Any) -> None:
        remote_key = str(event.remote_engine_key)
        if not remote_key:  # a local fault (port, device): no peer is reachable through it
            error = peer_failure_error(event, None)
            for transfer in self._live:
                transfer.fail(error)
            self._sessions.clear()
            return
        peer_key = next((k for k, d in self._remote_engines.items() if d.key == remote_key), None)
        if peer_key is None:
            return  # a peer already disconnected, or a stale epoch of it
        error = peer_failure_error(event, peer_key)
        for transfer in self._live:
            if transfer.peer_key == peer_key:
                transfer.fail(error)
        self._drop_sessions(peer_key)

    def _close(self) -> None:
        # Sessions point at the engine: drop them first. Release the engine (its server port,
        # queue pairs, streams) only when no status is left that its threads could still write.
        self._sessions.clear()
        self._remote_engines.clear()
        self._live = [t for t in self._live if not t.statuses_terminal()]
        if not self._live:
            self._engine = _ClosedEngine(self.key)


class _ClosedEngine:
    """Stands in for the released IOEngine: any use says the agent is closed."""

    def __init__(self, key: str) -> None:
        self._key = key

    def __getattr__(self, name: str) -> Any:
        raise TransferError(f"agent {self._key!r} is closed; create a new agent")
