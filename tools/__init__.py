"""Research tooling beside the serving path: deriving the zoo's checkpoints (`zoo`) and the
`splitstack` commands that calibrate RidgeFill maps, run the quality harness, derive
checkpoints and convert them to q-first wiring (`commands`). Nothing under `models`,
`kernels` or the services imports this package; the `splitstack` CLI imports a command's
module only when that command runs."""
