"""kvflow's stand-in for the `mooncake` package: `mooncake.engine` is
kvflow.compat.mooncake (Mooncake's TransferEngine API on kvflow). Only the
transfer engine is there, not Mooncake's store, EP or other modules."""
