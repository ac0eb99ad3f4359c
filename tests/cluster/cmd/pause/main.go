// Command pause is the test cluster's pod sandbox process: it holds the pod's
// namespaces, reaps the zombies it inherits as the pod's PID 1, and exits on SIGINT or
// SIGTERM, as upstream's pause container does. Upstream's pause is C built by its own
// Makefile, outside any Go module, and no registry can be reached for its image, so
// the cluster builds this one (tests/cluster/images.sh).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 8)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sig {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
