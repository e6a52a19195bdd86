{{/* Names: the release's prefix, and every pod's labels. */}}
{{- define "splitstack.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "splitstack.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The labels a component's selector matches: (dict "ctx" $ "component" "gateway") */}}
{{- define "splitstack.selector" -}}
app.kubernetes.io/name: {{ .ctx.Chart.Name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The label selector of every Ray worker pod of the release, all pools, not the head (a
selector's body): where the members run, one to a pod. */}}
{{- define "splitstack.workerSelector" -}}
matchLabels:
  app.kubernetes.io/name: {{ .Chart.Name }}
  app.kubernetes.io/instance: {{ .Release.Name }}
matchExpressions:
  - key: app.kubernetes.io/component
    operator: In
    values:
      {{- range $name := list "attention" "mlp" "prefill" }}
      - ray-worker-{{ $name }}
      {{- end }}
{{- end -}}

{{/* No public registry holds splitstack's image: the operator builds and pushes it. */}}
{{- define "splitstack.image" -}}
{{ required "image.repository must be set: no public registry holds splitstack's image. Build it (make image), push it to a registry your nodes pull from, and pass --set image.repository=REGISTRY/splitstack (the chart's README, Build and push)" .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* A Kubernetes quantity (2Gi, 1536Mi, 3G, 268435456, 1e9) in bytes, as an integer. */}}
{{- define "splitstack.bytes" -}}
{{- $q := toString . }}
{{- $number := regexFind "^[0-9.]+([eE][+-]?[0-9]+)?" $q }}
{{- $unit := trimPrefix $number $q }}
{{- $scale := dict "" 1 "k" 1000 "K" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000
      "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 }}
{{- if or (not $number) (not (hasKey $scale $unit)) }}
{{- fail (printf "%q is not a memory quantity splitstack reads (e.g. 2Gi, 1536Mi, 3G, bytes)" $q) }}
{{- end }}
{{- mulf (float64 $number) (index $scale $unit) | int64 }}
{{- end -}}

{{/* Every pod that starts a Ray node, with its memory limit: (list "what" limit). */}}
{{- define "splitstack.rayNodes" -}}
{{- $nodes := list (list "gateway.resources" (dig "limits" "memory" "" .Values.gateway.resources))
      (list "ray.head.resources" (dig "limits" "memory" "" .Values.ray.head.resources)) }}
{{- range $name := list "attention" "mlp" "prefill" }}
{{- $pool := index $.Values.pools $name }}
{{- if gt (int $pool.maxReplicas) 0 }}
{{- $nodes = append $nodes (list (printf "pools.%s.resources" $name) (dig "limits" "memory" "" $pool.resources)) }}
{{- end }}
{{- end }}
{{- toJson $nodes }}
{{- end -}}

{{/* "true" where the cluster serves the Prometheus Operator's API: ServiceMonitor, PodMonitor
and PrometheusRule objects are refused (and fail the install) anywhere else. `helm template`
knows no cluster: pass `--api-versions monitoring.coreos.com/v1` to render them. */}}
{{- define "splitstack.prometheusOperator" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}true{{ end }}
{{- end -}}

{{/* The Ray head's Service, which KubeRay names after the RayCluster. */}}
{{- define "splitstack.rayHead" -}}
{{ include "splitstack.fullname" . }}-head-svc
{{- end -}}

{{/* The Redis URL the gateway is given; with a password, `${SPLITSTACK_REDIS_PASSWORD}`
stands in it for the shell to expand from the environment (the Secret). */}}
{{- define "splitstack.redisUrl" -}}
{{- $url := .Values.redis.url }}
{{- if .Values.redis.enabled }}
{{- $url = printf "redis://%s-redis:%d/0" (include "splitstack.fullname" .) (int .Values.redis.port) }}
{{- end }}
{{- if and $url (include "splitstack.redisSecret" .) }}
{{- $url = regexReplaceAll "^(rediss?://)" $url "${1}:$${SPLITSTACK_REDIS_PASSWORD}@" }}
{{- end }}
{{- $url }}
{{- end -}}

{{/* A list of words as one shell line, each single-quoted. */}}
{{- define "splitstack.shellWords" -}}
{{- $out := list }}
{{- range . }}{{ $out = append $out (printf "'%s'" (replace "'" "'\\''" (toString .))) }}{{ end }}
{{- join " " $out }}
{{- end -}}

{{/* The Secret holding the Redis password, if any. */}}
{{- define "splitstack.redisSecret" -}}
{{- $a := .Values.redis.auth }}
{{- if $a.existingSecret }}{{ $a.existingSecret }}
{{- else if and $a.enabled .Values.redis.enabled }}{{ include "splitstack.fullname" . }}-redis
{{- end }}
{{- end -}}

{{/* The environment entry of the Redis password: (dict "ctx" $ "name" "VAR"). */}}
{{- define "splitstack.redisPasswordEnv" -}}
{{- with include "splitstack.redisSecret" .ctx -}}
- name: {{ $.name }}
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.ctx.Values.redis.auth.secretKey }}
{{- end }}
{{- end -}}

{{- define "splitstack.apiKeySecret" -}}
{{- if .Values.apiKey.existingSecret -}}
{{ .Values.apiKey.existingSecret }}
{{- else if .Values.apiKey.value -}}
{{ include "splitstack.fullname" . }}-api-key
{{- end -}}
{{- end -}}

{{- define "splitstack.adminApiKeySecret" -}}
{{- if .Values.adminApiKey.existingSecret -}}
{{ .Values.adminApiKey.existingSecret }}
{{- else if .Values.adminApiKey.value -}}
{{ include "splitstack.fullname" . }}-admin-api-key
{{- end -}}
{{- end -}}

{{/* SPLITSTACK_ADMIN_API_KEY from the admin key's Secret, where one is set. */}}
{{- define "splitstack.adminApiKeyEnv" -}}
{{- $secret := include "splitstack.adminApiKeySecret" . -}}
{{- if $secret }}
- name: SPLITSTACK_ADMIN_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ .Values.adminApiKey.secretKey }}
{{- end }}
{{- end -}}

{{/* Pod and container security contexts: non-root, no privilege escalation, no
capabilities, the runtime's seccomp profile. */}}
{{- define "splitstack.podSecurity" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsUser }}
fsGroup: {{ .Values.securityContext.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "splitstack.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: {{ .Values.securityContext.readOnlyRootFilesystem }}
runAsNonRoot: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* Environment every splitstack process gets: Ray's settings, and writable places
under /tmp (an emptyDir) for a read-only root filesystem. */}}
{{- define "splitstack.env" -}}
- name: HOME
  value: /tmp
- name: TMPDIR
  value: /tmp
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
- name: RAY_AUTH_MODE
  value: disabled
- name: TOKENIZERS_PARALLELISM
  value: "false"
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod-level fields every splitstack pod shares; "serviceAccount": with serviceAccountName. */}}
{{- define "splitstack.podCommon" -}}
{{- $v := .ctx.Values }}
{{- with $v.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- if and .serviceAccount $v.serviceAccountName }}
serviceAccountName: {{ $v.serviceAccountName }}
{{- end }}
{{- with .spread }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Volumes of a pod that runs splitstack (model, /tmp, /dev/shm); "withModel": mount the
model source. */}}
{{- define "splitstack.volumes" -}}
- name: tmp
  emptyDir: {}
- name: shm
  emptyDir:
    medium: Memory
{{- if .withModel }}
{{- $m := .ctx.Values.model }}
{{- if eq $m.source "import-gguf" }}
- name: model
  emptyDir: {}
{{- else if eq $m.source "huggingface" }}
- name: model
  {{- with $m.huggingface.cachePvcClaimName }}
  persistentVolumeClaim:
    claimName: {{ . }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- else if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvcClaimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ $m.hostPath }}
    type: Directory
{{- end }}
{{- end }}
{{- end -}}

{{- define "splitstack.mounts" -}}
- name: tmp
  mountPath: /tmp
- name: shm
  mountPath: /dev/shm
{{- if and .withModel (ne .ctx.Values.model.source "image") }}
- name: model
  mountPath: {{ .ctx.Values.model.mountPath }}
  readOnly: {{ not (has .ctx.Values.model.source (list "import-gguf" "huggingface")) }}
{{- end }}
{{- end -}}

{{/* The init container that imports the default model (source import-gguf). */}}
{{- define "splitstack.modelInit" -}}
{{- if eq .Values.model.source "import-gguf" -}}
initContainers:
  - name: import-model
    image: {{ include "splitstack.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["splitstack", "import-gguf", "--out", {{ .Values.model.path | quote }}]
    env:
      {{- include "splitstack.env" . | nindent 6 }}
    resources:
      {{- toYaml .Values.model.initResources | nindent 6 }}
    securityContext:
      {{- include "splitstack.containerSecurity" . | nindent 6 }}
    volumeMounts:
      {{- include "splitstack.mounts" (dict "ctx" . "withModel" true) | nindent 6 }}
{{- else if eq .Values.model.source "huggingface" -}}
{{- $hf := .Values.model.huggingface }}
initContainers:
  - name: download-model
    image: {{ include "splitstack.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["hf", "download", {{ $hf.repo | quote }}, "--revision", {{ $hf.revision | quote }},
              "--local-dir", {{ .Values.model.path | quote }}]
    env:
      {{- include "splitstack.env" . | nindent 6 }}
      - name: HF_HOME
        value: /tmp/huggingface
      - name: HF_HUB_DISABLE_TELEMETRY
        value: "1"
      {{- with $hf.endpoint }}
      - name: HF_ENDPOINT
        value: {{ . | quote }}
      {{- end }}
      {{- with $hf.tokenSecret }}
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef:
            name: {{ . }}
            key: token
      {{- end }}
    resources:
      {{- toYaml .Values.model.initResources | nindent 6 }}
    securityContext:
      {{- include "splitstack.containerSecurity" . | nindent 6 }}
    volumeMounts:
      {{- include "splitstack.mounts" (dict "ctx" . "withModel" true) | nindent 6 }}
{{- end }}
{{- end -}}

{{/* Checks across values that a JSON schema cannot state. */}}
{{- define "splitstack.checks" -}}
{{- $_ := include "splitstack.image" . }}
{{- /* Ray refuses to start a node whose object store leaves too little of the pod's
memory ("-0.16 GB available"), and the pod restarts forever */}}
{{- $store := int64 .Values.ray.objectStoreMemory }}
{{- range $node := include "splitstack.rayNodes" . | fromJsonArray }}
{{- $limit := index $node 1 }}
{{- if $limit }}
{{- if lt (sub (include "splitstack.bytes" $limit | int64) $store) 1073741824 }}
{{- fail (printf "%s: a memory limit of %v leaves less than 1 GiB beside ray.objectStoreMemory (%d bytes), and Ray refuses to start that node; raise the limit or lower ray.objectStoreMemory" (index $node 0) $limit $store) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $name, $pool := .Values.pools }}
{{- if or (lt (int $pool.replicas) (int $pool.minReplicas)) (gt (int $pool.replicas) (int $pool.maxReplicas)) }}
{{- fail (printf "pools.%s.replicas (%d) must lie within minReplicas (%d) and maxReplicas (%d)" $name (int $pool.replicas) (int $pool.minReplicas) (int $pool.maxReplicas)) }}
{{- end }}
{{- end }}
{{- if lt (int .Values.pools.attention.replicas) 1 }}
{{- fail "pools.attention.replicas must be at least 1: the attention services own the requests" }}
{{- end }}
{{- if and (ne .Values.serve.transport "local") (lt (int .Values.pools.mlp.replicas) 1) }}
{{- fail "pools.mlp.replicas must be at least 1 (0 only under serve.transport local, where the pool runs inside each attention service)" }}
{{- end }}
{{- if and .Values.serve.prefixCache (lt (int .Values.pools.prefill.replicas) 1) }}
{{- fail "serve.prefixCache needs pools.prefill.replicas of at least 1: the prefix cache lives in the prefill replicas" }}
{{- end }}
{{- if le (float64 .Values.ray.terminationGracePeriodSeconds) (float64 .Values.serve.drainTimeoutSeconds) }}
{{- fail "ray.terminationGracePeriodSeconds must be more than serve.drainTimeoutSeconds: a worker pod's members drain before it stops" }}
{{- end }}
{{- if and .Values.gateway.hpa.enabled (not .Values.autoscaling.enabled) }}
{{- fail "gateway.hpa.enabled needs autoscaling.enabled: each gateway places its own pool members, and only the Ray autoscaler adds the worker pods a new gateway's members need" }}
{{- end }}
{{- if .Values.autoscaling.enabled }}
{{- if eq .Values.serve.transport "nccl" }}
{{- fail "autoscaling.enabled: no pool resizes under serve.transport nccl" }}
{{- end }}
{{- range $name, $pool := .Values.pools }}
{{- if and (gt (int $pool.maxReplicas) 0) (lt (int $pool.minReplicas) 1) }}
{{- fail (printf "autoscaling.enabled: pools.%s.minReplicas must be at least 1 (an autoscaled pool keeps a member)" $name) }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The pools the gateway may resize while serving (what `fixed_pools` allows), with their
counts: "attention=1 mlp=3". */}}
{{- define "splitstack.resizable" -}}
{{- $out := list }}
{{- if ne .Values.serve.transport "nccl" }}
{{- $out = append $out (printf "attention=%d" (int .Values.pools.attention.replicas)) }}
{{- if ne .Values.serve.transport "local" }}
{{- $out = append $out (printf "mlp=%d" (int .Values.pools.mlp.replicas)) }}
{{- end }}
{{- if gt (int .Values.pools.prefill.replicas) 0 }}
{{- $out = append $out (printf "prefill=%d" (int .Values.pools.prefill.replicas)) }}
{{- end }}
{{- end }}
{{- join " " $out }}
{{- end -}}

{{/* Each pool's size when a gateway starts, as JSON (the pools ConfigMap's data). */}}
{{- define "splitstack.poolSizes" -}}
{{- $p := .Values.pools }}
{{- dict "attention" (toString (int $p.attention.replicas)) "mlp" (toString (max 1 (int $p.mlp.replicas)))
      "prefill" (toString (int $p.prefill.replicas)) | toJson }}
{{- end -}}

{{/* The scale hook's script: every ready gateway pod (the headless Service's addresses)
takes each resizable pool's size, each `splitstack scale` retried until one deadline. No
ready gateway: nothing to do (a gateway that starts reads the sizes from the ConfigMap). */}}
{{- define "splitstack.scaleScript" -}}
{{- $fullname := include "splitstack.fullname" . -}}
end=$(( $(date +%s) + {{ int .Values.scaleHook.timeoutSeconds }} ))
gateways=$(getent ahostsv4 {{ $fullname }}-gateway-pods | awk '{print $1}' | sort -u)
if [ -z "$gateways" ]; then echo 'no ready gateway: each reads the new sizes when it starts'; exit 0; fi
for ip in $gateways; do
  for p in {{ include "splitstack.resizable" . }}; do
    until splitstack scale "${p%=*}" "${p#*=}" --wait --timeout "$(( end - $(date +%s) ))" --url "http://$ip:{{ int .Values.gateway.port }}"; do
      if [ "$(date +%s)" -ge "$end" ]; then echo "error: gateway $ip: ${p%=*} not at ${p#*=} within {{ int .Values.scaleHook.timeoutSeconds }} s" >&2; exit 1; fi
      sleep 5
    done
  done
done
{{- end -}}

{{/* The gateway container's shell line: join the Ray cluster as a node with no CPUs and no
pool resource, then run `splitstack serve` as the container's main process (exec: it gets
the SIGTERM and drains). Pool sizes come from the pools ConfigMap through the environment. */}}
{{- define "splitstack.gatewayCommand" -}}
{{- $v := .Values }}
{{- $head := printf "%s:6379" (include "splitstack.rayHead" .) }}
{{- $redis := include "splitstack.redisUrl" . }}
{{- $maxReplicas := 1 }}
{{- range $pool := $v.pools }}{{- $maxReplicas = max $maxReplicas (int $pool.maxReplicas) }}{{- end }}
{{- $ray := list "ray" "start" (printf "--address=%s" $head) "--num-cpus=0"
      (printf "--object-store-memory=%d" (int $v.ray.objectStoreMemory)) "--disable-usage-stats" }}
{{- $a := list "exec" "splitstack" "serve" "--model" (squote $v.model.path) "--host" "0.0.0.0"
      "--port" (toString $v.gateway.port) "--address" $head
      "--attention-shards" "\"$SPLITSTACK_ATTENTION_REPLICAS\""
      "--mlp-replicas" "\"$SPLITSTACK_MLP_REPLICAS\""
      "--prefill-replicas" "\"$SPLITSTACK_PREFILL_REPLICAS\""
      "--transport" $v.serve.transport }}
{{- if $v.serve.gpu }}{{ $a = append $a "--gpu" }}{{ end }}
{{- if $v.serve.wiring }}{{ $a = concat $a (list "--wiring" $v.serve.wiring) }}{{ end }}
{{- $a = concat $a (list "--kv-splits" (toString $v.serve.kvSplits)
      "--kv-cache-gib" (toString $v.serve.kvCacheGiB) "--max-num-seqs" (toString $v.serve.maxNumSeqs)
      "--dtype" $v.serve.dtype "--threads" (toString $v.serve.threads)
      "--max-replicas" (toString $maxReplicas) "--drain-timeout" (toString $v.serve.drainTimeoutSeconds)) }}
{{- if $v.model.servedName }}{{ $a = concat $a (list "--served-model-name" (squote $v.model.servedName)) }}{{ end }}
{{- $quoted := ternary (quote $redis) (squote $redis) (contains "${" $redis) }}
{{- if $v.serve.prefixCache }}{{ $a = concat $a (list "--prefix-cache" "--redis-url" $quoted) }}{{ end }}
{{- if and $v.serve.prefixCache $v.serve.prefixCacheTtlSeconds }}{{ $a = concat $a (list "--prefix-cache-ttl" (toString (int $v.serve.prefixCacheTtlSeconds))) }}{{ end }}
{{- if $redis }}{{ $a = concat $a (list "--responses-redis-url" $quoted "--responses-ttl" (toString (int $v.serve.responsesTtlSeconds))) }}{{ end }}
{{- if $redis }}{{ $a = concat $a (list "--rate-limit-redis" $quoted) }}{{ end }}
{{- if $v.serve.rateLimitRpm }}{{ $a = concat $a (list "--rate-limit-rpm" (toString (int $v.serve.rateLimitRpm))) }}{{ end }}
{{- if $v.serve.rateLimitTpm }}{{ $a = concat $a (list "--rate-limit-tpm" (toString (int $v.serve.rateLimitTpm))) }}{{ end }}
{{- if $v.grpcTokenSecret }}{{ $a = concat $a (list "--grpc-token-file" "/etc/splitstack/grpc/token") }}{{ end }}
{{- with $v.monitoring.slo }}
{{- $a = concat $a (list "--slo-ttft-ms" (toString (int .ttftMs)) "--slo-itl-ms" (toString (int .itlMs))) }}
{{- end }}
{{- with $v.monitoring.tracing.otlpEndpoint }}{{ $a = concat $a (list "--otlp-traces-endpoint" (squote .)) }}{{ end }}
{{- if $v.autoscaling.enabled }}
{{- $bounds := list }}
{{- range $name := list "attention" "mlp" "prefill" }}
{{- $p := index $v.pools $name }}
{{- if and (gt (int $p.replicas) 0) (or (ne $name "mlp") (ne $v.serve.transport "local")) }}
{{- $bounds = append $bounds (printf "%s=%d:%d" $name (int $p.minReplicas) (int $p.maxReplicas)) }}
{{- end }}
{{- end }}
{{- $a = concat $a (list "--autoscale" (join "," $bounds)) }}
{{- end }}
{{- range $v.serve.extraArgs }}{{ $a = append $a (squote .) }}{{ end }}
{{- printf "%s && %s" (join " " $ray) (join " " $a) }}
{{- end -}}

{{/* A worker pod's preStop: SIGTERM to its pool members' processes (Ray names an actor's
process after its class), then wait until they are gone. */}}
{{- define "splitstack.drainMembers" -}}
{{- $members := "^ray::(AttentionReplica|PoolReplica|PrefillReplica)" -}}
pkill -TERM -f '{{ $members }}'; while pgrep -f '{{ $members }}' >/dev/null; do sleep 1; done
{{- end -}}
