"""`mooncake.mooncake_config.MooncakeConfig`: how Mooncake's Python side
reads a store client's settings from the environment or a JSON file, for
code that calls `MooncakeConfig.load_from_env()` and hands the fields to
`MooncakeDistributedStore.setup()` (Mooncake's scripts/test_tensor_api.py,
test_async_store.py, vLLM's and SGLang's Mooncake connectors).

The variables and defaults are Mooncake's (mooncake-wheel/mooncake/
mooncake_config.py): MOONCAKE_CONFIG_PATH (a JSON file; else the variables),
MOONCAKE_MASTER (required without a file), MOONCAKE_LOCAL_HOSTNAME
("localhost"), MOONCAKE_TE_META_DATA_SERVER ("P2PHANDSHAKE"),
MOONCAKE_GLOBAL_SEGMENT_SIZE (3.125 GiB), MOONCAKE_LOCAL_BUFFER_SIZE
(1 GiB), sizes as bytes or "4GB" / "512mb" / "1.5g", MOONCAKE_PROTOCOL
("tcp", lowercased), MOONCAKE_DEVICE (""), MOONCAKE_OFFLOAD_ENABLED,
MOONCAKE_OFFLOAD_FILE_STORAGE_PATH, MOONCAKE_TENANT_ID ("default"),
MOONCAKE_ENABLE_CLIENT_HTTP_SERVER, MOONCAKE_CLIENT_HTTP_PORT (9300).
Mooncake's wheel tests read other names themselves (MASTER_SERVER,
MC_METADATA_SERVER, PROTOCOL, LOCAL_HOSTNAME, DEVICE_NAME) and pass them to
setup(), which reads no variable: see docs/mooncake.md."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_GLOBAL_SEGMENT_SIZE", "DEFAULT_LOCAL_BUFFER_SIZE", "MooncakeConfig"]

log = logging.getLogger("kvflow.compat.mooncake")

DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200        # 3.125 GiB, Mooncake's
DEFAULT_LOCAL_BUFFER_SIZE = 1 << 30
# longest suffix first: "kb" before "b"
_UNITS = (("kb", 1 << 10), ("mb", 1 << 20), ("gb", 1 << 30), ("tb", 1 << 40),
          ("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40), ("b", 1))
_PROTOCOLS = frozenset({"tcp", "rdma", "efa", "nvmeof", "nvlink", "musa", "nvlink_intra", "hip", "barex", "cxl",
                        "ascend", "ub", "ubshmem", "maca", "sunrise_link", "rpc_only"})


def parse_size(value: Any) -> int:
    """Bytes from an int or "4GB" / "512 mb" / "1.5g" / "1024". Raises ValueError."""
    if isinstance(value, int):
        return value
    s = str(value).strip().lower()
    if not s:
        raise ValueError("Invalid segment size: empty string")
    for suffix, mult in _UNITS:
        if s.endswith(suffix):
            number = s[: -len(suffix)].strip()
            if not number:
                raise ValueError(f"Invalid segment size: missing number before '{suffix}'")
            return int(float(number) * mult)
    return int(float(s))


def parse_bool(value: Any) -> bool:
    """true/1/yes/on/enable or false/0/no/off/disable (or empty). Raises ValueError."""
    if isinstance(value, (bool, int, float)):
        return bool(value)
    s = "" if value is None else str(value).strip().lower()
    if s in ("", "false", "0", "no", "off", "disable"):
        return False
    if s in ("true", "1", "yes", "on", "enable"):
        return True
    raise ValueError(f"Invalid boolean value: {value!r}")


@dataclass
class MooncakeConfig:
    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: str | None
    master_server_address: str
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"
    enable_client_http_server: bool = False
    client_http_port: int = 9300

    def __post_init__(self) -> None:
        if not isinstance(self.protocol, str) or not self.protocol.strip():
            raise ValueError(f"Invalid protocol: {self.protocol!r}. Protocol must be a non-empty string, "
                             "e.g. 'tcp' or 'rdma'.")
        self.protocol = self.protocol.strip().lower()
        if self.protocol not in _PROTOCOLS:
            log.warning("Unrecognised protocol %r; passing it through unchanged", self.protocol)
        for name in ("global_segment_size", "local_buffer_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"Invalid {name}: {getattr(self, name)}. Size must be non-negative.")
        for name in ("local_hostname", "metadata_server", "master_server_address"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"Config field {name!r} must be a non-empty string, got {value!r}.")

    @staticmethod
    def from_file(file_path: str) -> MooncakeConfig:
        """The settings from a JSON file (local_hostname, metadata_server and
        master_server_address required). Raises ValueError, OSError."""
        with open(file_path) as f:
            c = json.load(f)
        for name in ("local_hostname", "metadata_server", "master_server_address"):
            if name not in c:
                raise ValueError(f"Missing required config field: {name}")
        return MooncakeConfig(
            local_hostname=c["local_hostname"], metadata_server=c["metadata_server"],
            global_segment_size=parse_size(c.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=parse_size(c.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=c.get("protocol", "tcp"), device_name=c.get("device_name", ""),
            master_server_address=c["master_server_address"],
            enable_ssd_offload=parse_bool(c.get("enable_ssd_offload", False)),
            ssd_offload_path=str(c.get("ssd_offload_path") or ""),
            tenant_id=str(c.get("tenant_id") or "default"),
            enable_client_http_server=parse_bool(c.get("enable_client_http_server", False)),
            client_http_port=int(c.get("client_http_port", 9300)))

    @staticmethod
    def load_from_env() -> MooncakeConfig:
        """The file named by MOONCAKE_CONFIG_PATH, else the MOONCAKE_*
        variables (the module docstring). Raises ValueError when neither
        MOONCAKE_CONFIG_PATH nor MOONCAKE_MASTER is set."""
        path = os.getenv("MOONCAKE_CONFIG_PATH")
        if path is not None:
            return MooncakeConfig.from_file(path)
        if not os.getenv("MOONCAKE_MASTER"):
            raise ValueError("Neither the environment variable 'MOONCAKE_CONFIG_PATH' nor 'MOONCAKE_MASTER' is set.")
        env = os.getenv
        return MooncakeConfig(
            local_hostname=env("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
            metadata_server=env("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
            global_segment_size=parse_size(env("MOONCAKE_GLOBAL_SEGMENT_SIZE", DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=parse_size(env("MOONCAKE_LOCAL_BUFFER_SIZE", DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=env("MOONCAKE_PROTOCOL", "tcp"), device_name=env("MOONCAKE_DEVICE", ""),
            master_server_address=env("MOONCAKE_MASTER", ""),
            enable_ssd_offload=parse_bool(env("MOONCAKE_OFFLOAD_ENABLED", "false")),
            ssd_offload_path=env("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", ""),
            tenant_id=env("MOONCAKE_TENANT_ID", "default"),
            enable_client_http_server=parse_bool(env("MOONCAKE_ENABLE_CLIENT_HTTP_SERVER", "false")),
            client_http_port=int(env("MOONCAKE_CLIENT_HTTP_PORT", "9300")))
