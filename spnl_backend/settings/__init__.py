"""MISTRALRS_* environment → one frozen, validated `BackendSettings`, and the
platform decisions (device, paged attention, kernels, FP8, dtype) derived from it."""

from .backend_settings import (
    BackendSettings,
    KvBudget,
    env_name,
    load_settings,
    unknown_env_variables,
)
from .platform import PlatformDecisions, PlatformProbe, decide_platform, detect_platform
from .values import IsqType

__all__ = [
    "BackendSettings",
    "IsqType",
    "KvBudget",
    "PlatformDecisions",
    "PlatformProbe",
    "decide_platform",
    "detect_platform",
    "env_name",
    "load_settings",
    "unknown_env_variables",
]
