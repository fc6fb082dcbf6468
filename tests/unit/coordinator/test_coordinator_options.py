"""Channel settings both sides must agree on."""

from __future__ import annotations

from gpuhealth.proto import options


def test_keepalive_and_message_limits_are_aligned() -> None:
    server = dict(options.server_options())
    client = dict(options.client_options())
    # A client pinging more often than the server tolerates gets GOAWAY "too_many_pings".
    assert client["grpc.keepalive_time_ms"] >= server["grpc.http2.min_ping_interval_without_data_ms"]
    assert client["grpc.keepalive_permit_without_calls"] == server["grpc.keepalive_permit_without_calls"] == 1
    for key in ("grpc.max_receive_message_length", "grpc.max_send_message_length"):
        assert server[key] == client[key] == options.MAX_MESSAGE_BYTES
    assert server["grpc.so_reuseport"] == 0  # a second coordinator on the port fails loudly
