{{/*
Names. nameOverride replaces the chart's name in names and labels;
fullnameOverride replaces the whole prefix of every object's name. The
StatefulSet's pods are <fullname>-<ordinal>; 52 characters leave room for
the ordinal and the controller-revision-hash label.
*/}}
{{- define "tally.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "tally.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "tally.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The reducers' ServiceAccount: the chart's own, or serviceAccount.name. */}}
{{- define "tally.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tally.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tally.selectorLabels" -}}
{{ include "tally.instanceLabels" . }}
app.kubernetes.io/component: reducer
{{- end -}}

{{/* The release's labels without a component: the reducers' selector adds
    component reducer, the helm test pod component test. */}}
{{- define "tally.instanceLabels" -}}
app.kubernetes.io/name: {{ include "tally.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tally.labels" -}}
{{ include "tally.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Reducers in the pool: shards x groups (int64: values load as float64). */}}
{{- define "tally.replicas" -}}
{{- mul (int64 .Values.shards) (int64 .Values.groups) -}}
{{- end -}}

{{/*
The pool as workers and reducers take it (TALLY_POOL, --pool): a pattern
that tally expands to every pod's stable DNS name, in ordinal order, which
is (group, shard) order.
*/}}
{{- define "tally.pool" -}}
{{- $name := include "tally.fullname" . -}}
{{- printf "%s-{0..%d}.%s.%s.svc.%s:%d" $name (sub (int64 (include "tally.replicas" .)) 1) $name .Release.Namespace .Values.clusterDomain (int64 .Values.port) -}}
{{- end -}}

{{/*
Chunk buffers one job reserves on a reducer when every group has workers:
window x (1 + 2F) + 2, F = 2 log2(P) + (1 if G > P), P the largest power of
two <= G, F = 0 with one group (docs/configuration.md).
*/}}
{{- define "tally.jobSlabs" -}}
{{- $g := int64 .Values.groups -}}
{{- $p := int64 1 -}}
{{- $levels := int64 0 -}}
{{- range $i := until 11 -}}
{{- if le (mul $p 2) $g -}}
{{- $p = mul $p 2 -}}
{{- $levels = add $levels 1 -}}
{{- end -}}
{{- end -}}
{{- $f := int64 0 -}}
{{- if gt $g 1 -}}
{{- $f = add (mul 2 $levels) (ternary 1 0 (gt $g $p)) -}}
{{- end -}}
{{- add (mul (int64 .Values.window) (add 1 (mul 2 $f))) 2 -}}
{{- end -}}

{{/* Fails rendering when the budget cannot hold one job (the reducer would refuse to start), or
    the overhead cannot hold what a reducer keeps outside it at maxConnections streams. */}}
{{- define "tally.validate" -}}
{{- $budget := int64 .Values.memoryBudgetBytes -}}
{{- $chunk := int64 .Values.maxChunkBytes -}}
{{- $slabs := div $budget $chunk -}}
{{- $need := int64 (include "tally.jobSlabs" .) -}}
{{- if lt $slabs $need -}}
{{- fail (printf "memoryBudgetBytes=%d holds %d chunk buffers of maxChunkBytes=%d, but one job needs %d (window=%d x (1 + 2F) + 2 with %d groups): set memoryBudgetBytes to at least %d" $budget $slabs $chunk $need (int64 .Values.window) (int64 .Values.groups) (mul $need $chunk)) -}}
{{- end -}}
{{- $overhead := int64 .Values.memoryOverheadBytes -}}
{{- $streams := int64 .Values.maxConnections -}}
{{- $outside := add 16777216 (mul 33554432 (int64 .Values.ioThreads)) (mul 81920 $streams) -}}
{{- $fabric := "" -}}
{{- if eq .Values.transport "fabric" -}}
{{- $outside = add $outside (mul 75497472 (int64 .Values.ioThreads)) -}}
{{- $fabric = " + 72 MiB per I/O thread for the fabric endpoints" -}}
{{- end -}}
{{- if lt $overhead $outside -}}
{{- fail (printf "memoryOverheadBytes=%d is below what a reducer may hold outside its budget with maxConnections=%d: 16 MiB + 32 MiB per I/O thread (ioThreads=%d) + 80 KiB per stream%s = %d (docs/architecture.md, Memory outside the budget): raise memoryOverheadBytes or lower maxConnections" $overhead $streams (int64 .Values.ioThreads) $fabric $outside) -}}
{{- end -}}
{{- end -}}

{{/* Container memory: the budget plus the overhead, requested and limited alike. */}}
{{- define "tally.memory" -}}
{{- add (int64 .Values.memoryBudgetBytes) (int64 .Values.memoryOverheadBytes) -}}
{{- end -}}

{{/*
The Secret the pool authenticates with: auth.existingSecret, or the one the
chart generates for the release (auth.generate), or "" for none.
*/}}
{{- define "tally.authSecret" -}}
{{- if .Values.auth.existingSecret -}}
{{- .Values.auth.existingSecret -}}
{{- else if .Values.auth.generate -}}
{{- printf "%s-auth" (include "tally.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
The container's resources: .Values.resources as given (cpu, extended
resources such as vpc.amazonaws.com/efa or rdma/hca, hugepages, claims),
with memory requested and limited at budget + overhead. A memory given there
fails rendering: the reducer maps its budget at start, so the container's
memory follows from memoryBudgetBytes and memoryOverheadBytes.
*/}}
{{- define "tally.resources" -}}
{{- $resources := deepCopy (.Values.resources | default dict) -}}
{{- $memory := include "tally.memory" . -}}
{{- range $kind := list "requests" "limits" -}}
{{- $given := index $resources $kind | default dict -}}
{{- if hasKey $given "memory" -}}
{{- fail (printf "resources.%s.memory is derived from the budget (memoryBudgetBytes + memoryOverheadBytes = %s bytes): set those instead" $kind $memory) -}}
{{- end -}}
{{- $_ := set $given "memory" $memory -}}
{{- $_ := set $resources $kind $given -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{/* One word for the reducer's sh -c command line: single-quoted, with any
    single quote in it closed, escaped and reopened. */}}
{{- define "tally.shellQuote" -}}
'{{ replace "'" "'\\''" (toString .) }}'
{{- end -}}
