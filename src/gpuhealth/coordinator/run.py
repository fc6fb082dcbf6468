"""Build and run a coordinator from its config section (the CLI's body; tests call it too).

Everything the section says reaches the server through here: the authentication policy only through
``AuthPolicy.from_config`` (node secret, TokenReview, mTLS, the shared-token opt-in, the refusal to
serve the network unauthenticated), and every address and path is checked before anything is bound
or created, so a bad one is one line naming its key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from pathlib import Path

from gpuhealth.config import CoordinatorConfig, split_address
from gpuhealth.coordinator.security import AuthPolicy
from gpuhealth.coordinator.server import CoordinatorServer, Endpoints, write_ready_file
from gpuhealth.coordinator.service import Coordinator
from gpuhealth.coordinator.store import Store, StoreError
from gpuhealth.coordinator.straggler_feed import BudgetedStragglerFeed
from gpuhealth.runtime.sdnotify import SystemdNotifier
from gpuhealth.runtime.tls import SecurityConfigError, tls_files
from gpuhealth.runtime.webconfig import WebConfigError, WebGuard

log = logging.getLogger("gpuhealth.coordinator")


class CoordinatorStartError(RuntimeError):
    """Bad credentials or TLS files, an unusable database or an address that cannot be bound; the
    message is one line naming the key."""


def check_paths(cfg: CoordinatorConfig) -> None:
    """The database's folder (and an evidence folder's parent) must exist: a typo must not become a
    folder tree nobody asked for, nor a database written where backups do not look."""
    db = Path(cfg.db_path)
    if not db.parent.is_dir():
        raise CoordinatorStartError(f"coordinator.db_path {cfg.db_path}: the folder {db.parent} does not exist "
                                    "(create it for the coordinator's user, or choose another path)")
    if cfg.evidence_dir and not Path(cfg.evidence_dir).parent.is_dir():
        raise CoordinatorStartError(f"coordinator.evidence_dir {cfg.evidence_dir}: the folder "
                                    f"{Path(cfg.evidence_dir).parent} does not exist")


def check_bindable(address: str, key: str) -> None:
    """Bind ``address`` once, without SO_REUSEPORT, and let go: an address in use, not on this host or
    not resolvable is one line naming ``key`` (gRPC would print a C-core line instead, or share the port
    with another coordinator)."""
    parts = split_address(address)
    if parts is None:
        raise CoordinatorStartError(f"{key} {address!r}: not host:port")
    host, port = parts
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CoordinatorStartError(f"{key} {address}: cannot resolve {host!r}: {exc.strerror}") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of a previous run is no conflict
        try:
            probe.bind(sockaddr)
            probe.listen(1)
        except OSError as exc:
            raise CoordinatorStartError(f"{key} {address}: cannot listen: {exc.strerror or exc}") from None


def build(cfg: CoordinatorConfig) -> CoordinatorServer:
    try:
        tls = tls_files(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
        if tls is not None:
            tls.read()  # fail now with a clear message, not on the first connection
        policy = AuthPolicy.from_config(cfg, mtls=tls is not None)
    except SecurityConfigError as exc:
        raise CoordinatorStartError(str(exc)) from exc
    check_paths(cfg)
    check_bindable(cfg.listen, "coordinator.listen")
    metrics = cfg.metrics_address()
    web = None
    if metrics is not None:
        check_bindable(metrics, "coordinator.metrics_listen")
        if cfg.metrics_web_config_file:
            try:
                web = WebGuard.open(cfg.metrics_web_config_file)
            except WebConfigError as exc:
                raise CoordinatorStartError(f"coordinator.metrics_web_config_file: {exc}") from None
    try:
        store = Store(cfg.db_path)
    except StoreError as exc:
        raise CoordinatorStartError(f"coordinator.db_path: {exc}") from exc
    budget = cfg.straggler_budget_records_s

    def factory(job_id: str) -> BudgetedStragglerFeed:
        return BudgetedStragglerFeed(job_id, budget_records_s=budget)

    coord = Coordinator(store, cfg, detector_factory=factory)
    return CoordinatorServer(coord, listen=cfg.listen, metrics_listen=metrics, policy=policy, tls=tls, metrics_web=web)


async def _ping_watchdog(notifier: SystemdNotifier) -> None:
    interval = notifier.watchdog_interval_s or 30.0
    while True:
        notifier.watchdog()
        await asyncio.sleep(interval)


async def run_coordinator(
    cfg: CoordinatorConfig,
    *,
    ready_file: str | None = None,
    install_signals: Callable[[asyncio.AbstractEventLoop, asyncio.Event], None] | None = None,
    on_ready: Callable[[Endpoints], None] | None = None,
) -> None:
    server = build(cfg)
    stop = asyncio.Event()
    try:
        endpoints = await server.start()
    except (OSError, RuntimeError, ValueError, SecurityConfigError) as exc:
        with contextlib.suppress(Exception):  # whatever did start (the gRPC port) is released
            await server.stop(0)
        server.coord.store.close()
        raise CoordinatorStartError(f"cannot start on {cfg.listen} (coordinator.listen): {exc}") from exc
    if install_signals is not None:
        install_signals(asyncio.get_running_loop(), stop)
    if ready_file:
        write_ready_file(ready_file, endpoints)
    if on_ready is not None:
        on_ready(endpoints)
    # systemd (Type=notify): ready once both ports are bound; the watchdog ping runs on the event loop,
    # so a loop that stops turning stops the pings and systemd restarts us.
    notifier = SystemdNotifier()
    metrics = f"metrics on :{endpoints.metrics_port}" if endpoints.metrics_port is not None else "metrics off"
    notifier.ready(f"gRPC on :{endpoints.grpc_port}, {metrics}")
    watchdog = asyncio.create_task(_ping_watchdog(notifier)) if notifier.watchdog_interval_s else None
    try:
        await stop.wait()
    finally:
        notifier.stopping()
        if watchdog is not None:
            watchdog.cancel()
        log.info("coordinator stopping")
        await server.stop()
        server.coord.store.close()
