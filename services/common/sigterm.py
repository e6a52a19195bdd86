"""SIGTERM to a pool member's process (a Ray actor: attention service, MLP pool replica,
prefill replica) drains it instead of cutting its calls.

Kubernetes stops a worker pod with SIGTERM and, `terminationGracePeriodSeconds` later,
SIGKILL; the Helm chart's `preStop` hook sends SIGTERM to the member processes on the pod
first. `drain_on_sigterm` makes that signal mean "leave": the process goes on serving what
it has, and its `Stats` answer reports `draining`, which the gateway's pool manager
(`services.deployment.pools`) reads within a second. The manager takes the member out of
routing, places a replacement (the pool's desired size has not changed), and kills the
member once nothing is in flight there; an attention service's requests still running at
`--drain-timeout` migrate. If no manager acts (the gateway is gone too), the process exits
by itself after `timeout_s`.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

_draining = threading.Event()
_installed = False


def draining() -> bool:
    """Whether this process has been told to leave (SIGTERM)."""
    return _draining.is_set()


def drain_on_sigterm(timeout_s: float, name: str) -> bool:
    """Install the handler (once per process; from the main thread, where Python takes
    signals). Returns False when it could not be installed here."""
    global _installed
    if _installed:
        return True
    try:
        signal.signal(signal.SIGTERM, lambda signum, frame: _begin(timeout_s, name))
    except ValueError:              # not the main thread: the process keeps Ray's handler
        log.warning("%s: SIGTERM cannot be handled off the main thread; it will not drain",
                    name)
        return False
    _installed = True
    return True


def _begin(timeout_s: float, name: str) -> None:
    if _draining.is_set():
        return
    _draining.set()
    log.warning("%s: SIGTERM: draining (serving what it has; exiting within %.0f s)", name,
                timeout_s)
    threading.Thread(target=_exit_after, args=(timeout_s, name), daemon=True,
                     name="sigterm-deadline").start()


def _exit_after(timeout_s: float, name: str) -> None:
    time.sleep(timeout_s)
    log.warning("%s: still running %.0f s after SIGTERM; exiting", name, timeout_s)
    os._exit(0)


# a member that failed stop answers its callers' errors, then exits this much later
FAIL_STOP_EXIT_S = 2.0


def exit_soon(name: str, why: str, delay_s: float = FAIL_STOP_EXIT_S, code: int = 1) -> None:
    """Fail stop for a pool member's process: exit with `code` after `delay_s` (on a thread,
    so the caller returns and in-flight calls get their error first). Ray then reports the
    actor dead and the pool manager places a replacement."""
    log.critical("%s: %s; exiting in %.0f s", name, why, delay_s)

    def _exit() -> None:
        time.sleep(delay_s)
        os._exit(code)

    threading.Thread(target=_exit, daemon=True, name="fail-stop-exit").start()
