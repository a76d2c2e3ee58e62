"""Which processes a model spans (`settings.topology`): mistral.rs's variables and
torchrun's, decided before anything starts, every inconsistency an error naming them."""

import pytest

from spnl_backend import BackendSettings, SettingsError
from spnl_backend.settings.topology import decide_topology

TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}


def _decide(device_type="cpu", gpus=0, launch=None, **settings):
    return decide_topology(BackendSettings(**settings), device_type, gpus, launch or {})


def test_one_process_unless_asked():
    assert not _decide().distributed
    assert not _decide(mn_local_world_size=1).distributed
    assert not _decide("cuda", 1).distributed
    assert not _decide("cuda", 4, device="cuda:0").distributed  # pinned to one GPU


def test_local_ranks_on_the_cpu_and_every_visible_gpu():
    cpu = _decide(mn_local_world_size=4)
    assert (cpu.world_size, cpu.local_world_size, cpu.rank) == (4, 4, 0)
    assert (cpu.dist_backend, cpu.launcher) == ("gloo", "spawn")
    gpus = _decide("cuda", 2)
    assert (gpus.world_size, gpus.dist_backend) == (2, "nccl")
    assert gpus.why.startswith("2 visible CUDA GPUs")


def test_no_nccl_keeps_one_process():
    topology = _decide("cuda", 4, no_nccl=True)
    assert not topology.distributed
    assert "MISTRALRS_NO_NCCL" in topology.why


def test_torchrun():
    topology = _decide(launch=TORCHRUN)
    assert (topology.rank, topology.world_size, topology.local_world_size) == (1, 4, 2)
    assert (topology.node, topology.master_addr, topology.master_port) == (0, "10.0.0.1", 29500)
    assert topology.launcher == "torchrun"
    agent = _decide(launch={**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert agent.store_is_external


def test_multi_node_head_and_worker():
    head = _decide(
        mn_global_world_size=4, mn_local_world_size=2, mn_head_num_workers=1, mn_head_port=9000
    )
    assert (head.rank, head.node, head.nodes, head.master_port) == (0, 0, 2, 9000)
    worker = _decide(
        mn_global_world_size=8,
        mn_local_world_size=2,
        mn_worker_server_addr="head.local:9000",
        mn_worker_id=2,
    )
    assert (worker.rank, worker.node, worker.master_addr, worker.master_port) == (
        6,
        3,
        "head.local",
        9000,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mn_local_world_size": 3}, "MISTRALRS_MN_LOCAL_WORLD_SIZE=3: the world size must be"),
        ({"device_": "cuda", "gpus": 2, "mn_local_world_size": 4}, "has 2 visible CUDA GPU"),
        ({"device_": "mps", "mn_local_world_size": 2}, "Metal"),
        ({"mn_global_world_size": 4}, "needs MISTRALRS_MN_LOCAL_WORLD_SIZE"),
        ({"mn_global_world_size": 4, "mn_local_world_size": 3}, "not a whole number"),
        ({"mn_global_world_size": 6, "mn_local_world_size": 2}, "power of two"),
        ({"mn_global_world_size": 4, "mn_local_world_size": 2}, "and neither is set"),
        (
            {
                "mn_global_world_size": 4,
                "mn_local_world_size": 2,
                "mn_head_num_workers": 1,
                "mn_worker_id": 0,
            },
            "not both",
        ),
        (
            {"mn_global_world_size": 4, "mn_local_world_size": 2, "mn_head_num_workers": 1},
            "needs both MISTRALRS_MN_HEAD_NUM_WORKERS and MISTRALRS_MN_HEAD_PORT",
        ),
        (
            {
                "mn_global_world_size": 8,
                "mn_local_world_size": 2,
                "mn_head_num_workers": 1,
                "mn_head_port": 9000,
            },
            "4 machines: 3 workers besides the head",
        ),
        (
            {
                "mn_global_world_size": 4,
                "mn_local_world_size": 2,
                "mn_worker_server_addr": "h:1",
                "mn_worker_id": 1,
            },
            "MISTRALRS_MN_WORKER_ID=1 is out of range: 2 machines make workers 0 to 0",
        ),
        ({"no_nccl": True, "mn_global_world_size": 2}, "turns tensor parallelism off"),
        ({"launch": TORCHRUN, "no_nccl": True}, "torchrun started several ranks"),
        ({"launch": TORCHRUN, "mn_global_world_size": 4}, "use one launcher"),
        ({"launch": TORCHRUN, "mn_local_world_size": 4}, "torchrun started LOCAL_WORLD_SIZE=2"),
        ({"launch": {"WORLD_SIZE": "2"}}, "RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT"),
        ({"launch": {**TORCHRUN, "RANK": "4"}}, "do not fit together"),
        ({"launch": {**TORCHRUN, "WORLD_SIZE": "6"}}, "power of two"),
        ({"launch": {**TORCHRUN, "MASTER_PORT": "x"}}, "MASTER_PORT='x'"),
    ],
)
def test_inconsistent_settings_are_refused(kwargs, message):
    device = kwargs.pop("device_", "cpu")
    gpus = kwargs.pop("gpus", 0)
    launch = kwargs.pop("launch", None)
    with pytest.raises(SettingsError, match=message):
        _decide(device, gpus, launch, **kwargs)


def _map(device_type="cpu", gpus=0, **settings):
    from spnl_backend.settings.topology import Topology, decide_layer_map

    return decide_layer_map(BackendSettings(**settings), Topology(), device_type, gpus)


def test_layer_maps():
    from spnl_backend.settings.topology import even_spans

    assert _map() is None
    assert _map(device_layers="0:2;1:6").spans == (("cpu", 2), ("cpu", 6))
    assert _map("cuda", 2, device_layers="1:4;0:4").spans == (("cuda:1", 4), ("cuda:0", 4))
    automatic = _map("cuda", 3, no_nccl=True)
    assert automatic.why == "MISTRALRS_NO_NCCL=1 with 3 visible CUDA GPUs"
    assert even_spans(automatic, 8).spans == (("cuda:0", 3), ("cuda:1", 3), ("cuda:2", 2))
    assert _map("cuda", 3) is None  # tensor parallelism's case, not mapping's
    with pytest.raises(SettingsError, match=r"names device\(s\) \[2\]"):
        _map("cuda", 2, device_layers="0:4;2:4")
    with pytest.raises(SettingsError, match="Metal has one device"):
        _map("mps", device_layers="0:4;1:4")
