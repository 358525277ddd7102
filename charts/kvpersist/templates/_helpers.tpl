{{- define "kvpersist.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
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

{{- define "kvpersist.labels" -}}
{{ include "kvpersist.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The operator's image (also the inventory agent's): by digest when image.digest is set (a tag can
move; a digest cannot), else repository:tag (the tag defaulting to the chart's appVersion). */}}
{{- define "kvpersist.image" -}}
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
