"""What the routers that front several replicas (sglang-router, vllm-router) read of a
worker: its model and server info, named as SGLang and vLLM name them, and its load.

sglang-router asks ``/server_info`` and ``/model_info`` when a worker joins, and
``/get_load`` for its load-aware policies; vllm-router's ``kv_aware`` policy reads a
worker's block size from vLLM's ``vllm_config.cache_config.block_size``. Each answer
carries both projects' names, so that one route serves either router.
"""

import dataclasses
from typing import Any

from ..backend import Backend
from ..version import version_info


def model_info(name: str, backend: Backend) -> dict[str, Any]:
    """SGLang's ``/get_model_info`` fields this server can fill. The model's path is where
    it was loaded from (sglang-router loads its tokenizer from there where it can)."""
    path = str(backend.source.path)
    return {
        "model_path": path,
        "tokenizer_path": path,
        "served_model_name": name,
        "is_generation": True,
        "max_context_length": backend.max_model_len,
        "preferred_sampling_params": None,
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


def server_info(name: str, backend: Backend, kv_events: dict[str, Any] | None) -> dict[str, Any]:
    """SGLang's ``/get_server_info`` fields, vLLM's ``vllm_config`` (the model and block
    size a KV-aware router needs) and the KV events endpoint, if one is published."""
    cache = backend.cache_info()
    return {
        **model_info(name, backend),
        "page_size": cache.block_size,
        "max_total_num_tokens": cache.capacity_tokens,
        "context_length": backend.max_model_len,
        "kv_events": kv_events,
        # Ours: what proposes the tokens the model verifies (MISTRALRS_SPECULATIVE_METHOD
        # resolved) and why.
        "speculation": dataclasses.asdict(backend.speculation()),
        "vllm_config": {
            "model_config": {"model": name, "max_model_len": backend.max_model_len},
            "cache_config": {"block_size": cache.block_size},
        },
        **version_info(),
    }


def load(backends: list[Backend]) -> list[dict[str, Any]]:
    """SGLang's ``/get_load``: one entry (a data-parallel rank's), the requests running
    and waiting over every loaded model, and the tokens their KV cache holds: counted
    against the global pool, scaled up where a windowed pool is fuller
    (`PoolUsage.load_blocks`), so that its ratio to ``max_total_num_tokens`` is how full
    the fuller pool is."""
    running = waiting = tokens = 0
    for backend in backends:
        stats = backend.stats()
        running, waiting = running + stats.running, waiting + stats.waiting
        block_size = backend.cache_info().block_size
        if stats.pool is not None and block_size is not None:
            tokens += stats.pool.load_blocks() * block_size
    return [
        {
            "dp_rank": 0,
            "num_reqs": running + waiting,
            "num_waiting_reqs": waiting,
            "num_tokens": tokens,
        }
    ]
