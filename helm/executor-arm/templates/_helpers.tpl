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

{{/* Labels of the `helm test` pod: the release's, but outside the Deployment's selector. */}}
{{- define "executor-arm.testLabels" -}}
helm.sh/chart: {{ include "executor-arm.chart" . }}
app.kubernetes.io/name: {{ include "executor-arm.name" . }}-test
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: test
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
{{- /* dind: the in-container supervisor, copied from the daemon image by an init container to a
volume the daemon and the dockerd sidecar mount read-only at the same path (dockerd bind-mounts
it into every sandbox container). */}}
{{- define "executor-arm.supervisorDir" -}}/run/executor-arm-supervisor{{- end }}

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
{{- range $name, $text := include "executor-arm.profiles" . | fromYaml }}
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
{{- /* + the daemon's exit after the drain: killed runs end (5 s), its sessions are paused (15 s), the container backends' exit (30 s) */}}
{{- add $min 50 }}
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
{{- $profiles := include "executor-arm.profiles" . | fromYaml }}
{{- if not $profiles }}
{{- fail "no sandbox profiles: files/sandbox-profiles/ is empty and `profiles` adds none" }}
{{- end }}
{{- if not $v.commands }}
{{- fail "commands is empty: the allowlist needs at least one command" }}
{{- end }}
{{- range $name, $c := $v.commands }}
{{- if not (hasKey $profiles $c.profile) }}
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

{{/* Integral numbers of a values map (YAML numbers arrive as float64) become int64 in place, so
     toToml writes 8 and not 8.0; null entries are dropped. Recurses into maps and lists. */}}
{{- define "executor-arm.intify" -}}
{{- $m := . }}
{{- range $k, $v := $m }}
{{- if kindIs "invalid" $v }}
{{- $_ := unset $m $k }}
{{- else if kindIs "float64" $v }}
{{- if eq $v (float64 (int64 $v)) }}
{{- $_ := set $m $k (int64 $v) }}
{{- end }}
{{- else if kindIs "map" $v }}
{{- include "executor-arm.intify" $v }}
{{- else if kindIs "slice" $v }}
{{- $out := list }}
{{- range $v }}
{{- $w := dict "v" . }}
{{- include "executor-arm.intify" $w }}
{{- $out = append $out $w.v }}
{{- end }}
{{- $_ := set $m $k $out }}
{{- end }}
{{- end }}
{{- end }}

{{/* The daemon's configuration as a map (TOML names), before config.extra. */}}
{{- define "executor-arm.configMap" -}}
{{- $v := .Values }}
{{- $s := $v.config.server }}
{{- $server := dict
      "listen" (printf "0.0.0.0:%d" ($s.port | int))
      "body_limit_bytes" ($s.bodyLimitBytes | int64)
      "header_read_timeout_ms" ($s.headerReadTimeoutMs | int64)
      "shutdown_grace_seconds" ($s.shutdownGraceSeconds | int64)
      "concurrency" (dict "local" ($s.concurrency.local | int64) "docker" ($s.concurrency.docker | int64) "gvisor" ($s.concurrency.gvisor | int64))
      "queue" (dict "max_waiting" ($s.queue.maxWaiting | int64) "max_wait_ms" ($s.queue.maxWaitMs | int64)) }}
{{- $se := $v.config.sessions }}
{{- $sessions := dict
      "dir" (printf "%s/sessions" (include "executor-arm.stateDir" .))
      "max_total" ($se.maxTotal | int64)
      "max_per_tenant" ($se.maxPerTenant | int64)
      "max_ttl_seconds" ($se.maxTtlSeconds | int64)
      "idle_timeout_seconds" ($se.idleTimeoutSeconds | int64)
      "max_file_bytes" ($se.maxFileBytes | int64)
      "accept_service_capabilities" $se.acceptServiceCapabilities }}
{{- $auth := dict "audience" $v.auth.audience "max_ttl_seconds" ($v.auth.maxTtlSeconds | int64) "leeway_seconds" ($v.auth.leewaySeconds | int64) }}
{{- if include "executor-arm.hs256" . }}
{{- $_ := set $auth "jwt_secret_file" (include "executor-arm.jwtSecretFile" .) }}
{{- end }}
{{- if $v.auth.issuer }}
{{- $_ := set $auth "issuer" $v.auth.issuer }}
{{- end }}
{{- $keys := list }}
{{- range $v.auth.publicKeys }}
{{- $k := dict }}
{{- if .kid }}{{ $_ := set $k "kid" .kid }}{{ end }}
{{- if .alg }}{{ $_ := set $k "alg" .alg }}{{ end }}
{{- $file := printf "%s/%s" (include "executor-arm.secretsDir" $) .secretKey }}
{{- if eq (default "pem" .format) "jwks" }}
{{- $_ := set $k "jwks_file" $file }}
{{- else }}
{{- $_ := set $k "pem_file" $file }}
{{- end }}
{{- $keys = append $keys $k }}
{{- end }}
{{- if $keys }}{{ $_ := set $auth "public_keys" $keys }}{{ end }}
{{- $tokens := list }}
{{- range $v.auth.staticTokens }}
{{- $t := dict "id" .id "kind" (default "service" .kind) "sha256" (.sha256 | lower) }}
{{- if .capabilities }}{{ $_ := set $t "capabilities" (.capabilities | toStrings) }}{{ end }}
{{- $tokens = append $tokens $t }}
{{- end }}
{{- if $tokens }}{{ $_ := set $auth "static_tokens" $tokens }}{{ end }}
{{- $state := dict "dir" (printf "%s/state" (include "executor-arm.stateDir" .)) "idempotency_ttl_seconds" ($v.state.idempotencyTtlSeconds | int64) "idempotency_lease_seconds" ($v.state.idempotencyLeaseSeconds | int64) }}
{{- if $v.state.redisUrl }}{{ $_ := set $state "redis_url" $v.state.redisUrl }}{{ end }}
{{- $docker := dict "image" $v.config.sandbox.docker.image "pool_size" ($v.config.sandbox.docker.poolSize | int64) }}
{{- if eq $v.mode "dind" }}
{{- $_ := set $docker "socket" (printf "unix://%s" (include "executor-arm.dockerSocket" .)) }}
{{- /* Egress proxy sockets: on the volume the dockerd sidecar mounts at the same path. */}}
{{- $_ := set $docker "egress_dir" (printf "%s/egress" (include "executor-arm.dockerSocketDir" .)) }}
{{- $_ := set $docker "supervisor" (printf "%s/executor-arm-supervisor" (include "executor-arm.supervisorDir" .)) }}
{{- else }}
{{- $_ := set $docker "socket" "unix:///var/run/docker.sock" }}
{{- end }}
{{- $sandbox := dict
      "default_backend" (include "executor-arm.defaultBackend" .)
      "profiles_dir" (include "executor-arm.profilesDir" .)
      "search_path" $v.config.sandbox.searchPath
      "local" (dict "cgroup_name" $v.config.sandbox.local.cgroupName "uid_lock_dir" (printf "%s/uids" (include "executor-arm.stateDir" .)))
      "docker" $docker }}
{{- $commands := dict }}
{{- range $name, $c := $v.commands }}
{{- $e := dict "action_types" ($c.actionTypes | toStrings) "capabilities" ($c.capabilities | toStrings) "profile" $c.profile }}
{{- if $c.denyArgs }}{{ $_ := set $e "deny_args" ($c.denyArgs | toStrings) }}{{ end }}
{{- if $c.denyPrefixes }}{{ $_ := set $e "deny_prefixes" ($c.denyPrefixes | toStrings) }}{{ end }}
{{- $_ := set $commands $name $e }}
{{- end }}
{{- toJson (dict
      "server" $server
      "executions" (dict "retention_seconds" ($v.config.executions.retentionSeconds | int64))
      "sessions" $sessions
      "auth" $auth
      "audit" (dict "path" (include "executor-arm.auditLog" .))
      "state" $state
      "sandbox" $sandbox
      "executors" (dict "dir" (include "executor-arm.executorsDir" .))
      "commands" $commands) }}
{{- end }}

{{/* executor-arm.toml: the chart's settings with config.extra deep-merged over them. */}}
{{- define "executor-arm.configToml" -}}
{{- $cfg := include "executor-arm.configMap" . | fromJson }}
{{- include "executor-arm.intify" $cfg }}
{{- $extra := deepCopy (default dict .Values.config.extra) }}
{{- include "executor-arm.intify" $extra }}
{{- $cfg = mergeOverwrite $cfg $extra -}}
# executor-arm configuration, rendered by the {{ include "executor-arm.chart" . }} Helm chart
# (release {{ .Release.Name }}, mode {{ .Values.mode }}). Change the chart values, not this file;
# config.extra is merged over the keys the chart sets.
# Environment variables set on the container (EXECUTOR_ARM_LISTEN, EXECUTOR_ARM_JWT_SECRET_FILE,
# EXECUTOR_ARM_AUDIT_LOG, EXECUTOR_ARM_PROFILES_DIR, EXECUTOR_ARM_EXECUTORS_DIR, EXECUTOR_ARM_REDIS_URL,
# ALLOWED_COMMANDS, SANDBOX_RUNTIME) override the matching keys.
{{ toToml $cfg }}
{{- end }}

{{/* The sandbox profiles served, as YAML name -> TOML text: files/sandbox-profiles/*.toml (the
     repository's sandbox-profiles/), then the `profiles` value (a name replaces a shipped profile,
     null removes it). */}}
{{- define "executor-arm.profiles" -}}
{{- $out := dict }}
{{- range $path, $_ := .Files.Glob "files/sandbox-profiles/*.toml" }}
{{- $_ := set $out (base $path | trimSuffix ".toml") ($.Files.Get $path) }}
{{- end }}
{{- range $name, $text := .Values.profiles }}
{{- if kindIs "invalid" $text }}
{{- $_ := unset $out $name }}
{{- else }}
{{- $_ := set $out $name (toString $text) }}
{{- end }}
{{- end }}
{{- toYaml $out }}
{{- end }}

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
