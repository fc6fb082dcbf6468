"""gRPC settings the agent and the coordinator must agree on (keepalive, message sizes).

The server refuses client pings more frequent than ``MIN_PING_INTERVAL_MS`` (GOAWAY
"too_many_pings"), so the client's ``KEEPALIVE_TIME_MS`` must not be shorter: both come from here.
"""

from __future__ import annotations

API_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a flight-recorder dump of a big job fits; larger is refused
KEEPALIVE_TIME_MS = 20_000  # client pings an idle connection this often
KEEPALIVE_TIMEOUT_MS = 10_000  # no ping ack within this → the connection is dead
SERVER_KEEPALIVE_TIME_MS = 30_000
MIN_PING_INTERVAL_MS = 10_000  # server tolerates client pings this often (≤ KEEPALIVE_TIME_MS)
UNARY_DEADLINE_S = 10.0  # every unary call carries a deadline
SESSION_METADATA = "x-gpuhealth-session"
NODE_METADATA = "x-gpuhealth-node"
TOKEN_METADATA = "authorization"  # "Bearer <token>"


def server_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 2),
        # A second coordinator on a busy port must fail, not silently share it (gRPC's default).
        ("grpc.so_reuseport", 0),
    ]


def client_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnect backoff inside gRPC stays short; our own loop adds backoff with jitter.
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", 5_000),
    ]
