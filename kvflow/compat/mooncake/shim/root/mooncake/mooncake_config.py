"""`mooncake.mooncake_config` as kvflow.compat.mooncake.config provides it:
MooncakeConfig.load_from_env() / from_file() with Mooncake's variables."""
from kvflow.compat.mooncake.config import (DEFAULT_GLOBAL_SEGMENT_SIZE, DEFAULT_LOCAL_BUFFER_SIZE,  # noqa: F401
                                           MooncakeConfig)

__all__ = ["DEFAULT_GLOBAL_SEGMENT_SIZE", "DEFAULT_LOCAL_BUFFER_SIZE", "MooncakeConfig"]
