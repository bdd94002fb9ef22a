"""kvflow's stand-in for the `mooncake` package: `mooncake.engine` is
kvflow.compat.mooncake (Mooncake's TransferEngine API on kvflow) and
`mooncake.store` is kvflow.compat.mooncake.store (Mooncake Store's
MooncakeDistributedStore on kvflow.store). Mooncake's EP and other modules
are not there."""
