{{/*
The data of an agent ConfigMap (daemonset.yaml): agent.toml, the config every node's
agent of one node pool reads. A template of its own so that the DaemonSet's pod
template can carry its checksum. Called with (dict "root" $ "pool" POOL), POOL as
daemonset.yaml makes it (name, nodeSelector, devices, extraToml). It renders at the
ConfigMap's indentation, starting on a new line.
*/}}
{{- define "shareguard.agentConfig" }}{{ with .root }}
  # The format of docs/configuration.md. One ConfigMap serves every node
  # the DaemonSet reaches. No device sets `pool`: each node's agent gives its devices
  # the node's own name as their pool (NODE_NAME in the agent container below), since
  # the scheduler tells devices apart by driver, pool and name only and two nodes with
  # one pool would share its capacity. What differs between nodes goes in a [[node]]
  # table at the end.
  agent.toml: |
    [agent]
    socket = "/run/shareguard/agent.sock"
    state_dir = "/var/lib/shareguard"
    # Pod-reachable, so Prometheus gets /metrics. With hostNetwork this is every address
    # of the node, and the metrics name tenants' namespaces and claims, which
    # NetworkPolicy cannot protect on a hostNetwork pod: only a scraper that sends the
    # token in the Secret {{ include "shareguard.metricsSecret" . }} (key `token`) reads them. Without
    # that Secret, /metrics answers nobody (docs/operations.md, "Scraping").
    metrics_addr = "0.0.0.0:9464"
    metrics_token_file = "/etc/shareguard-metrics/token"
    # Over plain HTTP the token and the metrics cross the node network in the clear.
    # With a PKI of the cluster's, add TLS and client certificates (docs/operations.md,
    # "Scraping"), the files from a Secret mounted like the token's:
    {{ if not .Values.metrics.tls.secretName }}# {{ end }}metrics_tls = { cert_file = "/etc/shareguard-metrics-tls/tls.crt", key_file = "/etc/shareguard-metrics-tls/tls.key", client_ca_file = "/etc/shareguard-metrics-tls/ca.crt" }
    # /healthz and /readyz alone, for the kubelet's probes: they say nothing of tenants.
    # On the node's loopback, where the kubelet's probes (host: 127.0.0.1) reach it and
    # nothing on the node network does, so that no neighbour can hold its connections.
    health_addr = "127.0.0.1:9465"
    audit_log = "/var/lib/shareguard/audit.jsonl"
    # The node's operators (root) may do everything; the kubelet plugin
    # (kubelet-plugin.yaml, uid 65200) has the kubelet-plugin role only. The socket is
    # 0660 in socket_group, the plugin's group, in a directory of its own (0750).
    allowed_uids = [0]
    plugin_uids = [65200]
    socket_group = 65200
    bpffs_dir = "/sys/fs/bpf/shareguard"
    cdi_dir = "/var/run/cdi"
    # kubelet's root directory (kubeletDir), mounted read-only at the same path: its DRA
    # checkpoint names every pod kubelet runs with each claim, also the ones it never
    # calls the plugin for (a claim is prepared once per node).
    kubelet_dir = {{ .Values.kubeletDir | quote }}
    # No cgroup_root: the agent finds the cgroup v2 hierarchy in its mount table,
    # where the host's tree is mounted below at its own path: /sys/fs/cgroup on
    # cgroup v2 nodes, /sys/fs/cgroup/unified on hybrid (v1 + v2) ones. A fixed value
    # is right on one kind of node only (on the test cluster's hybrid nodes
    # "/sys/fs/cgroup" kept every pod's sandbox from being found).
    {{- include "shareguard.devices" (dict "root" . "devices" $.pool.devices) }}

    # Accounting only, no enforcement:
    # [[device]]
    # name = "gen-0"
    # driver = "{{ .Values.driverName }}"
    # kind = "generic"
    # allowed_namespaces = ["team-a"]
    # [device.capacity.memory]
    # value = "40Gi"

    # Per-node values: a [[node]] table changes the named devices' fields on the node
    # whose name is exactly `name` (no pattern), and nowhere else. Tables merge key by
    # key, other values replace. A device name the config lacks, or a misspelt field,
    # is refused on every node. For example:
    # [[node]]
    # name = "gpu-worker-3"
    # [node.device.nic-0]
    # interface = "ens5"
    # [node.device.gpu]
    # allowed_namespaces = ["team-a"]
    {{- with .Values.agent.extraToml }}
    {{- . | trimSuffix "\n" | nindent 4 }}
    {{- end }}
    {{- with $.pool.extraToml }}
    {{- . | trimSuffix "\n" | nindent 4 }}
    {{- end }}
{{- end }}{{ end }}
