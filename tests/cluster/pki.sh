#!/usr/bin/env bash
# The test cluster's certificates and kubeconfigs, made with openssl into $SGC_STATE/pki
# and $SGC_STATE/kubeconfig: one CA, the API server's serving certificate, the
# service-account key pair, and one client certificate for each identity the cluster's
# programs use, each with the name and group Kubernetes' bootstrap RBAC expects, so that
# Node and RBAC authorization see what they would see in a real cluster.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"

pki="$SGC_STATE/pki"
kc="$SGC_STATE/kubeconfig"
mkdir -p "$pki" "$kc"
chmod 700 "$pki"

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 7 \
  -subj "/CN=shareguard-test-cluster-ca" -keyout "$pki/ca.key" -out "$pki/ca.crt" 2>/dev/null

# cert NAME SUBJECT [EXTENSIONS]: a key and a certificate signed by the CA.
cert() {
  local name="$1" subj="$2" ext="${3:-extendedKeyUsage=clientAuth}"
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "$subj" \
    -keyout "$pki/$name.key" -out "$pki/$name.csr" 2>/dev/null
  openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" \
    -CAcreateserial -days 7 -extfile <(printf '%s\n' "$ext" "keyUsage=critical,digitalSignature,keyEncipherment") \
    -out "$pki/$name.crt" 2>/dev/null
  rm -f "$pki/$name.csr"
}

cert apiserver "/CN=kube-apiserver" \
  "$(printf 'extendedKeyUsage=serverAuth\nsubjectAltName=IP:%s,IP:%s,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local' "$SGC_HOST_IP" "$SGC_SERVICE_IP")"
cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
cert admin "/O=system:masters/CN=shareguard-test-admin"
cert scheduler "/CN=system:kube-scheduler"
cert controller-manager "/CN=system:kube-controller-manager"
for node in "${SGC_NODES[@]}"; do
  cert "kubelet-$node" "/O=system:nodes/CN=system:node:$node"
  cert "kube-proxy-$node" "/CN=system:kube-proxy"
done
openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null

# kubeconfig FILE CERT: a kubeconfig for the API server with that client certificate.
kubeconfig() {
  cat >"$kc/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: shareguard-test
  cluster:
    server: https://$SGC_HOST_IP:$SGC_API_PORT
    certificate-authority: $pki/ca.crt
users:
- name: $2
  user:
    client-certificate: $pki/$2.crt
    client-key: $pki/$2.key
contexts:
- name: shareguard-test
  context: {cluster: shareguard-test, user: $2}
current-context: shareguard-test
EOF
  chmod 600 "$kc/$1.kubeconfig"
}
kubeconfig admin admin
kubeconfig scheduler scheduler
kubeconfig controller-manager controller-manager
for node in "${SGC_NODES[@]}"; do
  kubeconfig "kubelet-$node" "kubelet-$node"
  kubeconfig "kube-proxy-$node" "kube-proxy-$node"
done
