"""The value types of the FAKE ``mori`` (``tests/unit/fake_mori.py``): enums, configs, statuses,
descriptors and peer-failure events, with amd-mori 1.2.4's names, fields and call shapes.

Like the engine, they are checked against the real 1.2.4 wheel by ``tests/unit/test_mori_surface.py``.
"""

from __future__ import annotations

import enum
import pickle
import threading
from dataclasses import dataclass


class BackendType(enum.Enum):
    Unknown = 0
    XGMI = 1
    RDMA = 2
    TCP = 3


class MemoryLocationType(enum.Enum):
    Unknown = 0
    CPU = 1
    GPU = 2


class StatusCode(enum.Enum):
    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_INVALID_ARGS = 4
    ERR_NOT_FOUND = 5
    ERR_RDMA_OP = 6
    ERR_BAD_STATE = 7
    ERR_GPU_OP = 8


def _failed(code: StatusCode) -> bool:
    return code.name.startswith("ERR_")  # the C++ side compares with a marker pybind does not export


class PeerFailureReason(enum.Enum):
    UNKNOWN = 0
    PEER_UNREACHABLE = 1
    LOCAL_QP_ERROR = 2
    LOCAL_PORT_DOWN = 3
    LOCAL_DEVICE_FATAL = 4
    LOCAL_CQ_ERROR = 5


@dataclass(frozen=True)
class PeerFailureEvent:
    remote_engine_key: str
    reason: PeerFailureReason
    qp_num: int
    port_num: int
    device_name: str
    detail: str


class PollCqMode(enum.Enum):
    POLLING = 0
    EVENT = 1


class BackendConfig:
    pass


class RdmaBackendConfig(BackendConfig):
    def __init__(
        self,
        qp_per_transfer: int = 1,
        post_batch_size: int = -1,
        num_worker_threads: int = -1,
        poll_cq_mode: PollCqMode = PollCqMode.POLLING,
        enable_notification: bool = True,
        notif_per_qp: int = 1024,
    ) -> None:
        if not isinstance(poll_cq_mode, PollCqMode):
            raise TypeError(f"poll_cq_mode must be a PollCqMode, got {poll_cq_mode!r}")
        self.qp_per_transfer = qp_per_transfer
        self.post_batch_size = post_batch_size
        self.num_worker_threads = num_worker_threads
        self.poll_cq_mode = poll_cq_mode
        self.enable_notification = enable_notification
        self.notif_per_qp = notif_per_qp


class XgmiBackendConfig(BackendConfig):
    def __init__(self, num_streams: int = 64, num_events: int = 64) -> None:
        self.num_streams = num_streams
        self.num_events = num_events


class IOEngineConfig:
    def __init__(self, host: str = "", port: int = 0) -> None:
        self.host = host
        self.port = port


class TransferStatus:
    def __init__(self) -> None:
        self._code = StatusCode.INIT
        self._msg = ""
        self._cond = threading.Condition()

    def Code(self) -> StatusCode:
        return self._code

    def Message(self) -> str:
        return self._msg

    def Init(self) -> bool:
        return self._code == StatusCode.INIT

    def InProgress(self) -> bool:
        return self._code == StatusCode.IN_PROGRESS

    def Succeeded(self) -> bool:
        return self._code == StatusCode.SUCCESS

    def Failed(self) -> bool:
        return _failed(self._code)

    def SetCode(self, code: StatusCode) -> None:
        with self._cond:
            self._code = code
            self._cond.notify_all()

    def SetMessage(self, msg: str) -> None:
        self._msg = msg

    def Update(self, code: StatusCode, msg: str) -> None:
        with self._cond:
            if _failed(self._code):
                return
            self._msg = msg
            self._code = code
            self._cond.notify_all()

    def Wait(self) -> None:
        self.WaitFor(-1)

    def WaitFor(self, timeout_ms: int = -1) -> StatusCode:
        with self._cond:
            self._cond.wait_for(
                lambda: self._code not in (StatusCode.INIT, StatusCode.IN_PROGRESS),
                None if timeout_ms < 0 else timeout_ms / 1000,
            )
            return self._code


@dataclass(frozen=True)
class EngineDesc:
    key: str
    hostname: str
    host: str
    port: int

    def pack(self) -> bytes:
        return pickle.dumps(("EngineDesc", self.key, self.hostname, self.host, self.port))

    @staticmethod
    def unpack(data: bytes) -> EngineDesc:
        tag, *rest = pickle.loads(bytes(data))
        if tag != "EngineDesc":
            raise TypeError(f"not a packed EngineDesc: {tag}")
        return EngineDesc(*rest)


@dataclass(frozen=True)
class MemoryDesc:
    engine_key: str
    id: int
    device_id: int
    data: int
    size: int
    loc: MemoryLocationType

    def pack(self) -> bytes:
        fields = (self.engine_key, self.id, self.device_id, self.data, self.size, self.loc.value)
        return pickle.dumps(("MemoryDesc", *fields))

    @staticmethod
    def unpack(data: bytes) -> MemoryDesc:
        tag, key, mid, dev, ptr, size, loc = pickle.loads(bytes(data))
        if tag != "MemoryDesc":
            raise TypeError(f"not a packed MemoryDesc: {tag}")
        return MemoryDesc(key, mid, dev, ptr, size, MemoryLocationType(loc))
