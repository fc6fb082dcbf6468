{{- define "gpuhealth.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "gpuhealth.labels" -}}
app.kubernetes.io/part-of: gpuhealth
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- /* Where the chart mounts credentials (the same paths in both config files and the pod specs). */}}
{{- define "gpuhealth.agentTokenFile" -}}
{{- if eq .Values.auth.mode "tokenReview" -}}/var/run/gpuhealth/sa/token
{{- else if eq .Values.auth.mode "nodeSecret" -}}/var/run/gpuhealth/node-token/node.token
{{- end -}}
{{- end -}}

{{- define "gpuhealth.clusterSecretName" -}}
{{ .Values.auth.existingSecret | default "gpuhealth-cluster-secret" }}
{{- end -}}

{{- define "gpuhealth.operatorSecretName" -}}
{{ .Values.auth.existingOperatorSecret | default "gpuhealth-operator-token" }}
{{- end -}}

{{- /* A path a config file names must lie in the folder the pod mounts for it: the mounts are fixed, so a path
     elsewhere would land on the container's read-only root (or miss the host's socket). Refused, with the folder
     to keep it in. Args: key (as in the values), path, mount. */}}
{{- define "gpuhealth.requireUnderMount" -}}
{{- $path := clean (toString .path) }}
{{- if not (or (eq $path .mount) (hasPrefix (printf "%s/" .mount) $path)) }}
{{- fail (printf "%s: %s is outside %s, the folder the chart mounts for it (the pod's volumes do not follow this value); keep it under %s" .key (toString .path) .mount .mount) }}
{{- end }}
{{- end -}}

{{- /* The agent's config file: agent.config, with listen from agent.port, the coordinator's Service and the
     token file the chart mounts. A listen address in agent.config would part from the pod's ports: refused. */}}
{{- define "gpuhealth.agentConfig" -}}
{{- $cfg := deepCopy .Values.agent.config }}
{{- $agent := get $cfg "agent" | default dict }}
{{- if hasKey $agent "listen" }}
{{- fail "agent.config.agent.listen: set agent.port instead (the listen address, container port, Service and probes all follow it)" }}
{{- end }}
{{- $_ := set $agent "listen" (printf "0.0.0.0:%d" (int .Values.agent.port)) }}
{{- range $key, $mount := dict "state_dir" "/var/lib/gpuhealth" "socket_path" "/run/gpuhealth" "pod_resources_socket" "/var/lib/kubelet/pod-resources" }}
{{- if hasKey $agent $key }}
{{- include "gpuhealth.requireUnderMount" (dict "key" (printf "agent.config.agent.%s" $key) "path" (get $agent $key) "mount" $mount) }}
{{- end }}
{{- end }}
{{- $diag := get $cfg "diag" | default dict }}
{{- range $key, $mount := dict "state_dir" "/var/lib/gpuhealth" "screen_block_dir" "/run/gpuhealth" }}
{{- if get $diag $key }}
{{- include "gpuhealth.requireUnderMount" (dict "key" (printf "agent.config.diag.%s" $key) "path" (get $diag $key) "mount" $mount) }}
{{- end }}
{{- end }}
{{- if and .Values.coordinator.enabled (not (hasKey $agent "coordinator")) }}
{{- $_ := set $agent "coordinator" (printf "gpuhealth-coordinator.%s.svc:%d" .Release.Namespace (int .Values.coordinator.port)) }}
{{- end }}
{{- $_ := set $cfg "agent" $agent }}
{{- $tokenFile := include "gpuhealth.agentTokenFile" . }}
{{- if and .Values.coordinator.enabled $tokenFile }}
{{- $coord := get $cfg "coordinator" | default dict }}
{{- $_ := set $coord "token_file" $tokenFile }}
{{- $_ := set $cfg "coordinator" $coord }}
{{- end }}
{{- toYaml $cfg }}
{{- end -}}

{{- /* The coordinator's config file: coordinator.config, with its addresses from the port values and the
     authentication auth.mode asks for. */}}
{{- define "gpuhealth.coordinatorConfig" -}}
{{- $cfg := deepCopy .Values.coordinator.config }}
{{- $c := get $cfg "coordinator" | default dict }}
{{- range $key := list "listen" "metrics_listen" }}
{{- if hasKey $c $key }}
{{- fail (printf "coordinator.config.coordinator.%s: set coordinator.port / coordinator.metricsPort instead (the Deployment's ports, probes and Service follow them)" $key) }}
{{- end }}
{{- end }}
{{- range $key := list "db_path" "evidence_dir" }}
{{- if get $c $key }}
{{- include "gpuhealth.requireUnderMount" (dict "key" (printf "coordinator.config.coordinator.%s" $key) "path" (get $c $key) "mount" "/var/lib/gpuhealth") }}
{{- end }}
{{- end }}
{{- $_ := set $c "listen" (printf "0.0.0.0:%d" (int .Values.coordinator.port)) }}
{{- $_ := set $c "metrics_listen" (printf "0.0.0.0:%d" (int .Values.coordinator.metricsPort)) }}
{{- if eq .Values.auth.mode "tokenReview" }}
{{- $_ := set $c "token_review" "in-cluster" }}
{{- $_ := set $c "token_review_ca" "/var/run/gpuhealth/kube/ca.crt" }}
{{- $_ := set $c "token_review_credential_file" "/var/run/gpuhealth/kube/token" }}
{{- $_ := set $c "token_review_audience" .Values.auth.audience }}
{{- $_ := set $c "agent_service_accounts" (printf "system:serviceaccount:%s:gpuhealth-agent" .Release.Namespace) }}
{{- else if eq .Values.auth.mode "nodeSecret" }}
{{- $_ := set $c "node_secret_file" "/var/run/gpuhealth/cluster/secret" }}
{{- else }}
{{- $_ := set $c "allow_unauthenticated" true }}
{{- end }}
{{- $_ := set $cfg "coordinator" $c }}
{{- toYaml $cfg }}
{{- end -}}
