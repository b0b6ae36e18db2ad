{{/* Names and labels. */}}
{{- define "kvtier.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvtier.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "kvtier.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "kvtier.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvtier.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ include "kvtier.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kvtier.selector" -}}
app.kubernetes.io/name: {{ include "kvtier.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvtier.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* The route server needs no GPU: the cpu image, unless routeServer.image says otherwise. */}}
{{- define "kvtier.routerImage" -}}
{{- $tag := .Values.routeServer.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.routeServer.image.variant) -}}
{{- printf "%s:%s" (.Values.routeServer.image.repository | default .Values.image.repository) $tag -}}
{{- end -}}

{{/* The headless Service: its DNS name resolves to every daemon pod. */}}
{{- define "kvtier.daemonService" -}}
{{- printf "%s-daemon" (include "kvtier.fullname" .) -}}
{{- end -}}

{{- define "kvtier.daemonDns" -}}
{{- printf "%s.%s.svc.cluster.local:%d" (include "kvtier.daemonService" .) .Release.Namespace (int .Values.daemon.tcp.port) -}}
{{- end -}}

{{/* Memory the daemon container is given: the pool plus the daemon's own. */}}
{{- define "kvtier.daemonMemory" -}}
{{- printf "%dMi" (add (mul (int .Values.daemon.pool.capacityGiB) 1024) (int .Values.daemon.pool.overheadMiB)) -}}
{{- end -}}

{{/* daemon.pool.hugePages, checked: "", within_size or always (the tmpfs huge= modes that give
     the pool huge pages: advise gives only memory that asks with madvise, which the pool's does
     not, and never is ""). */}}
{{- define "kvtier.poolHugePages" -}}
{{- $h := .Values.daemon.pool.hugePages | default "" -}}
{{- $want := "want within_size or always (\"\" for the tmpfs as it is)" -}}
{{- if not (kindIs "string" $h) }}
{{- fail (printf "daemon.pool.hugePages %v: not a string; %s" $h $want) }}
{{- else if eq $h "advise" }}
{{- fail (printf "daemon.pool.hugePages \"advise\" gives the pool no huge pages (only memory that asks with madvise, which kvtier's pool does not); %s" $want) }}
{{- else if and $h (not (has $h (list "within_size" "always"))) }}
{{- fail (printf "daemon.pool.hugePages %q: %s" $h $want) }}
{{- end }}
{{- $h -}}
{{- end -}}

{{/* With huge pages and no hostPath the daemon's container mounts the pool's tmpfs itself
     (kvtierd-entrypoint, KVTIER_SHM_MOUNT): "true" or "". */}}
{{- define "kvtier.poolOwnMount" -}}
{{- if and (include "kvtier.poolHugePages" .) (not .Values.daemon.pool.hostPath) }}true{{ end -}}
{{- end -}}

{{/* The kvtier tool in the daemon's container (probes, kubectl exec): through the entrypoint
     when the container starts as root to mount the pool, so that it runs as the daemon's user. */}}
{{- define "kvtier.daemonTool" -}}
{{- if include "kvtier.poolOwnMount" . }}kvtierd-entrypoint, kvtier{{ else }}kvtier{{ end -}}
{{- end -}}

{{/* A TOML file from a flat map: every value as JSON, which is TOML for strings, numbers, booleans
     and arrays of them; a nested map is refused. */}}
{{- define "kvtier.toml" -}}
{{- range $key, $value := . }}
{{- if kindIs "map" $value }}
{{- fail (printf "config.%s: a kvtierd setting is a string, number, boolean or list, not a map" $key) }}
{{- end }}
{{ $key }} = {{ toJson $value }}
{{- end }}
{{- end -}}

{{/* The kvtierd settings the DaemonSet sets as KVTIER_* variables, because its volumes and
     probes depend on them (a variable beats kvtierd.toml, so daemon.config could not change
     them): daemon.config naming one fails rendering, naming the value to set instead. */}}
{{- define "kvtier.daemonEnvSettings" -}}
{{- $instead := dict
  "socket" "daemon.socketDir and daemon.socketName"
  "shm_dir" "daemon.pool.hostPath"
  "state_dir" "nothing: it is the pod's own state volume"
  "node_id" "nothing: it is the Kubernetes node's name (or KVTIER_NODE_ID in daemon.env)"
-}}
{{- range $key, $use := $instead }}
{{- if hasKey $.Values.daemon.config $key }}
{{- fail (printf "daemon.config.%s: the chart sets it as a KVTIER_* variable of the DaemonSet (a variable beats kvtierd.toml); set %s" $key $use) }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The tenants of the certificates the chart's own clients present on TCP: the route server's
     client certificate (tls.routeServerClient) and the daemons' certificate, which peers call
     each other with (tls.daemon). A common name no entry maps is a tenant of its own, holding
     no blocks: the route server would follow empty feeds. daemon.tenants come after, so an
     entry of its own for the same name wins. */}}
{{- define "kvtier.daemonTenants" -}}
{{- $t := list -}}
{{- with .Values.tls.routeServerClient }}
{{- if .commonName }}{{ $t = append $t (printf "cn:%s=%s" .commonName (.tenant | default "default")) }}{{ end }}
{{- end }}
{{- with .Values.tls.daemon }}
{{- if .commonName }}{{ $t = append $t (printf "cn:%s=%s" .commonName (.tenant | default "default")) }}{{ end }}
{{- end }}
{{- $all := concat $t (.Values.daemon.tenants | default list) -}}
{{- if $all }}{{ toJson $all }}{{ else }}[]{{ end -}}
{{- end -}}

{{/* kvtierd's settings: what the chart derives, then daemon.config over it. The socket, the
     pool and state directories and the node id are the DaemonSet's variables instead
     (kvtier.daemonEnvSettings). */}}
{{- define "kvtier.daemonConfig" -}}
{{- include "kvtier.daemonEnvSettings" . -}}
{{- $d := .Values.daemon -}}
{{- $cfg := dict
  "host_capacity" (printf "%dGiB" (int $d.pool.capacityGiB))
  "metrics_port" (int $d.metrics.port)
  "metrics_host" "0.0.0.0"
  "log_format" "json"
  "allowed_uids" $d.allowedUids
  "allowed_gids" $d.allowedGids
  "tenants" (include "kvtier.daemonTenants" . | fromJsonArray)
-}}
{{- if $d.disk.enabled }}
{{- $_ := set $cfg "disk_dir" "/var/lib/kvtier/disk" }}
{{- if $d.disk.capacity }}{{- $_ := set $cfg "disk_capacity" $d.disk.capacity }}{{- end }}
{{- end }}
{{- if $d.tcp.enabled }}
{{- $_ := set $cfg "tcp" (printf "0.0.0.0:%d" (int $d.tcp.port)) }}
{{- $_ := set $cfg "tcp_services" $d.tcp.services }}
{{- $_ := set $cfg "tls_cert" "/etc/kvtier/tls/tls.crt" }}
{{- $_ := set $cfg "tls_key" "/etc/kvtier/tls/tls.key" }}
{{- $_ := set $cfg "tls_ca" "/etc/kvtier/tls/ca.crt" }}
{{- end }}
{{- if .Values.keySecret.secretName }}
{{- $_ := set $cfg "key_secret_file" "/var/lib/kvtier/state/key.secret" }}
{{- end }}
{{- /* the image's copy engine: the cpu image has no cupy; the cuda image refuses to start
       without a GPU rather than serve GPU engines with the host stand-in */}}
{{- $_ := set $cfg "copy_engine" (ternary "host" "cuda" (eq .Values.image.variant "cpu")) }}
{{- include "kvtier.toml" (merge (deepCopy $d.config) $cfg) }}
{{- end -}}

{{- define "kvtier.routerConfig" -}}
{{- $r := .Values.routeServer -}}
{{- $cfg := dict
  "listen" (printf "0.0.0.0:%d" (int $r.port))
  "health_listen" (printf "127.0.0.1:%d" (int $r.healthPort))
  "dns" (list (include "kvtier.daemonDns" .))
  "tls_cert" "/etc/kvtier/tls/tls.crt"
  "tls_key" "/etc/kvtier/tls/tls.key"
  "tls_ca" "/etc/kvtier/tls/ca.crt"
  "daemon_tls_cert" "/etc/kvtier/daemon-tls/tls.crt"
  "daemon_tls_key" "/etc/kvtier/daemon-tls/tls.key"
  "daemon_tls_ca" "/etc/kvtier/daemon-tls/ca.crt"
-}}
{{- include "kvtier.toml" (merge (deepCopy $r.config) $cfg) }}
{{- end -}}
