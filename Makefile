# The two commands of the README, plus the benchmark and fuzzing.
.PHONY: showcase test bench fuzz image image-reproduce cluster-up cluster-down e2e e2e-cilium

showcase:
	./scripts/showcase.sh

test:
	./scripts/test.sh

bench:
	./scripts/bench.sh

# Each fuzz target for FUZZ_SECONDS (default 60) from fuzz/corpus (docs/fuzzing.md).
fuzz:
	./scripts/fuzz.sh

# The image, reproducibly, into target/image/ (docs/image.md); IMAGE_ARCHES="amd64 arm64"
# for both. image-reproduce builds it twice, the second time in a fresh clone, and
# compares the digests.
image:
	./scripts/image.sh

image-reproduce:
	./scripts/image-reproduce.sh

# The Kubernetes release of the test cluster: 1.36 (what `make test` runs) or 1.37
# (`make e2e K8S=1.37`; docs/kubernetes.md lists what ran on each).
K8S ?= 1.36

# A two-node Kubernetes cluster built from upstream's modules (tests/cluster/, pinned),
# with shareguard installed from deploy/ (tests/cluster/README.md).
# cluster-up leaves it running and prints KUBECONFIG= and KUBECTL= last; cluster-down
# removes everything it made.
cluster-up:
	SGC_K8S=$(K8S) ./tests/cluster/up.sh

cluster-down:
	./tests/cluster/down.sh

# The scenarios on the real cluster: a fresh cluster, the tests, and the cluster removed.
e2e:
	SGC_K8S=$(K8S) ./tests/cluster/e2e.sh

# The bandwidth scenarios on the test cluster with Cilium as the nodes' CNI, and Cilium's
# programs counted beside shareguard's, with legacy and with BPF host routing
# (docs/platform.md, "Beside Cilium"). Builds Cilium from tests/cluster/cilium (minutes).
e2e-cilium:
	SGC_K8S=$(K8S) SGC_CNI=cilium ./tests/cluster/e2e.sh b_e_pods d_two_tenants f_limits_outlive \
	  n_the_bandwidth_example o_a_rollback
