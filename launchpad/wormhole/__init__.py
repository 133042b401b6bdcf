"""The wormhole: launchpad's bulk state transfer between nodes. ``send_state`` and
``StateReceiver`` move a nested state (tensors as raw bytes, plain values as msgpack, files by
content) over parallel authenticated TCP streams with a checksum per chunk. Transports (TCP now,
RDMA later) sit behind ``transport.Transport``; callers never see sockets."""

from launchpad.wormhole.payload import File
from launchpad.wormhole.progress import Progress, TransferStats
from launchpad.wormhole.receiver import StateReceiver
from launchpad.wormhole.sender import send_state
from launchpad.wormhole.transport import TcpTransport, Transport

__all__ = ["File", "Progress", "StateReceiver", "TcpTransport", "Transport", "TransferStats", "send_state"]
