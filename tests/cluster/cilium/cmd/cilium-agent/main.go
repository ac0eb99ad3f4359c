// Cilium's agent, built from upstream's module at the release go.mod pins: the same
// two calls as upstream's daemon/main.go, in a main package named for the program so
// that the build names it cilium-agent.
package main

import (
	"github.com/cilium/cilium/daemon/cmd"
	"github.com/cilium/cilium/pkg/hive"
)

func main() {
	cmd.Execute(cmd.NewAgentCmd(func() *hive.Hive { return hive.New(cmd.Agent) }))
}
