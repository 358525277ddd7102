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
