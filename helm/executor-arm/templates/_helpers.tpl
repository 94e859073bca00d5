{{/* ---------------------------------------------------------------- names and labels */}}

{{- define "executor-arm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "executor-arm.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "executor-arm.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "executor-arm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "executor-arm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "executor-arm.labels" -}}
helm.sh/chart: {{ include "executor-arm.chart" . }}
{{ include "executor-arm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: executor
executor-arm/mode: {{ .Values.mode }}
{{- end }}

{{- define "executor-arm.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "executor-arm.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* image reference: repository[:tag][@digest] */}}
{{- define "executor-arm.imageRef" -}}
{{- $img := index . 0 }}
{{- $defaultTag := index . 1 }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository (default $defaultTag (toString $img.tag)) }}
{{- end }}
{{- end }}

{{/* ---------------------------------------------------------------- fixed paths inside the pod */}}

{{- define "executor-arm.configDir" -}}/etc/executor-arm{{- end }}
{{- define "executor-arm.configFile" -}}/etc/executor-arm/executor-arm.toml{{- end }}
{{- define "executor-arm.profilesDir" -}}/etc/executor-arm/sandbox-profiles{{- end }}
{{- define "executor-arm.executorsDir" -}}/etc/executor-arm/executors{{- end }}
{{- define "executor-arm.secretsDir" -}}/etc/executor-arm/secrets{{- end }}
{{- define "executor-arm.stateDir" -}}/var/lib/executor-arm{{- end }}
{{- define "executor-arm.auditLog" -}}/var/lib/executor-arm/executor-arm-audit.jsonl{{- end }}
{{- define "executor-arm.dockerSocketDir" -}}/run/executor-arm-docker{{- end }}
{{- define "executor-arm.dockerSocket" -}}/run/executor-arm-docker/docker.sock{{- end }}

{{/* ---------------------------------------------------------------- derived settings */}}

{{/* Backend used when a profile names none: local | docker | gvisor */}}
{{- define "executor-arm.defaultBackend" -}}
{{- if .Values.config.sandbox.defaultBackend }}
{{- .Values.config.sandbox.defaultBackend }}
{{- else if eq .Values.mode "dind" }}
{{- .Values.dind.defaultBackend }}
{{- else }}
{{- "local" }}
{{- end }}
{{- end }}

{{/* SANDBOX_RUNTIME spelling of the default backend: local | runc | gvisor */}}
{{- define "executor-arm.sandboxRuntime" -}}
{{- $b := include "executor-arm.defaultBackend" . }}
{{- if eq $b "docker" }}runc{{ else }}{{ $b }}{{ end }}
{{- end }}

{{- define "executor-arm.runtimeClassName" -}}
{{- if .Values.runtimeClassName }}
{{- .Values.runtimeClassName }}
{{- else if eq .Values.mode "gvisor" }}
{{- "gvisor" }}
{{- end }}
{{- end }}

{{/* Name of the Secret holding the auth material ("" when there is none). */}}
{{- define "executor-arm.authSecretName" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecret }}
{{- else if or .Values.auth.jwtSecret (not .Values.production) }}
{{- printf "%s-auth" (include "executor-arm.fullname" .) }}
{{- end }}
{{- end }}

{{/* "true" when the chart itself creates the auth Secret. */}}
{{- define "executor-arm.createAuthSecret" -}}
{{- if and (not .Values.auth.existingSecret) (or .Values.auth.jwtSecret (not .Values.production)) }}true{{ end }}
{{- end }}

{{/* "true" when HS256 verification is configured. */}}
{{- define "executor-arm.hs256" -}}
{{- if and (include "executor-arm.authSecretName" .) .Values.auth.jwtSecretKey }}true{{ end }}
{{- end }}

{{- define "executor-arm.jwtSecretFile" -}}
{{- printf "%s/%s" (include "executor-arm.secretsDir" .) .Values.auth.jwtSecretKey }}
{{- end }}

{{/* "true" when Redis holds the shared state. */}}
{{- define "executor-arm.redis" -}}
{{- if or .Values.state.redisUrl .Values.state.existingSecret }}true{{ end }}
{{- end }}

{{- define "executor-arm.redisPort" -}}
{{- $np := .Values.networkPolicy.egress.redis }}
{{- if not (kindIs "invalid" $np.port) }}
{{- $np.port | int }}
{{- else if .Values.state.redisUrl }}
{{- $host := (urlParse .Values.state.redisUrl).host }}
{{- if regexMatch ":[0-9]+$" $host }}
{{- regexFind "[0-9]+$" $host }}
{{- else }}6379{{ end }}
{{- else }}6379{{ end }}
{{- end }}

{{/* Replicas that can run at once (for the PDB and the shared-state check). */}}
{{- define "executor-arm.minReplicas" -}}
{{- if .Values.autoscaling.enabled }}{{ .Values.autoscaling.minReplicas | int }}{{ else }}{{ .Values.replicaCount | int }}{{ end }}
{{- end }}
{{- define "executor-arm.maxReplicas" -}}
{{- if .Values.autoscaling.enabled }}{{ .Values.autoscaling.maxReplicas | int }}{{ else }}{{ .Values.replicaCount | int }}{{ end }}
{{- end }}

{{/* Longest execution any profile allows: the API cap (300 s) unless a profile asks for more. */}}
{{- define "executor-arm.maxExecutionTimeout" -}}
{{- $max := 300 }}
{{- range $name, $text := .Values.profiles }}
{{- range regexFindAll "(?m)^\\s*timeout_max_seconds\\s*=\\s*[0-9]+" (toString $text) -1 }}
{{- $n := regexFind "[0-9]+$" . | int }}
{{- if gt $n 300 }}
{{- fail (printf "profiles.%s: timeout_max_seconds = %d is above the API's maximum execution timeout of 300 s" $name $n) }}
{{- end }}
{{- end }}
{{- end }}
{{- $max }}
{{- end }}

{{/* Smallest terminationGracePeriodSeconds that still lets the longest execution and the drain finish. */}}
{{- define "executor-arm.minTerminationGrace" -}}
{{- add (include "executor-arm.maxExecutionTimeout" . | int) (.Values.config.server.shutdownGraceSeconds | int) (.Values.preStopSleepSeconds | int) }}
{{- end }}

{{- define "executor-arm.terminationGrace" -}}
{{- $min := include "executor-arm.minTerminationGrace" . | int }}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add $min 10 }}
{{- else }}
{{- $v := .Values.terminationGracePeriodSeconds | int }}
{{- if le $v $min }}
{{- fail (printf "terminationGracePeriodSeconds (%d) must be above the maximum execution timeout (%s s) + config.server.shutdownGraceSeconds (%d s) + preStopSleepSeconds (%d s) = %d s, or running executions are killed on shutdown" $v (include "executor-arm.maxExecutionTimeout" .) (.Values.config.server.shutdownGraceSeconds | int) (.Values.preStopSleepSeconds | int) $min) }}
{{- end }}
{{- $v }}
{{- end }}
{{- end }}

{{/* ---------------------------------------------------------------- checks that fail the render */}}

{{- define "executor-arm.validate" -}}
{{- $v := .Values }}
{{- if and $v.auth.existingSecret $v.auth.jwtSecret }}
{{- fail "auth.existingSecret and auth.jwtSecret are both set: use exactly one (existingSecret for production)" }}
{{- end }}
{{- if and $v.production (not $v.auth.existingSecret) (not $v.auth.jwtSecret) }}
{{- fail "production mode needs a JWT verification secret: set auth.existingSecret (a Secret holding the key auth.jwtSecretKey and/or the public keys) or auth.jwtSecret; set production=false to let the chart generate a development secret" }}
{{- end }}
{{- if and $v.auth.publicKeys (not $v.auth.existingSecret) }}
{{- fail "auth.publicKeys reference keys of auth.existingSecret: set auth.existingSecret" }}
{{- end }}
{{- if and (not $v.auth.jwtSecretKey) (not $v.auth.publicKeys) (not $v.auth.staticTokens) }}
{{- fail "auth.jwtSecretKey is empty and there are no auth.publicKeys or auth.staticTokens: nothing could verify a token" }}
{{- end }}
{{- if and $v.state.redisUrl $v.state.existingSecret }}
{{- fail "state.redisUrl and state.existingSecret are both set: use one" }}
{{- end }}
{{- if and $v.state.redisUrl (contains "@" $v.state.redisUrl) }}
{{- fail "state.redisUrl carries credentials: store the URL in a Secret and set state.existingSecret instead" }}
{{- end }}
{{- if and (gt (include "executor-arm.maxReplicas" . | int) 1) (not (include "executor-arm.redis" .)) }}
{{- fail "more than one replica (replicaCount or autoscaling) needs shared state: set state.redisUrl or state.existingSecret, otherwise single-use tokens and Idempotency-Keys could be replayed on another replica" }}
{{- end }}
{{- if and $v.autoscaling.enabled (gt ($v.autoscaling.minReplicas | int) ($v.autoscaling.maxReplicas | int)) }}
{{- fail "autoscaling.minReplicas is above autoscaling.maxReplicas" }}
{{- end }}
{{- $pdb := $v.podDisruptionBudget }}
{{- if and (not (kindIs "invalid" $pdb.minAvailable)) (not (kindIs "invalid" $pdb.maxUnavailable)) }}
{{- fail "podDisruptionBudget: set minAvailable or maxUnavailable, not both" }}
{{- end }}
{{- if and (eq $v.mode "gvisor") (not (include "executor-arm.runtimeClassName" .)) }}
{{- fail "mode gvisor needs runtimeClassName" }}
{{- end }}
{{- $backend := include "executor-arm.defaultBackend" . }}
{{- if and (ne $v.mode "dind") (ne $backend "local") }}
{{- fail (printf "mode %s runs the local backend; default backend %q needs mode dind" $v.mode $backend) }}
{{- end }}
{{- if and (eq $v.mode "dind") (eq $backend "local") }}
{{- fail "mode dind runs sandboxes through dockerd: the default backend must be docker or gvisor, not local" }}
{{- end }}
{{- if and (eq $v.mode "dind") (eq $backend "gvisor") (not $v.dind.gvisor.enabled) }}
{{- fail "dind default backend gvisor needs dind.gvisor.enabled (runsc registered with dockerd)" }}
{{- end }}
{{- if and (eq $v.mode "dind") (eq (int (index $v.securityContext "dind").runAsUser) 0) }}
{{- fail "mode dind runs the daemon container non-root: securityContext.dind.runAsUser must not be 0" }}
{{- end }}
{{- if and (eq $v.mode "gvisor") (index $v.securityContext "gvisor").privileged }}
{{- fail "mode gvisor must not run a privileged container" }}
{{- end }}
{{- if not $v.commands }}
{{- fail "commands is empty: the allowlist needs at least one command" }}
{{- end }}
{{- range $name, $c := $v.commands }}
{{- if not (hasKey $v.profiles $c.profile) }}
{{- fail (printf "commands.%s.profile %q is not defined in profiles" $name $c.profile) }}
{{- end }}
{{- end }}
{{- range $v.allowedCommands }}
{{- if not (hasKey $v.commands .) }}
{{- fail (printf "allowedCommands: %q is not in commands" .) }}
{{- end }}
{{- end }}
{{- range $name, $def := $v.executors }}
{{- $d := $def }}
{{- if kindIs "string" $def }}
{{- $d = fromYaml $def }}
{{- if hasKey $d "Error" }}
{{- fail (printf "executors.%s is not valid YAML: %s" $name $d.Error) }}
{{- end }}
{{- end }}
{{- $md := default dict $d.metadata }}
{{- if ne (toString $md.name) $name }}
{{- fail (printf "executors.%s: metadata.name must equal the key %q (the daemon requires it to match the file name)" $name $name) }}
{{- end }}
{{- end }}
{{- $_ := include "executor-arm.terminationGrace" . }}
{{- end }}

{{/* ---------------------------------------------------------------- executor-arm.toml */}}

{{/* A TOML key: bare when it can be, else a quoted (JSON-escaped) string. */}}
{{- define "executor-arm.tomlKey" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . }}{{ . }}{{ else }}{{ toJson . }}{{ end }}
{{- end }}

{{/* A TOML array of strings: ["a", "b"]. */}}
{{- define "executor-arm.tomlStrings" -}}
[{{ range $i, $e := . }}{{ if $i }}, {{ end }}{{ toJson (toString $e) }}{{ end }}]
{{- end }}

{{- define "executor-arm.configToml" -}}
{{- $v := .Values -}}
# executor-arm configuration, rendered by the {{ include "executor-arm.chart" . }} Helm chart
# (release {{ .Release.Name }}, mode {{ $v.mode }}). Change the chart values, not this file.
# Environment variables set on the container (EXECUTOR_ARM_JWT_SECRET_FILE, EXECUTOR_ARM_REDIS_URL,
# ALLOWED_COMMANDS, SANDBOX_RUNTIME) override the matching keys.

[server]
listen = {{ printf "0.0.0.0:%d" ($v.config.server.port | int) | toJson }}
body_limit_bytes = {{ $v.config.server.bodyLimitBytes | int64 }}
header_read_timeout_ms = {{ $v.config.server.headerReadTimeoutMs | int64 }}
shutdown_grace_seconds = {{ $v.config.server.shutdownGraceSeconds | int64 }}

[server.concurrency]
local = {{ $v.config.server.concurrency.local | int64 }}
docker = {{ $v.config.server.concurrency.docker | int64 }}
gvisor = {{ $v.config.server.concurrency.gvisor | int64 }}

[server.queue]
max_waiting = {{ $v.config.server.queue.maxWaiting | int64 }}
max_wait_ms = {{ $v.config.server.queue.maxWaitMs | int64 }}

[executions]
retention_seconds = {{ $v.config.executions.retentionSeconds | int64 }}

[sessions]
dir = {{ printf "%s/sessions" (include "executor-arm.stateDir" .) | toJson }}
max_total = {{ $v.config.sessions.maxTotal | int64 }}
max_per_tenant = {{ $v.config.sessions.maxPerTenant | int64 }}
max_ttl_seconds = {{ $v.config.sessions.maxTtlSeconds | int64 }}
idle_timeout_seconds = {{ $v.config.sessions.idleTimeoutSeconds | int64 }}
max_file_bytes = {{ $v.config.sessions.maxFileBytes | int64 }}
accept_service_capabilities = {{ $v.config.sessions.acceptServiceCapabilities }}

[auth]
{{- if include "executor-arm.hs256" . }}
jwt_secret_file = {{ include "executor-arm.jwtSecretFile" . | toJson }}
{{- end }}
audience = {{ $v.auth.audience | toJson }}
{{- if $v.auth.issuer }}
issuer = {{ $v.auth.issuer | toJson }}
{{- end }}
max_ttl_seconds = {{ $v.auth.maxTtlSeconds | int64 }}
leeway_seconds = {{ $v.auth.leewaySeconds | int64 }}
{{- range $v.auth.publicKeys }}

[[auth.public_keys]]
{{- if .kid }}
kid = {{ .kid | toJson }}
{{- end }}
{{- if .alg }}
alg = {{ .alg | toJson }}
{{- end }}
{{- if eq (default "pem" .format) "jwks" }}
jwks_file = {{ printf "%s/%s" (include "executor-arm.secretsDir" $) .secretKey | toJson }}
{{- else }}
pem_file = {{ printf "%s/%s" (include "executor-arm.secretsDir" $) .secretKey | toJson }}
{{- end }}
{{- end }}
{{- range $v.auth.staticTokens }}

[[auth.static_tokens]]
id = {{ .id | toJson }}
kind = {{ default "service" .kind | toJson }}
sha256 = {{ .sha256 | lower | toJson }}
{{- if .capabilities }}
capabilities = {{ include "executor-arm.tomlStrings" .capabilities }}
{{- end }}
{{- end }}

[audit]
path = {{ include "executor-arm.auditLog" . | toJson }}

[state]
{{- if $v.state.redisUrl }}
redis_url = {{ $v.state.redisUrl | toJson }}
{{- end }}
idempotency_ttl_seconds = {{ $v.state.idempotencyTtlSeconds | int64 }}
idempotency_lease_seconds = {{ $v.state.idempotencyLeaseSeconds | int64 }}

[sandbox]
default_backend = {{ include "executor-arm.defaultBackend" . | toJson }}
profiles_dir = {{ include "executor-arm.profilesDir" . | toJson }}
search_path = {{ $v.config.sandbox.searchPath | toJson }}

[sandbox.local]
cgroup_name = {{ $v.config.sandbox.local.cgroupName | toJson }}

[sandbox.docker]
{{- if eq $v.mode "dind" }}
socket = {{ printf "unix://%s" (include "executor-arm.dockerSocket" .) | toJson }}
# Egress proxy sockets: on the volume the dockerd sidecar mounts at the same path.
egress_dir = {{ printf "%s/egress" (include "executor-arm.dockerSocketDir" .) | toJson }}
{{- else }}
socket = "unix:///var/run/docker.sock"
{{- end }}
image = {{ $v.config.sandbox.docker.image | toJson }}
pool_size = {{ $v.config.sandbox.docker.poolSize | int64 }}

[executors]
dir = {{ include "executor-arm.executorsDir" . | toJson }}
{{- range $name, $c := $v.commands }}

[commands.{{ include "executor-arm.tomlKey" $name }}]
action_types = {{ include "executor-arm.tomlStrings" $c.actionTypes }}
capabilities = {{ include "executor-arm.tomlStrings" $c.capabilities }}
profile = {{ $c.profile | toJson }}
{{- if $c.denyArgs }}
deny_args = {{ include "executor-arm.tomlStrings" $c.denyArgs }}
{{- end }}
{{- if $c.denyPrefixes }}
deny_prefixes = {{ include "executor-arm.tomlStrings" $c.denyPrefixes }}
{{- end }}
{{- end }}
{{ end }}

{{/* ConfigMap keys of profiles and executors (each its own key, projected into its own directory). */}}
{{- define "executor-arm.profileKey" -}}profile.{{ . }}.toml{{- end }}
{{- define "executor-arm.executorKey" -}}executor.{{ . }}.yaml{{- end }}

{{/* dockerd configuration of the dind sidecar (the socket and its group are set on the command line). */}}
{{- define "executor-arm.dindDaemonJson" -}}
{{- $cfg := dict }}
{{- if .Values.dind.gvisor.enabled }}
{{- $runsc := dict "path" .Values.dind.gvisor.runscPath }}
{{- /* --host-uds=open: egress containers reach the daemon's proxy through a bind-mounted unix socket.
       --oci-seccomp: runsc applies the containers' seccomp profile (the daemon refuses gVisor runs without it). */}}
{{- $_ := set $runsc "runtimeArgs" (concat (.Values.dind.gvisor.runscArgs | default list) (list "--host-uds=open" "--oci-seccomp") | uniq) }}
{{- $_ := set $cfg "runtimes" (dict "runsc" $runsc) }}
{{- end }}
{{- toPrettyJson $cfg }}
{{ end }}
