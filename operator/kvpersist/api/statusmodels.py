"""status of a KVCacheNamespace: what the operator observed (kvpersist.api.status checks each patch of it)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field

from kvpersist.api.identity import BLOCK_SIZES, KV_CACHE_DTYPES, SHA256_DIGEST, Identity
from kvpersist.api.models import APIModel, list_field
from kvpersist.api.spec import L2_KINDS

Count = Annotated[int, Field(ge=0)]
NamespaceId = Annotated[str, Field(pattern=r"^kvp-[0-9a-f]{32}$")]  # kvp-<32 hex>


class Condition(APIModel):
    """A standard Kubernetes condition."""

    type: str = Field(max_length=64, description="IdentityResolved, L2Ready, LMCacheReady, VLLMReady or Ready.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(max_length=128, description="CamelCase reason for the last transition.")
    message: str = Field("", max_length=4096, description="What happened and, when something is wrong, the fix.")
    last_transition_time: datetime | None = Field(None, description="When status last changed.")
    observed_generation: int | None = Field(None, description="The generation this condition was computed from.")


class Usage(APIModel):
    """Cache usage summed over the lmcache servers, from their /status."""

    l1_used_bytes: int | None = Field(None, description="L1 bytes in use.")
    l1_capacity_bytes: int | None = Field(None, description="L1 capacity in bytes.")
    l2_used_bytes: int | None = Field(None, description="This namespace's bytes on L2: the larger of "
                                      "the servers' count and the volume's (the inventory), and with a budget never less "
                                      "than last written. The one figure the budget, the pin-change warning and "
                                      "`kvpersist status` read.")
    l2_capacity_bytes: int | None = Field(None, description="L2 capacity in bytes.")
    l2_objects: int | None = Field(None, description="This namespace's objects on L2, counted as "
                                   "l2UsedBytes is.")
    l1_used: str | None = Field(None, description="l1UsedBytes/l1CapacityBytes as kubectl get prints "
                                "them (L1-USED), e.g. 1.5Gi/8Gi: kubectl cannot format a number of bytes.")
    l2_used: str | None = Field(None, description="l2UsedBytes/l2CapacityBytes as kubectl get prints "
                                "them (L2-USED), e.g. 120Gi/500Gi.")
    measured_at: datetime | None = Field(None, description="When the servers were last asked.")


class ServerHealth(APIModel):
    """One lmcache server as last seen."""

    pod: str = Field(max_length=253, description="Pod name.")
    healthy: bool = Field(description="The server answered /status with is_healthy true.")
    message: str = Field("", max_length=1024, description="Why it is not healthy, when it is not.")


class NamespaceShare(APIModel):
    """One compatibility namespace's data on a volume or bucket, read from the data itself."""

    namespace_id: NamespaceId = Field(description="The namespace folder or prefix, kvp-<32 hex>.")
    bytes: Count = Field(description="Bytes of its objects (apparent size, as du -sb counts).")
    objects: Count = Field(description="Number of objects.")
    last_write: datetime | None = Field(None, description="When its newest object was written.")
    orphan: bool | None = Field(None, description="No KVCacheNamespace and no lmcache server uses it any more.")


class VolumeInventory(APIModel):
    """What one L2 volume (claim) or bucket prefix holds, per namespace, orphans first."""

    location: str = Field(max_length=1024, description="pvc/<claim name>, or the bucket handle.")
    pod: str | None = Field(None, max_length=253, description="The lmcache server pod whose agent read the volume.")
    other_bytes: Count | None = Field(None, description="Bytes outside any namespace folder (never touched by gc).")
    namespaces: list[NamespaceShare] = Field(default_factory=list, description="Namespaces found, orphans first, largest first.")


class InventoryStatus(APIModel):
    """Per-namespace L2 usage of this resource's volumes or bucket."""

    orphaned_namespaces: Count = Field(0, description="Namespaces with data that nothing uses any more.")
    orphaned_bytes: Count = Field(0, description="Bytes they hold: reclaimable with `kvpersist gc`.")
    volumes: list[VolumeInventory] = Field(default_factory=list, description="Each volume or bucket prefix.")
    measured_at: datetime | None = Field(None, description="When the data was last read.")


class GCStatus(APIModel):
    """The last explicit cleanup (`kvpersist gc`) asked of this resource."""

    request_id: str = Field(max_length=64, description="The request's id, from the kvpersist.dev/gc annotation.")
    namespace_id: str = Field(max_length=64, description="The namespace named for deletion.")
    outcome: Literal["Deleted", "Refused", "NotFound", "Failed"] = Field(description="Deleted, Refused, NotFound or Failed.")
    message: str = Field("", max_length=4096, description="What was deleted, or why not.")
    bytes: Count = Field(0, description="Bytes deleted.")
    objects: Count = Field(0, description="Objects deleted.")
    completed_at: datetime | None = Field(None, description="When it finished.")


Ratio = Annotated[float, Field(ge=0, le=1)]


class OtherNamespace(APIModel):
    """A folder of another namespace on the claim (status.l2.largestOtherNamespaces)."""

    namespace_id: NamespaceId = Field(description="Its folder, kvp-<32 hex>.")
    bytes: Count = Field(description="Bytes of its files.")
    objects: Count = Field(description="Number of files.")
    last_write: datetime | None = Field(None, description="When its newest file was written.")
    age_days: Count | None = Field(None, description="Whole days since then.")
    orphan: bool | None = Field(None, description="No KVCacheNamespace and no lmcache server uses it: `kvpersist gc` "
                                "deletes it.")


class L2SpaceStatus(APIModel):
    """The fullest claim's space, all namespaces counted (NVMe; from the inventory agents)."""

    location: str = Field(max_length=1024, description="pvc/<claim name> of the fullest claim.")
    claims: Count | None = Field(None, description="Distinct claims read.")
    capacity_bytes: Count | None = Field(None, description="The claim's size (its filesystem's).")
    used_bytes: Count = Field(0, description="Bytes used on it, every namespace and stray file counted.")
    other_namespaces_bytes: Count = Field(0, description="Bytes in the folders of other namespaces, over all claims.")
    other_namespaces: Count = Field(0, description="How many other namespace folders the fullest claim holds.")
    largest_other_namespaces: list[OtherNamespace] = Field(default_factory=list, max_length=5,
                                                           description="The largest few of them.")
    effective_capacity_bytes: Count | None = Field(None, description="The served namespace's trim watermark: its "
                                                   "capacity (budget, else maxCapacity) lowered to 95% of the claim less "
                                                   "what everything else on it holds.")
    scan_complete: bool | None = Field(None, description="False: the agent's bounded scan stopped early; other "
                                       "folders' figures are a lower bound.")
    orphans_removed: Count = Field(0, description="Folders removed under spec.l2.orphanRetention so far.")
    orphans_removed_bytes: Count = Field(0, description="Bytes they held.")
    last_orphan_removed: str | None = Field(None, max_length=64, description="The last one removed.")
    measured_at: datetime | None = Field(None, description="When this was computed.")


class BudgetStatus(APIModel):
    """The namespace's L2 budget (spec.l2.nvme.budget) and how much of it is used."""

    bytes: Count = Field(description="The budget in bytes; what it counts is status.usage.l2UsedBytes.")
    state: Literal["Available", "Exhausted"] = Field(description="Available, or Exhausted: new L2 writes are refused.")


class HitFigures(APIModel):
    """Tokens looked up in the cache and found there, from the lmcache servers' own lookup counters
    (lmcache_mp_lookup_{requested,hit,hit_l1,hit_l2}_tokens_total on their /metrics)."""

    lookup_tokens: Count = Field(0, description="Tokens vLLM looked up in the cache (chunk-aligned prompt prefixes).")
    hit_tokens: Count = Field(0, description="Tokens served from the cache: the prefix found in L1 or L2 "
                              "(hitTokensL1 + hitTokensL2), which vLLM loads instead of recomputing.")
    hit_tokens_l1: Count = Field(0, description="Of hitTokens: tokens L1 (host RAM) already held.")
    hit_tokens_l2: Count = Field(0, description="Of hitTokens: tokens L2 (NVMe or bucket) added beyond what L1 held.")
    hit_rate: Ratio | None = Field(None, description="hitTokens / lookupTokens as a number, e.g. 0.625; absent "
                                   "without lookups.")
    hit_rate_l1: Ratio | None = Field(None, description="hitTokensL1 / lookupTokens.")
    hit_rate_l2: Ratio | None = Field(None, description="hitTokensL2 / lookupTokens; hitRateL1 + hitRateL2 = hitRate "
                                      "(to rounding).")


class HitWindow(HitFigures):
    """The same figures over the recent window (the last 5 minutes), from samples the operator
    keeps in memory: absent until it has two, after it starts."""

    seconds: Count = Field(description="The window's length: 300, or less while the operator has run for less.")
    lookup_tokens_per_second: Count = Field(0, description="lookupTokens per second over the window.")
    hit_tokens_per_second: Count = Field(0, description="hitTokens per second over the window: served from cache.")
    restores_l2: Count = Field(0, description="Loads from L2 into L1 over the window (one per request that hit L2).")
    restore_gbps_l2: float | None = Field(None, ge=0, description="Their mean rate in GB/s (lmcache's per-load bytes over "
                                          "submit-to-done time, with the decryption): what an L2 hit costs before the "
                                          "engine has it. Absent without a load. Compare it with the GPU's rate of "
                                          "recomputing KV (docs/datapath.md): below that, L2 hits cost time.")
    restores_l1: Count = Field(0, description="Copies from L1 into the engine over the window (every hit).")
    restore_gbps_l1: float | None = Field(None, ge=0, description="Their mean rate in GB/s. Absent without a copy.")


class ServerLookups(APIModel):
    """One lmcache server's lookup counters as last read (they count from its start)."""

    pod: str = Field(max_length=253, description="Pod name.")
    started_at: datetime | None = Field(None, description="When the server process started (a change means a restart).")
    lookup_tokens: Count = Field(0, description="Tokens looked up since it started.")
    hit_tokens: Count = Field(0, description="Tokens found in L1 or L2 since it started.")
    hit_tokens_l1: Count = Field(0, description="Of hitTokens: found in L1.")
    hit_tokens_l2: Count = Field(0, description="Of hitTokens: added by L2.")


class HitStatus(HitFigures):
    """Cache hits in total (summed over servers, carried across server and operator restarts) and
    over the recent window."""

    window: HitWindow | None = Field(None, description="The last 5 minutes; absent right after the operator starts.")
    summary: str | None = Field(None, max_length=32, description="What kubectl get prints as HIT: the window's hit rate, "
                                "e.g. 81.3% (5m), else the total's, e.g. 62.5% (total).")
    since: datetime | None = Field(None, description="When the operator began counting hits for this resource.")
    servers: list[ServerLookups] = Field(default_factory=list, description="Each server's counters as last read: what "
                                         "the next reading is compared with (a lower reading or a new start time "
                                         "means the server restarted).")
    measured_at: datetime | None = Field(None, description="When these figures were last written.")


class L2KeyStatus(APIModel):
    """L2's master key as the servers use it, named by its fingerprint (never the key itself)."""

    secret: str = Field(max_length=253, description="The Secret holding it: spec.l2.encryption.keySecretRef, or the "
                        "generated <name>-l2-key.")
    generated: bool = Field(False, description="The operator generated it (and will never generate another over data "
                            "sealed with it).")
    fingerprint: str | None = Field(None, pattern=r"^[0-9a-f]{16}$", description="The first 16 hex of HMAC-SHA256 keyed "
                                    "by the key over 'kvpersist l2 key fingerprint v1': a pin of the namespace id, so "
                                    "another key is another namespace. Kept while the key cannot be read.")
    namespace_id: NamespaceId | None = Field(None, description="The namespace last served under this key: what is unreadable without "
                                             "it. Kept, and refused by gc, while the key cannot be read.")


class SealedNamespace(APIModel):
    """A namespace the resource served with L2 encrypted, and the key that sealed its objects."""

    namespace_id: NamespaceId = Field(description="The namespace, kvp-<32 hex>.")
    fingerprint: str = Field(pattern=r"^[0-9a-f]{16}$", description="The fingerprint of the key its objects are "
                             "sealed with (as in l2Key).")
    secret: str | None = Field(None, max_length=253, description="The Secret that held that key.")


CanaryTokenIds = list[Annotated[int, Field(ge=0, le=2**31 - 1)]]
# What served a check's cached answer (kvpersist.status.canary.served_by).
CanaryTier = Literal["gpu", "l1", "l2", "lmcache", "computed", "unknown"]
_TIER_TEXT = ("gpu: vLLM's own prefix cache (no evidence about lmcache); l1, l2: lmcache, from that tier; lmcache: "
              "lmcache, the tier not attributable; computed: neither cache held the prompt; unknown: not attributable "
              "(counters unread, or other requests moved them).")


class CanaryCheck(APIModel):
    """A check of a vLLM pod."""

    at: datetime = Field(description="When it was answered.")
    pod: str = Field(max_length=253, description="The vLLM pod asked.")
    match: bool = Field(description="The answer served with the cache was the reference.")
    tier: CanaryTier | None = Field(None, description="What served the cached answer, from the pod's and the lmcache "
                                    "servers' counters read around it. " + _TIER_TEXT)


class CanaryMatches(APIModel):
    """Checks whose cached answer was the reference, by what served it."""

    gpu: Count = Field(0, description="Answered from vLLM's own prefix cache: no evidence about lmcache.")
    l1: Count = Field(0, description="Served by lmcache from L1.")
    l2: Count = Field(0, description="Served by lmcache from L2.")
    lmcache: Count = Field(0, description="Served by lmcache, the tier not attributable.")
    computed: Count = Field(0, description="Computed: neither cache held the prompt.")
    unknown: Count = Field(0, description="Not attributable.")


class CanaryMismatch(APIModel):
    """A cache hit that changed the answer: it stands (the cache off) until acknowledged with the
    annotation kvpersist.dev/hit-correctness-ack=<id>, or the namespace id changes."""

    id: str = Field(pattern=r"^[0-9a-f]{12}$", description="What the acknowledgement names.")
    at: datetime = Field(description="When it was found.")
    pod: str = Field(max_length=253, description="The vLLM pod whose cached answer differed.")
    expected: CanaryTokenIds = Field(max_length=64, description="The reference's token ids (computed without the cache).")
    got: CanaryTokenIds = Field(max_length=64, description="The token ids served with the cache, twice.")
    tiers: list[CanaryTier] = list_field(2, "What served the two cached answers. " + _TIER_TEXT)


class CanaryStatus(APIModel):
    """The canary's reference answer, computed without the cache, and its checks (spec.canary)."""

    namespace_id: NamespaceId = Field(description="The namespace id the reference is for.")
    prompt_digest: str = Field(pattern=SHA256_DIGEST, description="sha256 of what decides the answer "
                               "besides the namespace id: the prompt, maxTokens, spec.vllm.extraArgs and env. "
                               "Another digest records another reference.")
    reference_token_ids: CanaryTokenIds = Field(max_length=64, description="The greedy token ids computed without "
                                                "the cache (a fresh random cache_salt misses every cache).")
    reference_at: datetime = Field(description="When the reference was computed.")
    reference_pod: str = Field(max_length=253, description="The vLLM pod that computed it.")
    prompt_tokens: Count | None = Field(None, description="The prompt's tokens as vLLM counted them: lmcache can "
                                        "serve its whole chunks of 256 tokens, the last token left out.")
    reference_recomputes: int | None = Field(None, ge=0, le=16, description="How often the reference was computed "
                                             "again because a second answer without the cache contradicted it (at "
                                             "most 3 times per namespace id and promptDigest).")
    last_check: CanaryCheck | None = Field(None, description="The last check of a vLLM pod that uses the cache.")
    matches: CanaryMatches | None = Field(None, description="Checks against this reference whose cached answer was "
                                          "the reference, by what served them. Only those lmcache served (l1, l2, "
                                          "lmcache) are evidence: HitCorrectness is True only with one.")
    last_served_check: CanaryCheck | None = Field(None, description="The last matching check lmcache served.")
    mismatch: CanaryMismatch | None = Field(None, description="A hit that changed the answer, while it stands.")


class AttachPin(APIModel):
    """One pin as a vLLM argument an attached pod must carry: `flag value`, exactly once."""

    flag: str = Field(max_length=64, description="The vLLM flag.")
    value: str = Field(max_length=256, description="Its value, as the operator's own vLLM pods get it.")
    field: str = Field(max_length=64, description="The spec field it comes from, for refusals.")


class AttachEnv(APIModel):
    """A variable the admission policy adds to an attached vLLM container, or requires at this value
    (or from this downward API field)."""

    name: str = Field(max_length=128, description="Its name.")
    value: str = Field("", max_length=64, description="Its value.")
    field_path: str | None = Field(None, max_length=64, description="Instead of value: the pod's field it comes "
                                   "from (valueFrom.fieldRef.fieldPath, e.g. status.podIP).")


class AttachStatus(APIModel):
    """What the admission policies (docs/attach.md) check and complete labelled pods against, with mode Attached: the
    pins as vLLM arguments, written by the operator (the one place they are). Absent without a namespace id: pods refused."""

    namespace_id: NamespaceId = Field(description="The namespace id admitted pods write into (their label "
                                      "kvpersist.dev/namespace-id).")
    model: str = Field(max_length=256, description="The model, the argument after `serve`.")
    image_digest: str = Field(pattern=SHA256_DIGEST, description="The digest the container image must end with (@sha256:...).")
    pins: list[AttachPin] = list_field(16, "Arguments the pod must carry, each exactly once with exactly this value.")
    args: list[Annotated[str, Field(max_length=8192)]] = list_field(
        8, "Flag and value pairs the policy adds where the flag is absent, and requires exactly once at exactly this "
        "value (--kv-transfer-config, --kv-events-config).")
    env: list[AttachEnv] = list_field(8, "Variables added where absent, required at this value.")
    server_selector: dict[str, str] = Field(default_factory=dict, description="Labels of this namespace id's "
                                            "lmcache servers: the pod's required podAffinity (same node).",
                                            json_schema_extra={"default": {}})
    bypassed: str | None = Field(None, max_length=512, description="Set while the cache is off for vLLM (a hit that "
                                 "changed the canary's answer, the servers away too long): new pods are admitted "
                                 "without the connection (args and env), their pins still checked.")
    pods: Count | None = Field(None, description="Attached pods seen of this namespace id.")
    ready_pods: Count | None = Field(None, description="Those Ready.")


class IdentityFiles(APIModel):
    """What the model's files said at the commits named (kvpersist.controller.pincheck.file_pins)."""

    at: str = Field(max_length=600, description="<model>@<commit>, and <tokenizer>@<commit> when another.")
    num_kv_heads: int | None = Field(None, ge=1, le=1024, alias="numKVHeads")
    head_size: int | None = Field(None, ge=1, le=4096)
    chat_template_digest: str | None = Field(None, pattern=SHA256_DIGEST)
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] | None = None  # type: ignore[valid-type]
    max_model_len: int | None = Field(None, ge=1, le=16_777_216)
    block_size: Literal[BLOCK_SIZES] | None = None  # type: ignore[valid-type]


class IdentityStatus(APIModel):
    """The identity pins as the operator resolved them."""

    pins: Identity | None = Field(None, description="spec.identity as hashed into namespaceId and rendered into "
                                  "vLLM's arguments: what the spec writes, and what the operator filled.")
    filled: list[str] = Field(default_factory=list, max_length=16, description="The pins the spec leaves unset that "
                              "the operator filled: from the model's files, vLLM's defaults, the image's digest.")
    files: IdentityFiles | None = Field(None, description="What the model's and tokenizer's files at their commits "
                                        "decide, read anonymously from the Hub (kept: the files at a commit never "
                                        "change).")


class KVCacheNamespaceStatus(APIModel):
    """What the operator observed."""

    observed_generation: int | None = Field(None, description="The spec generation this status describes.")
    phase: Literal["Pending", "Progressing", "Ready", "Degraded", "CacheDisabled", "Failed"] | None = Field(
        None, description="Pending, Progressing, Ready, Degraded, CacheDisabled or Failed.")
    namespace_id: NamespaceId | None = Field(None, description="Compatibility namespace of the identity pins, kvp-<32 hex>.")
    l2_kind: Literal[L2_KINDS] | None = Field(None, description="nvme or hfBucket.")  # type: ignore[valid-type]
    ready_replicas: int | None = Field(None, description="vLLM pods ready.")
    desired_replicas: int | None = Field(None, description="vLLM pods wanted.")
    replicas: str | None = Field(None, description="ready/desired vLLM pods, for kubectl get.")
    vllm_replicas: int | None = Field(None, description="vLLM pods the Deployment has now: the "
                                      "scale subresource's status.replicas (kubectl scale, a HorizontalPodAutoscaler).")
    vllm_selector: str | None = Field(None, description="The label selector of the vLLM pods, "
                                      "as a string: the scale subresource's status.selector, which an HPA needs.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Latest observations.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    usage: Usage | None = Field(None, description="Cache usage, when measured.")
    servers: list[ServerHealth] = Field(default_factory=list, description="Per-server health.")
    inventory: InventoryStatus | None = Field(None, description="Per-namespace L2 usage, orphans included.")
    budget: BudgetStatus | None = Field(None, description="The L2 budget, when spec.l2.nvme.budget is set.")
    hits: HitStatus | None = Field(None, description="Cache hit rate per tier and tokens served from cache, in total "
                                   "and over the last 5 minutes, from the lmcache servers' /metrics.")
    gc: GCStatus | None = Field(None, description="The last explicit cleanup of an orphaned namespace.")
    l2: L2SpaceStatus | None = Field(None, description="The claims' space with every namespace counted, and what the "
                                     "age limit (spec.l2.orphanRetention) removed.")
    l2_key: L2KeyStatus | None = Field(None, description="The L2 master key in use, by fingerprint, and "
                                       "the namespace stored under it (with spec.l2.encryption on).")
    sealed_namespaces: list[SealedNamespace] = Field(
        default_factory=list, max_length=16, description="Each namespace served with L2 encrypted, with the key that "
        "sealed it, newest last (the last 16): a pin change keeps the key but moves to another namespace, and the old "
        "one's data stays on the same claims or bucket prefix. When the generated key Secret is gone, every one of "
        "them sealed with its key that the inventory does not show empty counts as lost (L2KeyLost), not only the "
        "namespace served now. Kept while encryption is off.")
    canary: CanaryStatus | None = Field(None, description="The correctness canary's reference and last check "
                                        "(spec.canary).")
    identity: IdentityStatus | None = Field(None, description="The identity pins resolved: spec.identity with every "
                                            "pin it leaves unset filled, and what the model's files say.")
    attach: AttachStatus | None = Field(None, description="With spec.vllm.mode Attached: what the admission "
                                        "policies check attached vLLM pods against and add to them, and how many "
                                        "there are.")
