{{/*
The templates are the source of deploy/*.yaml: their render with the default values,
byte for byte (tests/tests/integration/chart.rs). Keep the manifests' comments here; they are what
a reader of deploy/ or of the installed objects has. After a change, regenerate
deploy/ with SHAREGUARD_WRITE_MANIFESTS=1 cargo test -p shareguard-tests --test chart.
*/}}

{{/*
What every object's name starts with (values.yaml, fullnameOverride): the release's
name where it says shareguard already, else <release>-shareguard. At most 40
characters, so that the longest name made from it stays short; a longer one is refused
rather than cut, since two releases cut to one prefix would share their objects.
*/}}
{{- define "shareguard.fullname" -}}
{{- $name := .Values.fullnameOverride | default (ternary .Release.Name (printf "%s-shareguard" .Release.Name) (contains "shareguard" .Release.Name)) }}
{{- if gt (len $name) 40 }}
{{- fail (printf "the objects' name prefix %q (from the release name) is %d characters, over 40: set fullnameOverride" $name (len $name)) }}
{{- end }}
{{- $name }}
{{- end }}

{{/* The metrics token's Secret: metrics.tokenSecret.name, or <fullname>-metrics-token. */}}
{{- define "shareguard.metricsSecret" -}}
{{ .Values.metrics.tokenSecret.name | default (printf "%s-metrics-token" (include "shareguard.fullname" .)) }}
{{- end }}

{{/* The image of both DaemonSets: the tag defaults to the chart's appVersion. */}}
{{- define "shareguard.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- with .Values.image.digest }}@{{ . }}{{ end }}
{{- end }}

{{/* A TOML string. Go's %q escapes are TOML's for the characters names use. */}}
{{- define "shareguard.tomlString" -}}
{{ . | toString | quote }}
{{- end }}

{{/* A TOML array of strings. */}}
{{- define "shareguard.tomlStrings" -}}
[{{ range $i, $s := . }}{{ if $i }}, {{ end }}{{ $s | toString | quote }}{{ end }}]
{{- end }}

{{/*
The [[device]] tables of agent.toml, each after a blank line and the comment of its
kind, at the ConfigMap's indentation. Called with (dict "root" $ "devices" LIST). The
defaults give daemonset.yaml's devices.
*/}}
{{- define "shareguard.devices" -}}
{{- $root := .root }}
{{- range .devices }}
{{- $d := . }}
{{- printf "\n" }}
{{- if eq .kind "net" }}
    # Bandwidth on the node's NIC.
{{- $bw := dig "capacity" "bandwidth" "" $d }}
{{- if kindIs "map" $bw }}{{ if hasKey $bw "value" }} `value` is given: without it the agent reads the
    # link speed of `interface` from /sys/class/net, which is per node, and publishes
    # it, or the `link_percent` of it that leaves tenants' latency headroom.
{{- else if hasKey $bw "linkPercent" }} No `value`: the agent publishes `link_percent` of the
    # link speed of `interface` from /sys/class/net, on each node.
{{- else }} No `value`: the agent reads the link speed of `interface`
    # from /sys/class/net, on each node.
{{- end }}{{ end }}
{{- else if eq .kind "gpu" }}
{{- if and (eq (.backend | default "nvml") "nvml") (eq (.gpus | default "") "all") }}
    # GPU memory through NVML: every GPU NVML lists when the agent starts, each a device
    # named <name>-<its uuid>. A node without an NVIDIA driver gets none from this
    # table (the log says why); a driver that comes up later is taken at the agent's
    # next restart.
{{- else if eq (.backend | default "nvml") "nvml" }}
    # GPU memory through NVML. On a node without an NVIDIA driver the device is
    # reported unavailable with the reason, and the other devices are served.
{{- else }}
    # GPU memory, {{ .backend }} back end.
{{- end }}
{{- else }}
    # Accounting only, no enforcement.
{{- end }}
    [[device]]
    name = {{ include "shareguard.tomlString" .name }}
    driver = {{ include "shareguard.tomlString" $root.Values.driverName }}
    kind = {{ include "shareguard.tomlString" .kind }}
{{- if eq .kind "net" }}
{{- with .interface }}
    interface = {{ include "shareguard.tomlString" . }}
{{- end }}
    # auto: htb-ebpf where HTB exists, else bpf-policer. edt-fq is used only
    # where named: it has not yet run end to end on a kernel with sch_fq.
    mechanism = {{ include "shareguard.tomlString" (.mechanism | default "auto") }}
    # What a pod's traffic can carry at most through this NIC: a share at or above it
    # is counted but not shaped (mechanism "unconstrained"). Leave it out to shape
    # every share, including traffic between pods on the same node.
{{- if .lineRate }}
    line_rate = {{ include "shareguard.tomlString" .lineRate }}
{{- else }}
    # line_rate = "10G"
{{- end }}
{{- end }}
{{- if eq .kind "gpu" }}
{{- with .backend }}
    backend = {{ include "shareguard.tomlString" . }}
{{- end }}
{{- with .gpus }}
    gpus = {{ include "shareguard.tomlString" . }}
{{- end }}
{{- with .uuid }}
    uuid = {{ include "shareguard.tomlString" . }}
{{- end }}
{{- if hasKey . "index" }}
    index = {{ .index | int }}
{{- end }}
{{- with $root.Values.gpu.driverRoot }}
    # The host's driver root (gpu.driverRoot), which the agent's container mounts here.
    driver_root = {{ include "shareguard.tomlString" . }}
    container_driver_root = "/driver-root"
{{- end }}
{{- end }}
{{- with .allowedNamespaces }}
    allowed_namespaces = {{ include "shareguard.tomlStrings" . }}
{{- end }}
{{- with .adminNamespaces }}
    admin_namespaces = {{ include "shareguard.tomlStrings" . }}
{{- end }}
{{- with .stage }}
    stage = {{ include "shareguard.tomlString" . }}
{{- end }}
{{- with .class }}
    class = {{ include "shareguard.tomlString" . }}
{{- end }}
{{- with .watchdog }}
    watchdog = {{ include "shareguard.tomlInline" (list . (list "period" "action" "grace")) }}
{{- end }}
{{- range $name, $c := .capacity }}
    [device.capacity.{{ $name }}]
{{- if hasKey $c "value" }}
    value = {{ include "shareguard.tomlString" $c.value }}
{{- end }}
{{- if hasKey $c "linkPercent" }}
    link_percent = {{ $c.linkPercent | int }}
{{- end }}
{{- if hasKey $c "default" }}
    default = {{ include "shareguard.tomlString" $c.default }}
{{- end }}
{{- with $c.validValues }}
    valid_values = {{ include "shareguard.tomlStrings" . }}
{{- end }}
{{- with $c.validRange }}
    valid_range = {{ include "shareguard.tomlInline" (list . (list "min" "max" "step")) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* A TOML inline table of strings: (list MAP KEYS), the keys of KEYS that MAP has, in that order. */}}
{{- define "shareguard.tomlInline" -}}
{{- $m := index . 0 }}
{{- $parts := list }}
{{- range (index . 1) }}
{{- if hasKey $m . }}
{{- $parts = append $parts (printf "%s = %s" . (index $m . | toString | quote)) }}
{{- end }}
{{- end -}}
{ {{ join ", " $parts }} }
{{- end }}
