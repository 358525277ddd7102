{{/* The chart's name, or nameOverride: what object names are made of (a parent chart may rename it). */}}
{{- define "kvpersist.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Object names: fullnameOverride, else <release>-<name> (the release alone when it holds the name). */}}
{{- define "kvpersist.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "kvpersist.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvpersist.serviceAccountName" -}}
{{- default (include "kvpersist.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* Selector labels; app.kubernetes.io/name is what the lmcache servers' NetworkPolicy admits. */}}
{{- define "kvpersist.selectorLabels" -}}
app.kubernetes.io/name: kvpersist-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The chart's own labels on every object. */}}
{{- define "kvpersist.chartLabels" -}}
{{ include "kvpersist.selectorLabels" . }}
app.kubernetes.io/part-of: {{ include "kvpersist.name" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* global.commonLabels (a parent chart's labels for all it installs), each value a string. */}}
{{- define "kvpersist.commonLabels" -}}
{{- $out := dict -}}
{{- range $k, $v := (.Values.global | default dict).commonLabels | default dict -}}
{{- $_ := set $out $k (toString $v) -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* Every object's labels: global.commonLabels, then the chart's own (never replaced by them). */}}
{{- define "kvpersist.labels" -}}
{{- toYaml (mergeOverwrite (include "kvpersist.commonLabels" . | fromYaml) (include "kvpersist.chartLabels" . | fromYaml)) -}}
{{- end -}}

{{/* The operator pod's labels: podLabels and global.commonLabels, then the selector's (never replaced:
the Deployment and the lmcache servers' NetworkPolicies find the operator by them). */}}
{{- define "kvpersist.podLabels" -}}
{{- $labels := include "kvpersist.commonLabels" . | fromYaml -}}
{{- range $k, $v := .Values.podLabels | default dict }}{{ $_ := set $labels $k (toString $v) }}{{ end -}}
{{- toYaml (mergeOverwrite $labels (include "kvpersist.selectorLabels" . | fromYaml)) -}}
{{- end -}}

{{/* imagePullSecrets and global.imagePullSecrets, each secret once (names or {name: ...}). */}}
{{- define "kvpersist.imagePullSecrets" -}}
{{- $names := list -}}
{{- range concat ((.Values.global | default dict).imagePullSecrets | default list) (.Values.imagePullSecrets | default list) -}}
{{- $name := . -}}
{{- if kindIs "map" . }}{{ $name = get . "name" }}{{ end -}}
{{- if not (has $name $names) }}{{ $names = append $names $name }}{{ end -}}
{{- end -}}
{{- range $names }}
- name: {{ . }}
{{- end -}}
{{- end -}}

{{/* With watchNamespaces, a binding's matchResources: the watched namespaces only (another
release, watching others, has its own policies there). Empty: every namespace. */}}
{{- define "kvpersist.bindingScope" -}}
{{- with .Values.watchNamespaces }}
  matchResources:
    namespaceSelector:
      matchExpressions:
        - {key: kubernetes.io/metadata.name, operator: In, values: {{ toJson . }}}
{{- end }}
{{- end -}}

{{/* Whether the Prometheus Operator's kind (its argument) is served: `helm template` knows it
from --api-versions, install and upgrade from the cluster. */}}
{{- define "kvpersist.monitoringServes" -}}
{{- if .root.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" .kind) }}true{{ end -}}
{{- end -}}

{{/* The peering object's name: peering.name, else the release's full name (two releases never meet
on one, as they would on a fixed name: the second's install failed on the first's ClusterKopfPeering). */}}
{{- define "kvpersist.peeringName" -}}
{{- .Values.peering.name | default (include "kvpersist.fullname" .) -}}
{{- end -}}

{{/* What a value asks for and the chart did not render, one line each: NOTES.txt says it at install,
and templates/not-rendered.yaml as comments in `helm template`'s output, which prints no NOTES. */}}
{{- define "kvpersist.notRendered" -}}
{{- $missing := "but this cluster does not serve %s (with `helm template`, pass --api-versions %s; Argo CD passes the cluster's): %s" }}
{{- range list (list .Values.metrics.serviceMonitor.enabled "metrics.serviceMonitor.enabled" "ServiceMonitor" true) (list .Values.prometheusRule.enabled "prometheusRule.enabled" "PrometheusRule" true) (list .Values.lmcacheMetrics.podMonitor.enabled "lmcacheMetrics.podMonitor.enabled" "PodMonitor" false) }}
{{- $api := printf "monitoring.coreos.com/v1/%s" (index . 2) }}
{{- if and (index . 0) (index . 3) (not $.Values.metrics.service.enabled) }}
{{ index . 1 }} is true, but metrics.service.enabled is false: no {{ index . 2 }}
{{- else if and (index . 0) (not ($.Capabilities.APIVersions.Has $api)) }}
{{ index . 1 }} is true, {{ printf $missing $api $api (printf "no %s (install the Prometheus Operator's CRDs, then upgrade)" (index . 2)) }}
{{- end }}
{{- end }}
{{- $map := "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy" }}
{{- if and .Values.attach.enabled (not (.Capabilities.APIVersions.Has $map)) }}
attach.enabled is true, {{ printf $missing $map $map "no attach policies, so a labelled pod is admitted unchanged, without the cache (docs/attach.md)" }}
{{- end }}
{{- end -}}

{{/* The operator's image (also the inventory agent's): by digest when image.digest is set (a tag can
move; a digest cannot), else repository:tag (the tag defaulting to the chart's appVersion). */}}
{{- define "kvpersist.image" -}}
{{- if and .Values.image.requireDigest (not .Values.image.digest) -}}
{{- fail "image.digest: image.requireDigest is true and the operator image is named by tag alone; set image.digest=sha256:<64 hex> (what you pushed from operator/Dockerfile): the inventory agent beside every lmcache server runs from it, and a digest is what lets an upgrade roll the agents a few servers at a time (docs/upgrading.md)" -}}
{{- end -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* watchNamespaces, checked: each an exact namespace name (the operator's rights are a Role in each,
and a pattern names no namespace to put a Role in), none twice. Renders nothing. */}}
{{- define "kvpersist.checkWatchNamespaces" -}}
{{- $seen := dict -}}
{{- range $i, $ns := .Values.watchNamespaces -}}
{{- if not (kindIs "string" $ns) -}}
{{- fail (printf "watchNamespaces[%d]: %v is not a namespace name: list each namespace by its name" $i $ns) -}}
{{- end -}}
{{- if or (gt (len $ns) 63) (not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" $ns)) -}}
{{- fail (printf "watchNamespaces[%d] %q: only exact namespace names (lower-case letters, digits and -, at most 63), no patterns such as *, ?, ! or a comma-separated list: the chart grants the operator its rights by a Role in each watched namespace, and a pattern names no namespace to put one in; list each namespace, or leave watchNamespaces empty to watch all (cluster-wide rights)" $i $ns) -}}
{{- end -}}
{{- if hasKey $seen $ns -}}
{{- fail (printf "watchNamespaces[%d] %q is listed twice: list each namespace once" $i $ns) -}}
{{- end -}}
{{- $_ := set $seen $ns true -}}
{{- end -}}
{{- end -}}

{{/* The scraper of metrics.scraper as one NetworkPolicy peer (JSON), or nothing when unset: for
the operator's policy here and, through KVPERSIST_METRICS_SCRAPER, the lmcache servers' policies
the operator makes. A podSelector alone would select pods of each policy's own namespace. */}}
{{- define "kvpersist.scraper" -}}
{{- $s := .Values.metrics.scraper | default dict -}}
{{- if and $s.podSelector (not $s.namespaceSelector) -}}
{{- fail "metrics.scraper.podSelector needs metrics.scraper.namespaceSelector: alone it selects pods of each policy's own namespace; set namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: <the scraper's namespace>}}" -}}
{{- end -}}
{{- if $s.namespaceSelector -}}
{{- $peer := dict "namespaceSelector" $s.namespaceSelector -}}
{{- with $s.podSelector }}{{ $_ := set $peer "podSelector" . }}{{ end -}}
{{- toJson $peer -}}
{{- end -}}
{{- end -}}

{{/*
The oldest Kubernetes the chart and the operator work on: 1.30 (ValidatingAdmissionPolicy v1 for
creator rights and gc authorization; the CRD's CEL rules with reason and fieldPath). Checked here
rather than by kubeVersion in Chart.yaml: helm compares kubeVersion as semver, and an API server
built from source reports v0.0.0-master+$Format:%H$ (the local test cluster's), which no constraint
admits. A server that reports no release (no major version) is let through; any release below
1.30 (GKE's "30+" minors included) is refused, by `helm template` too at its default version.
*/}}
{{- define "kvpersist.minKubeMinor" -}}30{{- end -}}
{{- define "kvpersist.checkKubeVersion" -}}
{{- $v := .Capabilities.KubeVersion -}}
{{- if $v.Major -}}
{{- $major := regexReplaceAll "[^0-9].*$" $v.Major "" | int -}}
{{- $minor := regexReplaceAll "[^0-9].*$" $v.Minor "" | int -}}
{{- $min := include "kvpersist.minKubeMinor" . | int -}}
{{- if or (lt $major 1) (and (eq $major 1) (lt $minor $min)) -}}
{{- fail (printf "kvpersist needs Kubernetes 1.%d or later (ValidatingAdmissionPolicy v1, the CRD's validation rules); this cluster is %s. With helm template, pass --kube-version (your cluster's) where your helm assumes another" $min $v.Version) -}}
{{- end -}}
{{- end -}}
{{- end -}}
