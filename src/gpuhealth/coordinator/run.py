"""Build and run a coordinator from its config section (the CLI's body; tests call it too)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from gpuhealth.config import CoordinatorConfig
from gpuhealth.coordinator.security import AuthPolicy
from gpuhealth.coordinator.server import CoordinatorServer, Endpoints, write_ready_file
from gpuhealth.coordinator.service import Coordinator
from gpuhealth.coordinator.store import Store, StoreError
from gpuhealth.coordinator.straggler_feed import BudgetedStragglerFeed
from gpuhealth.runtime.sdnotify import SystemdNotifier
from gpuhealth.runtime.tls import SecurityConfigError, tls_files

log = logging.getLogger("gpuhealth.coordinator")


class CoordinatorStartError(RuntimeError):
    """Bad TLS files, an unusable database or an address that cannot be bound."""


def build(cfg: CoordinatorConfig) -> CoordinatorServer:
    try:
        tls = tls_files(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
        if tls is not None:
            tls.read()  # fail now with a clear message, not on the first connection
        store = Store(cfg.db_path)
    except (SecurityConfigError, StoreError) as exc:
        raise CoordinatorStartError(str(exc)) from exc
    budget = cfg.straggler_budget_records_s

    def factory(job_id: str) -> BudgetedStragglerFeed:
        return BudgetedStragglerFeed(job_id, budget_records_s=budget)

    coord = Coordinator(store, cfg, detector_factory=factory)
    metrics = None if cfg.metrics_listen in ("", "off", "none") else cfg.metrics_listen
    return CoordinatorServer(coord, listen=cfg.listen, metrics_listen=metrics,
                             policy=AuthPolicy(token=cfg.token, mtls=tls is not None,
                                               operator_token=cfg.operator_token or None,
                                               operator_names=frozenset(n.strip() for n in
                                                                        cfg.operator_names.split(",") if n.strip())),
                             tls=tls)


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
        raise CoordinatorStartError(f"cannot start: {exc}") from exc
    if install_signals is not None:
        install_signals(asyncio.get_running_loop(), stop)
    if ready_file:
        write_ready_file(ready_file, endpoints)
    if on_ready is not None:
        on_ready(endpoints)
    # systemd (Type=notify): ready once both ports are bound; the watchdog ping runs on the event loop,
    # so a loop that stops turning stops the pings and systemd restarts us.
    notifier = SystemdNotifier()
    notifier.ready(f"gRPC on :{endpoints.grpc_port}, metrics on :{endpoints.metrics_port}")
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
