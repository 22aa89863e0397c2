"""The harness that the backend contract suite (``suite.py``) drives.

A ``Harness`` says where memory lives (``device``), what the backend can do (capability flags) and
how to make agents, in this process (``make_agent``) or in another one (``spawn_peer``: a spawn
child that allocates, registers, publishes its descriptors through a pipe, serves until told to stop,
and can be paused or SIGKILLed). ``hold`` parks a transfer in the middle of its data through the
backend's test hook, so that "peer dies mid-transfer" is deterministic rather than a race.

How another backend plugs in (e.g. in ``tests/gpu/test_contract_cuda_ipc.py``)::

    class CudaIpcHarness(Harness):
        backend = "cuda_ipc"
        device = "cuda:0"
        hold_side = "client"          # or "peer", or None to skip the mid-transfer tests

    @pytest.fixture
    def harness():
        with CudaIpcHarness() as h:
            yield h

    class TestContractCudaIpc(ContractSuite):
        pass
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any, ClassVar

import numpy as np
import torch

from moriio_ray import env
from moriio_ray.transfer import (
    MemoryDesc,
    TransferAgent,
    TransferConfig,
    decode_engine_desc,
    decode_memory_desc,
    encode_desc,
)
from tests.contract.hooks import make_test_agent

_START_TIMEOUT_S = 60.0  # a spawn child imports torch before it answers
_CALL_TIMEOUT_S = 30.0


def pattern(seed: int, num_bytes: int) -> np.ndarray:
    """Deterministic random bytes: both processes can rebuild a region's expected content."""
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


class Hold:
    """A transfer parked by a test hook: ``wait_held`` until it is parked, ``release`` to let it go."""

    def __init__(self, held: threading.Event, release: threading.Event) -> None:
        self._held, self._release = held, release

    def wait_held(self, timeout_s: float) -> bool:
        return self._held.wait(timeout_s)

    def release(self) -> None:
        self._release.set()


class RemoteHold(Hold):
    """A hold inside a peer process, driven through its pipe."""

    def __init__(self, peer: PeerProcess) -> None:
        self._peer = peer

    def wait_held(self, timeout_s: float) -> bool:
        return bool(self._peer.call("wait_held", timeout_s, timeout_s=timeout_s + 5.0))

    def release(self) -> None:
        if self._peer.alive():
            self._peer.call("release")


class PeerProcess:
    """A peer agent in a spawn child, with one registered region filled with ``pattern(seed, n)``."""

    def __init__(self, backend: str, key: str, num_bytes: int, device: str, **kwargs: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_peer_main, args=(child, backend, key, num_bytes, device, kwargs), daemon=True
        )
        self.proc.start()
        child.close()
        engine_bytes, mem_bytes = self._answer(_START_TIMEOUT_S)
        self.desc = decode_engine_desc(engine_bytes)
        self.mem: MemoryDesc = decode_memory_desc(mem_bytes)

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.is_alive()

    def call(self, *cmd: Any, timeout_s: float = _CALL_TIMEOUT_S) -> Any:
        """Run a command in the child (see ``_peer_main``) and return its answer."""
        self._conn.send(cmd)
        return self._answer(timeout_s)

    def _answer(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"peer process {self.proc.pid} did not answer within {timeout_s} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer process failed: {value}")
        return value

    def pause(self) -> None:
        """Stop the whole process (SIGSTOP): a genuinely stalled peer."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the child and reap it, as a crash would."""
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(10.0)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.resume()
                self.call("stop", timeout_s=10.0)
            except (OSError, EOFError, TimeoutError, RuntimeError):
                pass  # it is killed below
        if self.proc.is_alive():
            self.kill()
        self.proc.join(10.0)
        self._conn.close()


class Harness:
    """What the contract suite needs from a backend. Subclass it and set the class attributes."""

    backend: ClassVar[str] = ""
    device: ClassVar[str] = "cpu"  # where test memory lives: "cpu" or "cuda:N"
    token_applies: ClassVar[bool] = False  # the backend refuses a peer with another cluster token
    can_pause_peer: ClassVar[bool] = False  # a SIGSTOPped peer process stalls a transfer
    # Why a peer in another process cannot be reached (e.g. an in-process fake); None: it can.
    no_peer_process: ClassVar[str | None] = None
    hold_side: ClassVar[str | None] = None  # whose hook parks a transfer: "peer", "client" or None
    config_overrides: ClassVar[dict[str, Any]] = {}
    staged: ClassVar[bool] = False  # tcp: CPU regions through the GPU staging path (tests/contract/hooks.py)

    def __init__(self) -> None:
        self._agents: list[TransferAgent] = []
        self._peers: list[PeerProcess] = []
        self._holds: list[Hold] = []

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def config(self, **overrides: Any) -> TransferConfig:
        return TransferConfig(backend=self.backend, **{**self.config_overrides, **overrides})

    def make_agent(
        self, key: str, epoch: int = 1, token: bytes | None = None, **config: Any
    ) -> TransferAgent:
        """An agent in this process, closed when the harness closes."""
        agent = make_test_agent(self.config(**config), key, epoch=epoch, token=token, staged=self.staged)
        self._agents.append(agent)
        return agent

    def region(
        self, agent: TransferAgent, num_bytes: int, seed: int | None = None
    ) -> tuple[torch.Tensor, MemoryDesc]:
        """Allocate and register ``num_bytes`` on ``device``, zeroed or filled with ``pattern(seed)``."""
        tensor = agent.allocate((num_bytes,), torch.uint8, self.device)
        if seed is not None:
            tensor.copy_(torch.from_numpy(pattern(seed, num_bytes)))
        return tensor, agent.register(tensor)

    def spawn_peer(
        self,
        key: str,
        num_bytes: int,
        *,
        epoch: int = 1,
        token: bytes | None = None,
        seed: int = 0,
        **config: Any,
    ) -> PeerProcess:
        """A peer agent in another process; it uses this process's cluster token unless told otherwise."""
        peer = PeerProcess(
            self.backend,
            key,
            num_bytes,
            self.device,
            epoch=epoch,
            token=token if token is not None else env.cluster_token(),
            seed=seed,
            config={**self.config_overrides, **config},
        )
        self._peers.append(peer)
        return peer

    def hold(self, agent: TransferAgent, peer: TransferAgent | PeerProcess, after_bytes: int) -> Hold:
        """Park the next transfer between ``agent`` and ``peer`` once ``after_bytes`` have moved."""
        target = peer if self.hold_side == "peer" else agent
        if isinstance(target, PeerProcess):
            target.call("hold", after_bytes)
            hold: Hold = RemoteHold(target)
        else:
            hold = Hold(*target.hold_after(after_bytes))  # type: ignore[attr-defined]
        self._holds.append(hold)
        return hold

    def close(self) -> None:
        for hold in self._holds:
            hold.release()
        for peer in self._peers:
            peer.stop()
        for agent in self._agents:
            agent.close()


def _peer_main(
    conn: Connection, backend: str, key: str, num_bytes: int, device: str, kwargs: dict[str, Any]
) -> None:
    """The child: one agent, one region, then commands from the pipe until ``stop``."""
    try:
        config = TransferConfig(backend=backend, **kwargs["config"])
        agent = make_test_agent(config, key, epoch=kwargs["epoch"], token=kwargs["token"])
        tensor = agent.allocate((num_bytes,), torch.uint8, device)
        tensor.copy_(torch.from_numpy(pattern(kwargs["seed"], num_bytes)))
        mem = agent.register(tensor)
        conn.send(("ok", (encode_desc(agent.engine_desc()), encode_desc(mem))))
    except Exception as exc:
        conn.send(("error", repr(exc)))
        return
    held = release = threading.Event()
    while True:
        cmd, *args = conn.recv()
        try:
            value: Any = None
            if cmd == "bytes":
                value = tensor.cpu().numpy().tobytes()
            elif cmd == "hold":
                held, release = agent.hold_after(args[0])  # type: ignore[attr-defined]
            elif cmd == "wait_held":
                value = held.wait(args[0])
            elif cmd == "release":
                release.set()
            elif cmd == "close":
                agent.close()
            elif cmd == "stop":
                agent.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", value))
        except Exception as exc:
            conn.send(("error", repr(exc)))
