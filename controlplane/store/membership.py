"""Agent membership from etcd: an agent exists while its lease-bound key does.

`run_once()` lists the agent keys and lets the cluster drop anyone missing (level
triggered, repairs a missed watch event); a prefix watch makes the common case fast.
"""

from __future__ import annotations

import logging
import threading
import time

from controlplane.core.cluster import Cluster
from protos.etcd_keys import AGENTS_PREFIX

log = logging.getLogger(__name__)


class MembershipWatcher:
    def __init__(self, client, cluster: Cluster, resync_seconds: float = 2.0):
        self._client = client
        self._cluster = cluster
        self.resync_seconds = resync_seconds
        self._watch_id = None

    def live_agent_ids(self) -> set[str]:
        return {
            meta.key.decode()[len(AGENTS_PREFIX) :]
            for _, meta in self._client.get_prefix(AGENTS_PREFIX, keys_only=True)
        }

    def run_once(self) -> list[str]:
        listed_at = time.time()
        gone = self._cluster.reconcile_membership(self.live_agent_ids(), listed_at)
        for agent_id in gone:
            log.info("agent %s left (lease gone)", agent_id)
        return gone

    def _on_watch(self, response) -> None:
        import pyetcd.events

        if response is None or isinstance(response, Exception):
            # the stream ended (etcd away, the client closed it): the next resync watches again
            self._watch_id = None
            return
        for event in response.events:
            if isinstance(event, pyetcd.events.DeleteEvent):
                agent_id = event.key.decode()[len(AGENTS_PREFIX) :]
                dropped = self._cluster.lease_gone(agent_id)
                if dropped is None:
                    log.info("agent %s's key was deleted but its stream is live: kept", agent_id)
                else:
                    log.info("agent %s left (key deleted), %d replicas dropped", agent_id, dropped)

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                if self._watch_id is None:
                    self._watch_id = self._client.add_watch_prefix_callback(AGENTS_PREFIX, self._on_watch)
                self.run_once()
            except Exception as exc:  # noqa: BLE001 - etcd away: keep serving from memory
                log.warning("membership resync failed: %s", exc)
                self._watch_id = None
            stop.wait(self.resync_seconds)
