"""What the running operator remembers, in one place: a ResourceState per KVCacheNamespace, and the
Controller that owns them with what is shared across resources (kvpersist.controller.runtime holds
one), whose forget() leaves nothing of a resource behind by construction. Only plain state here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpersist.controller import canary, fallback, l2key, retry
from kvpersist.controller.pincheck import PinFiles
from kvpersist.controller.policy import Policy, Refusal
from kvpersist.controller.prewarm import Prewarmer
from kvpersist.status.build import BuildBypass
from kvpersist.status.conditions import FailedCreateCheck
from kvpersist.status.usage import HitTracker, WriteFailureTracker

if TYPE_CHECKING:
    from kvpersist.controller.watchcache import WatchCache
    from kvpersist.inventory.volume import Inventory

Key = tuple[str, str]  # (namespace, name) of a KVCacheNamespace

# Refreshes run side by side, at most this many: one slow server costs its own resource a
# refresh period, never the others theirs (each call is bounded too, see kvpersist.status.usage).
REFRESH_CONCURRENCY = 8
# Hub calls (preflight, listing) are bounded (inventory_bucket.BUCKET_DEADLINE_S) but may take
# minutes for a slow Hub or a huge bucket: they run in a pool of their own, never on the refresh path.
BUCKET_WORKERS = 4
# API calls of the applies' first steps at once (a refresh thread's apply waits for its own).
APPLY_CONCURRENCY = 8


@dataclass(eq=False)
class ResourceState:
    """Everything the operator remembers about one resource. Written from the event loop and from
    worker threads, one field at a time (as the module-level tables it replaces were)."""

    # The last watch event's snapshot (None: no event seen yet, e.g. state an apply left), and the
    # namespace id its spec resolves to. Usage and health change without any event on the resource,
    # so status is polled: watch events keep this snapshot and the status loop polls it (not a kopf
    # timer: timers put a finalizer on every object, and nothing could be deleted while the operator is down).
    body: dict[str, Any] | None = None
    namespace_id: str | None = None
    # The spec object (of body) the last reconcile started from: another one is a spec to reconcile
    # (kvpersist.controller.tracking), in place of kopf's annotation, one patch of every new resource.
    reconciled_spec: dict[str, Any] | None = None
    # The last target_of answer (kvpersist.controller.reading): (spec object, its model, (key
    # fingerprint, pin check on, pin verdict), resolution).
    target_memo: tuple[Any, Any, Any, Any] | None = None
    # Its workloads changed since its last refresh (a StatefulSet or Deployment event): refreshed on
    # the status loop's next tick, so phase follows pod readiness; and when it was last refreshed.
    dirty: bool = False
    last_refresh: float = float("-inf")
    # The last age-limit pass over the claims' other namespaces (spec.l2.orphanRetention), monotonic.
    expired_at: float = float("-inf")
    # An owned child was deleted or edited by someone else (or an apply is to be tried again, or
    # vLLM is to go without the cache or back): applied again on the loop's next tick.
    drifted: bool = False
    # An apply failure the API server gave for a generation (e.g. an immutable field changed), kept
    # so the periodic refresh reports it instead of overwriting it: (generation, message).
    apply_error: tuple[int | None, str] | None = None
    # Its last apply may have left an old namespace id's Service and policy behind (set by every
    # apply, so a restarted operator checks once too); cleared when none can be left.
    routes_pending: bool = False
    # Objects the operator did not make hold some of its names (kvpersist.controller.ownership): Ready's
    # (reason, message) while nothing is applied, and when the names are to be looked at again.
    name_taken: Refusal | None = None
    name_taken_retry_at: float = float("inf")
    # What spec.vllm.modelCache declares that its existing claim does not have (made once, never
    # patched: kvpersist.builders.vllm), as last reported in a ModelCacheDiffers event.
    model_cache_differs: str | None = None
    # The generation an InferencePoolAPIMissing Warning was posted for: one event per generation.
    pool_api_missing_warned: int | None = None
    # The hfBucket preflight: (settings and the Secret's resourceVersion, when, (ok, reason, message)).
    preflight: tuple[tuple[Any, ...], float, tuple[bool, str, str]] | None = None
    # The bucket prefix's listing: (when, last good listing), and whether the last try failed.
    bucket_inventory: tuple[float, Inventory | None] | None = None
    bucket_inventory_failed: bool = False
    bucket_jobs: dict[str, concurrent.futures.Future[None]] = field(default_factory=dict)  # "preflight"/"listing"
    # The bucket token's Secret as last read ((name, key, resourceVersion), its metadata and that
    # key), kept while the Secret watch cache shows the same version (kvpersist.controller.l2runtime).
    token_secret: tuple[tuple[str, str, str | None], dict[str, Any] | None] | None = None
    # The L2 key Secret as last read (when, judged: its fingerprint or why none; never the key).
    key_read: tuple[float, l2key.KeyRead] | None = None
    # The resourceVersion of the key Secret that read saw (None: it had none): while the Secret
    # watch cache shows the same, the read stands without another request (kvpersist.controller.watchcache).
    key_read_version: str | None = None
    # The last apply's (snapshot, decision), the agent token left out of both, which the status refresh
    # decides again on (docs/design.md); and that refresh's own pair, which an idle round reuses.
    applied: tuple[Any, Any] | None = None
    redecided: tuple[Any, Any] | None = None
    # The agent token read from its Secret (when, token), and when its Secret was last found missing.
    agent_token: tuple[float, str | None] | None = None
    agent_token_version: str | None = None  # its Secret's resourceVersion at that read, as key_read_version
    token_missing_at: float = float("-inf")
    # Its servers' failed-write counts between polls (by "namespace/pod"), and why its StatefulSet
    # lacks pods (its Events, read rarely; see kvpersist.status.conditions).
    write_failures: WriteFailureTracker = field(default_factory=WriteFailureTracker)
    failed_creates: FailedCreateCheck = field(default_factory=FailedCreateCheck)
    # One refresh or apply of the resource at a time (the status loop and reconcile() share it), so
    # status is never written twice from one observation and an Event never posted twice.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def known(self) -> bool:
        """Whether a watch event has shown the resource (and it was not deleted since)."""
        return self.body is not None

    @property
    def storage_refused(self) -> str | None:
        """StorageInUse's message as last applied (another, older resource holds its claim or bucket
        prefix: kvpersist.controller.sharing): applied with the cache off."""
        return self.applied[1].storage_refused if self.applied is not None else None

    @property
    def route_taken(self) -> str | None:
        """CacheBypassed's message as last applied (another id's objects hold its route names:
        kvpersist.controller.stale_routes): applied without those routes."""
        return self.applied[1].route_taken if self.applied is not None else None


class Controller:
    """The ResourceStates by key, and what is shared across resources."""

    def __init__(self) -> None:
        self.resources: dict[Key, ResourceState] = {}
        # Trackers that keep their own per-resource tables (and locks, and tests of their own):
        # forget() calls each one's forget(key).
        self.apply_backoff = retry.Backoff()  # applies that failed transiently: tried again later, said in status
        self.fallback = fallback.Fallback()  # vLLM without the cache while a resource's servers are away
        self.build_bypass = BuildBypass()  # vLLM refused its lmcache/vLLM versions: no cache for that id
        self.hits = HitTracker()  # status.hits: totals folded from the servers' lookup counters, and the window
        # The correctness canary: its reference and checks, run in a pool of its own; a hit that changed
        # an answer keeps vLLM without the cache for that id until acknowledged (kvpersist.controller.canary).
        self.canary = canary.Canary()
        # Which images and Secrets a resource may use (the chart's allowedImages and secretLabel, set
        # by `kvpersist run` from its environment).
        self.policy = Policy()
        # Owned children, by (kind, namespace, name): the last generation seen, or for a kind
        # without one its resourceVersion (drift._mark; not per resource: dropped on the child's
        # own DELETED event).
        self.child_generations: dict[tuple[str, str, str], int | tuple[str, str]] = {}
        # Children known as a resource's own, by the same key: the uid of the KVCacheNamespace each
        # was last seen controlled by (drift watch events, the operator's own applies and creates), so
        # only names not known as its own are looked up before an apply (kvpersist.controller.ownership).
        self.child_owners: dict[tuple[str, str, str], str | None] = {}
        # Children the operator is applying right now, by the same key, with how many applies are in
        # flight: their watch events may come before the apply returns, and are then no drift.
        self.child_applying: dict[tuple[str, str, str], int] = {}
        self.gc_inflight: set[str] = set()  # gc request ids being carried out
        # Claims patched out of GitOps prunes (kvpersist.builders.retained), by (namespace, claim):
        # (resourceVersion, key fingerprint) patched, so a watch cache that lags is not patched twice;
        # and when the claims of deleted resources were last looked at.
        self.claims_protected: dict[tuple[str, str], tuple[str | None, str | None]] = {}
        self.orphan_sweep_at: float = float("-inf")
        self.gc_tasks: set[asyncio.Task[None]] = set()
        self.refresh_tasks: set[asyncio.Task[None]] = set()
        # kopf indexes of the operator's own StatefulSets, Deployments, pods and claims (see
        # kvpersist.status.workloads), by handler name; kopf hands them to the startup handler. Read
        # only in the event loop, where kopf writes them.
        self.indices: dict[str, Mapping[Any, Any]] = {}
        # Set by `kvpersist run`: the peering name (None: standalone), this process's id and priority,
        # and the namespaces it watches (kopf peers in each of them then, cluster-wide otherwise);
        # and the last verdict per peering scope (when, active).
        self.peering: dict[str, Any] = {"name": None, "identity": "", "priority": 0, "namespaces": ()}
        self.active_seen: dict[str | None, tuple[float, bool]] = {}
        # Watching named namespaces: whether this account may still LIST the cross-namespace kinds
        # cluster-wide (runtime.listing_scopes asks the API server once); None: not asked yet.
        self.lists_cluster_wide: bool | None = None
        self.refresh_pool = concurrent.futures.ThreadPoolExecutor(max_workers=REFRESH_CONCURRENCY,
                                                                  thread_name_prefix="kvp-refresh")
        # The loop's own blocking step (which replica is active) has a thread of its own: with every
        # refresh thread busy on slow servers, ticks must still come on time (and liveness stay true).
        self.tick_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvp-tick")
        # An apply's first step (Secrets and policies, side by side); its jobs never wait on the pool.
        self.apply_pool = concurrent.futures.ThreadPoolExecutor(max_workers=APPLY_CONCURRENCY, thread_name_prefix="kvp-apply")
        self.bucket_pool = concurrent.futures.ThreadPoolExecutor(max_workers=BUCKET_WORKERS, thread_name_prefix="kvp-bucket")
        self.bucket_jobs_lock = threading.Lock()  # guards each ResourceState's bucket_jobs
        # What each model's files at a commit say about its pins (kvpersist.controller.pincheck).
        self.pin_files = PinFiles()
        # spec.prewarm's passes and what they found, per resource and server (a pool of its own).
        self.prewarm = Prewarmer()
        self.last_tick: float | None = None
        self.loop_task: asyncio.Task[None] | None = None
        # Watch caches of named Secrets (metadata only) and claims (kvpersist.controller.watchcache);
        # None: not started (a glob among the watched namespaces, or a test), reads go by request.
        self.secret_cache: WatchCache | None = None
        self.claim_cache: WatchCache | None = None
        self.attached_cache: WatchCache | None = None  # users' vLLM pods labelled kvpersist.dev/attach
        self.configmap_cache: WatchCache | None = None  # metadata only: ReferencesFound
        # By kind, who holds each name of the kinds an apply names besides those (watchcache.names);
        # empty: not started, the names are looked up by request.
        self.name_caches: dict[str, WatchCache] = {}
        # The creator-rights policy as last read (kvpersist.controller.admissioncheck): (ok, reason,
        # message); None: not read yet, or the check is off.
        self.creator_rights: tuple[bool | None, str, str] | None = None
        self.creator_rights_stop: threading.Event | None = None
        # Every watched resource's L2 store (sharing.User), kept by the kvp_stores index handler
        # (kvpersist.controller.indexes), and a counter moved by each change: StorageInUse is decided
        # from these, and a resource whose store and others' have not changed is not looked at again.
        self.store_users: dict[Key, Any] = {}
        self.stores_version = 0
        self._stores: tuple[int, tuple[Any, ...]] = (-1, ())

    def state(self, key: Key) -> ResourceState:
        """The resource's state, made empty when there is none. Only for the event loop's entry
        points (a watch event, the reconcile it starts): a worker thread uses held()."""
        found = self.resources.get(key)
        return found if found is not None else self.resources.setdefault(key, ResourceState())

    def held(self, key: Key) -> ResourceState:
        """The resource's state for a worker thread, never made: a refresh or apply still running
        when its resource was forgotten gets a detached ResourceState, so what it writes goes
        nowhere instead of bringing back an empty entry nobody refreshes or forgets again."""
        found = self.resources.get(key)
        return found if found is not None else ResourceState()

    def get(self, key: Key) -> ResourceState | None:
        """The resource's state, or None; makes none."""
        return self.resources.get(key)

    def known(self) -> dict[Key, ResourceState]:
        """A copy: the resources a watch event has shown, in the order first seen."""
        return {key: st for key, st in list(self.resources.items()) if st.known}

    def note_store(self, key: Key, user: Any) -> None:
        """A resource's L2 store as its watch event shows it (sharing.User; None: none, or being
        deleted); another one moves stores_version on. In the event loop (the kvp_stores index)."""
        if self.store_users.get(key) != user:
            if user is None:
                self.store_users.pop(key, None)
            else:
                self.store_users[key] = user
            self.stores_version += 1

    def stores(self) -> tuple[Any, ...]:
        """Every resource's store: one tuple, made again only when a store changed (stores_version),
        so every refresh of a tick reads the same one. In the event loop."""
        if self._stores[0] != self.stores_version:
            self._stores = (self.stores_version, tuple(self.store_users.values()))
        return self._stores[1]

    def forget(self, key: Key) -> None:
        """Everything held about one resource, dropped in one step."""
        self.resources.pop(key, None)
        self.note_store(key, None)
        for tracker in self._trackers():
            tracker.forget(key)

    def _trackers(self) -> list[Any]:
        return [value for value in vars(self).values() if callable(getattr(value, "forget", None))]
