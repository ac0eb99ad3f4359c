// Command etcd is upstream's etcd server: the same entry point as etcd's own main
// package, which lives in a module (go.etcd.io/etcd/v3) whose replace directives
// keep it from being required from outside. The version is the one k8s.io/kubernetes
// v1.36.3 itself requires (go.mod).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
