{{/* Names, labels, the checks values.schema.json cannot express, and the rendered topology. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The topology's cluster.name. */}}
{{- define "tandem.clusterName" -}}
{{- default .Release.Name .Values.clusterName -}}
{{- end -}}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" . }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end -}}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Secret names. */}}
{{- define "tandem.redisSecretName" -}}
{{- printf "%s-redis" (include "tandem.fullname" .) -}}
{{- end -}}

{{- define "tandem.apiTokenSecretName" -}}
{{- default (printf "%s-api-token" (include "tandem.fullname" .)) .Values.server.auth.existingSecret -}}
{{- end -}}

{{- define "tandem.rayTokenSecretName" -}}
{{- default (printf "%s-ray-token" (include "tandem.fullname" .)) .Values.ray.auth.existingSecret -}}
{{- end -}}

{{/* Environment variable names the topology refers to. */}}
{{- define "tandem.redisPasswordEnv" -}}TANDEM_REDIS_PASSWORD{{- end -}}
{{- define "tandem.apiTokenEnv" -}}TANDEM_API_TOKEN{{- end -}}

{{/* Where the ConfigMap (topology.yaml, start-head.sh, wait_for_workers.py) is mounted. */}}
{{- define "tandem.configDir" -}}/etc/tandem{{- end -}}

{{/* The custom Ray resource each pool's pods declare (one unit per rank). */}}
{{- define "tandem.poolResource" -}}tandem-{{ . }}{{- end -}}

{{/* Whether the chart deploys Redis. */}}
{{- define "tandem.internalRedis" -}}
{{- if not .Values.redis.external.url -}}true{{- end -}}
{{- end -}}

{{/*
A value that lives in a Secret of this chart: the one given, else the one already stored (so
that an upgrade keeps it), else a random one. Arguments: list of root context, Secret name, key,
given value.
*/}}
{{- define "tandem.secretValue" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $key := index . 2 -}}
{{- $given := index . 3 -}}
{{- if $given -}}
{{- $given -}}
{{- else -}}
{{- $existing := lookup "v1" "Secret" $root.Release.Namespace $name -}}
{{- if and $existing $existing.data (hasKey $existing.data $key) -}}
{{- index $existing.data $key | b64dec -}}
{{- else -}}
{{- randAlphaNum 40 -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The GPUs of one pod of a pool: tp x gpusPerRank. Argument: the pool's values. */}}
{{- define "tandem.podGpus" -}}
{{- mul (int .tp) (int .gpusPerRank) -}}
{{- end -}}

{{/* The Ray CPUs of one pod of a pool: tp x cpusPerRank, rounded up (`ray start` takes whole CPUs). */}}
{{- define "tandem.podRayCpus" -}}
{{- mulf (float64 .tp) (float64 .cpusPerRank) | ceil | int -}}
{{- end -}}

{{/*
The checks that JSON Schema cannot express (values.schema.json has the rest); each failure
names the values involved.
*/}}
{{- define "tandem.validate" -}}
{{- range $role := list "prefill" "decode" -}}
{{- $p := index $.Values $role -}}
{{- $gpus := mul (int $p.tp) (int $p.gpusPerRank) -}}
{{- if and (not (kindIs "invalid" $p.gpusPerNode)) (gt (int64 $gpus) (int64 $p.gpusPerNode)) -}}
{{- fail (printf "%s.tp (%d) x %s.gpusPerRank (%d) exceeds %s.gpusPerNode (%d): a worker's TP group must fit on one node" $role (int $p.tp) $role (int $p.gpusPerRank) $role (int $p.gpusPerNode)) -}}
{{- end -}}
{{- if $p.resources -}}
{{- range $kind := list "requests" "limits" -}}
{{- if and (index $p.resources $kind) (hasKey (index $p.resources $kind) $.Values.gpuResourceName) -}}
{{- fail (printf "%s.resources.%s.%s: leave the GPUs out, the chart sets %s.tp x %s.gpusPerRank (%d)" $role $kind $.Values.gpuResourceName $role $role $gpus) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (eq .Values.model.source "pvc") (not .Values.model.pvc.claimName) -}}
{{- fail "model.pvc.claimName: name the PersistentVolumeClaim holding the model (model.source is pvc)" -}}
{{- end -}}
{{- if and (eq .Values.model.source "hostPath") (not .Values.model.hostPath.path) -}}
{{- fail "model.hostPath.path: give the node directory holding the model (model.source is hostPath)" -}}
{{- end -}}
{{- if and .Values.server.tls.enabled (not .Values.server.tls.secretName) -}}
{{- fail "server.tls.secretName: name the kubernetes.io/tls Secret to serve with (server.tls.enabled is true)" -}}
{{- end -}}
{{- $rayPorts := dict "6379" "the Ray GCS" "10001" "the Ray client server" "52365" "the Ray dashboard agent" (toString (int .Values.dashboard.port)) "dashboard.port (the Ray dashboard)" (toString (int .Values.metrics.port)) "metrics.port (Ray's metrics agent)" -}}
{{- if hasKey $rayPorts (toString (int .Values.server.port)) -}}
{{- fail (printf "server.port (%d) is taken by %s" (int .Values.server.port) (index $rayPorts (toString (int .Values.server.port)))) -}}
{{- end -}}
{{- if eq (int .Values.dashboard.port) (int .Values.metrics.port) -}}
{{- fail (printf "dashboard.port (%d) and metrics.port (%d) must differ" (int .Values.dashboard.port) (int .Values.metrics.port)) -}}
{{- end -}}
{{- with .Values.redis.external -}}
{{- if .url -}}
{{- $rest := regexReplaceAll "^rediss?://" .url "" -}}
{{- if and (contains "@" $rest) .passwordSecret.name -}}
{{- fail "redis.external.url holds a password and redis.external.passwordSecret names a Secret: give the password in one place (the Secret)" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- with .Values.router -}}
{{- if .sloClasses -}}
{{- $default := default "standard" .defaultClass -}}
{{- if not (hasKey .sloClasses $default) -}}
{{- fail (printf "router.defaultClass (%s) is not one of router.sloClasses (%s)" $default (keys .sloClasses | sortAlpha | join ", ")) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The registry URL of the topology (without a password: that comes from password_env). */}}
{{- define "tandem.registryUrl" -}}
{{- if include "tandem.internalRedis" . -}}
{{- printf "redis://%s-redis.%s.svc:6379/%d" (include "tandem.fullname" .) .Release.Namespace (int .Values.redis.database) -}}
{{- else -}}
{{- .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{/* Whether the head gets a Redis password (and the topology names its variable). */}}
{{- define "tandem.redisHasPassword" -}}
{{- if or (include "tandem.internalRedis" .) .Values.redis.external.passwordSecret.name -}}true{{- end -}}
{{- end -}}

{{/*
The topology `tandem up` reads, in the format of cluster/topology.py: every section from the
values, the pools pinned to their pods by the custom resources, Ray joined on the head.
*/}}
{{- define "tandem.topology" -}}
{{- $v := .Values -}}
{{- $t := dict -}}
{{- $_ := set $t "cluster" (dict "name" (include "tandem.clusterName" .)) -}}
{{- $_ := set $t "model" (dict "path" $v.model.mountPath "name" $v.model.name "dtype" $v.model.dtype "max_model_len" $v.model.maxModelLen) -}}
{{- range $role := list "prefill" "decode" -}}
{{- $p := index $v $role -}}
{{- $node := dict "gpus" $p.gpusPerNode "resources" (dict (include "tandem.poolResource" $role) 1) -}}
{{- $pool := dict "replicas" $p.replicas "tp" $p.tp "gpus_per_rank" $p.gpusPerRank "cpus_per_rank" $p.cpusPerRank "node" $node "max_num_batched_tokens" $p.maxNumBatchedTokens "max_num_seqs" $p.maxNumSeqs "threads" $p.threads -}}
{{- if not (kindIs "invalid" $p.speculative) -}}
{{- $s := $p.speculative -}}
{{- $spec := dict -}}
{{- range $key := list "method" "adaptive" -}}
{{- if hasKey $s $key -}}{{- $_ := set $spec $key (index $s $key) -}}{{- end -}}
{{- end -}}
{{- range $from, $to := dict "numTokens" "num_tokens" "ngramMin" "ngram_min" "ngramMax" "ngram_max" -}}
{{- if hasKey $s $from -}}{{- $_ := set $spec $to (int (index $s $from)) -}}{{- end -}}
{{- end -}}
{{- $_ := set $pool "speculative" $spec -}}
{{- end -}}
{{- $_ := set $t $role $pool -}}
{{- end -}}
{{- $kv := $v.kv -}}
{{- $_ := set $t "kv" (dict "block_size" $kv.blockSize "cache_memory_fraction" $kv.cacheMemoryFraction "num_blocks" $kv.numBlocks "prefix_caching" $kv.prefixCaching "transport" $kv.transport "transfer_timeout_s" $kv.transferTimeoutS "stream_layers" $kv.streamLayers) -}}
{{- $r := $v.router -}}
{{- $router := dict "policy" $r.policy -}}
{{- if $r.weights -}}{{- $_ := set $router "weights" $r.weights -}}{{- end -}}
{{- if not (kindIs "invalid" $r.admissionControl) -}}{{- $_ := set $router "admission_control" $r.admissionControl -}}{{- end -}}
{{- if $r.sloClasses -}}
{{- $classes := dict -}}
{{- range $name, $c := $r.sloClasses -}}
{{- $_ := set $classes $name (dict "ttft_ms" $c.ttftMs "tpot_ms" $c.tpotMs "priority" (default 0 $c.priority) "on_overload" (default "queue" $c.onOverload)) -}}
{{- end -}}
{{- $_ := set $router "slo_classes" $classes -}}
{{- end -}}
{{- if not (kindIs "invalid" $r.defaultClass) -}}{{- $_ := set $router "default_class" $r.defaultClass -}}{{- end -}}
{{- if not (kindIs "invalid" $r.skipPrefillFraction) -}}{{- $_ := set $router "skip_prefill_fraction" $r.skipPrefillFraction -}}{{- end -}}
{{- if not (kindIs "invalid" $r.loadRefreshS) -}}{{- $_ := set $router "load_refresh_s" $r.loadRefreshS -}}{{- end -}}
{{- if not (kindIs "invalid" $r.registryRetryS) -}}{{- $_ := set $router "registry_retry_s" $r.registryRetryS -}}{{- end -}}
{{- if not (kindIs "invalid" $r.localPrefillMaxTokens) -}}{{- $_ := set $router "local_prefill_max_tokens" (int $r.localPrefillMaxTokens) -}}{{- end -}}
{{- if not (kindIs "invalid" $r.migrationLimit) -}}{{- $_ := set $router "migration_limit" (int $r.migrationLimit) -}}{{- end -}}
{{- if not (kindIs "invalid" $r.queueLimit) -}}{{- $_ := set $router "queue_limit" (int $r.queueLimit) -}}{{- end -}}
{{- if not (kindIs "invalid" $r.prefillShortlist) -}}{{- $_ := set $router "prefill_shortlist" (int $r.prefillShortlist) -}}{{- end -}}
{{- $_ := set $t "router" $router -}}
{{- $registry := dict "url" (include "tandem.registryUrl" .) "password_env" nil -}}
{{- if include "tandem.redisHasPassword" . -}}{{- $_ := set $registry "password_env" (include "tandem.redisPasswordEnv" .) -}}{{- end -}}
{{- $_ := set $t "registry" $registry -}}
{{- $server := dict "host" "0.0.0.0" "port" $v.server.port "tls" nil "auth_token_env" nil "auth_token_file" nil "replicas" (int $v.server.replicas) "http_port" (ternary nil $v.server.httpPort (kindIs "invalid" $v.server.httpPort)) -}}
{{- if $v.server.tls.enabled -}}
{{- $_ := set $server "tls" (dict "cert_file" (printf "%s/tls.crt" $v.server.tls.mountPath) "key_file" (printf "%s/tls.key" $v.server.tls.mountPath)) -}}
{{- end -}}
{{- if $v.server.auth.enabled -}}{{- $_ := set $server "auth_token_env" (include "tandem.apiTokenEnv" .) -}}{{- end -}}
{{- $_ := set $t "server" $server -}}
{{- $tracing := dict "exporter" $v.tracing.exporter "endpoint" (default nil $v.tracing.endpoint) "service_name" $v.tracing.serviceName "sample_ratio" $v.tracing.sampleRatio -}}
{{- $_ := set $t "observability" (dict "dashboard" true "dashboard_host" "0.0.0.0" "dashboard_port" $v.dashboard.port "metrics_export_port" $v.metrics.port "tracing" $tracing) -}}
{{- $_ := set $t "ray" (dict "address" "127.0.0.1:6379" "node_wait_s" $v.planner.nodeWaitS) -}}
{{- $pl := $v.planner -}}
{{- $planner := dict "mode" $pl.mode "prefill_min" (int $pl.prefillMin) "decode_min" (int $pl.decodeMin) -}}
{{- range $from, $to := dict "intervalS" "interval_s" "windowS" "window_s" "measureS" "measure_s" "prefillMax" "prefill_max" "decodeMax" "decode_max" "minWorkers" "min_workers" "maxWorkers" "max_workers" "minGain" "min_gain" "confirmations" "confirmations" "cooldownS" "cooldown_s" -}}
{{- if not (kindIs "invalid" (index $pl $from)) -}}{{- $_ := set $planner $to (index $pl $from) -}}{{- end -}}
{{- end -}}
{{- $_ := set $t "planner" $planner -}}
{{- toYaml $t -}}
{{- end -}}

{{/*
A worker group's replica bounds, as JSON {"min": .., "max": ..}: its pool's replicas, or with the
planner in act its pool's bounds as the planner reads them (cluster/plan/live/propose.py, Bounds.of),
widened to hold the replicas it starts with. Argument: dict root, role.
*/}}
{{- define "tandem.groupBounds" -}}
{{- $v := .root.Values -}}
{{- $pl := $v.planner -}}
{{- $replicas := int (index $v .role).replicas -}}
{{- if eq $pl.mode "act" -}}
{{- $most := int (default (add (int $v.prefill.replicas) (int $v.decode.replicas)) $pl.maxWorkers) -}}
{{- $other := ternary "decode" "prefill" (eq .role "prefill") -}}
{{- $low := int (index $pl (printf "%sMin" .role)) -}}
{{- $high := int (default (sub $most (int (index $pl (printf "%sMin" $other)))) (index $pl (printf "%sMax" .role))) -}}
{{- toJson (dict "min" (min $low $replicas) "max" (max $high $replicas)) -}}
{{- else -}}
{{- toJson (dict "min" $replicas "max" $replicas) -}}
{{- end -}}
{{- end -}}

{{/* "true" when KubeRay's autoscaler runs: the planner acts, and some pool may grow past its replicas. */}}
{{- define "tandem.autoscaling" -}}
{{- range $role := list "prefill" "decode" -}}
{{- $b := include "tandem.groupBounds" (dict "root" $ "role" $role) | fromJson -}}
{{- if gt (int $b.max) (int (index $.Values $role).replicas) -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/* Ray resources the head waits for before `tandem up`: every pool pod's custom resource. */}}
{{- define "tandem.waitResources" -}}
{{- $need := dict -}}
{{- range $role := list "prefill" "decode" -}}
{{- $p := index $.Values $role -}}
{{- $_ := set $need (include "tandem.poolResource" $role) (mul (int $p.replicas) (int $p.tp)) -}}
{{- end -}}
{{- toJson $need -}}
{{- end -}}

{{/* Ray's token, for every process that talks to Ray (the Ray containers, the autoscaler). */}}
{{- define "tandem.rayAuthEnv" -}}
{{- if .Values.ray.auth.enabled -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.rayTokenSecretName" . }}
      key: {{ .Values.ray.auth.secretKey }}
{{- end -}}
{{- end -}}

{{/* Environment of every Ray container. */}}
{{- define "tandem.rayEnv" -}}
- name: TANDEM_CACHE_DIR
  value: /var/cache/tandem
{{- /* Ray starts its workers at nice 15; Tandem's workers are the service (see cluster/runtime/ray_runtime.py). */}}
- name: RAY_worker_niceness
  value: "0"
{{- with include "tandem.rayAuthEnv" . }}
{{ . }}
{{- end }}
{{- with .Values.pods.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Volumes of every Ray pod. Argument: dict root, shmSize. */}}
{{- define "tandem.rayVolumes" -}}
{{- $v := .root.Values -}}
- name: model
{{- if eq $v.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ $v.model.pvc.claimName }}
    readOnly: true
{{- else }}
  hostPath:
    path: {{ $v.model.hostPath.path }}
    type: {{ $v.model.hostPath.type }}
{{- end }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
- name: tandem-cache
  emptyDir: {}
{{- with $v.pods.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Volume mounts of every Ray container. */}}
{{- define "tandem.rayVolumeMounts" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- with .Values.model.subPath }}
  subPath: {{ . }}
{{- end }}
- name: shm
  mountPath: /dev/shm
- name: tandem-cache
  mountPath: /var/cache/tandem
{{- with .Values.pods.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod-level settings shared by the Ray pods. */}}
{{- define "tandem.podCommon" -}}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- with .Values.pods.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with .Values.pods.securityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
