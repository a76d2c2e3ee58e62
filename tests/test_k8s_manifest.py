"""deploy/kubernetes/spnl-backend.yaml, which cannot run here, checked as far as it can be
without a cluster: each Gateway API and Inference Extension object against its CRD's
OpenAPI schema (the CRDs vendored under tests/data/gateway-api-crds, see its README),
with unknown fields refused as `kubectl apply` refuses them; and the replicas' command
line, ports, probes and MISTRALRS_* settings against spnl-backend's own parser, routes
and settings, so that the manifest cannot drift from what ``spnl-backend serve`` takes.
CEL rules (``x-kubernetes-validations``) are not evaluated."""

import copy
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from spnl_backend import cli
from spnl_backend.server.kv_events import _binds
from spnl_backend.server.metrics import _VLLM_METRICS
from spnl_backend.server.rules import ROUTES
from spnl_backend.settings.backend_settings import (
    ENV_PREFIX,
    BackendSettings,
    unknown_env_variables,
)

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "kubernetes" / "spnl-backend.yaml"
CRDS = Path(__file__).resolve().parent / "data" / "gateway-api-crds"
CORE_KINDS = {"Deployment", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding"}
CRD_KINDS = {"InferencePool", "InferenceObjective", "HTTPRoute", "Gateway"}
POD_IP = "10.1.2.3"  # stands for the pod's address where an arg reads $(POD_IP)


# libyaml where it is built: the Gateway API CRDs are some 300 KB of YAML
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _objects(text: str | None = None) -> list[dict[str, Any]]:
    return [o for o in yaml.safe_load_all(text or MANIFEST.read_text()) if o is not None]


def _schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the served version's openAPIV3Schema, made strict."""
    found = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=_LOADER)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version["served"]:
                schema = _strict(version["schema"]["openAPIV3Schema"])
                found[(f"{group}/{version['name']}", kind)] = schema
    return found


def _strict(schema: Any) -> Any:
    """The API server drops (and ``kubectl apply``, validating strictly, refuses) fields a
    structural schema does not name; jsonschema would let them pass, so say so."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


SCHEMAS = _schemas()


def crd_errors(obj: dict[str, Any]) -> list[str]:
    """What the object's CRD schema refuses in it (kind, name and path of each fault)."""
    schema = SCHEMAS.get((obj.get("apiVersion"), obj.get("kind")))
    if schema is None:
        return [f"{obj.get('apiVersion')} {obj.get('kind')}: no CRD for it in {CRDS}"]
    validator = jsonschema.Draft7Validator(schema)
    name = obj.get("metadata", {}).get("name")
    return [
        f"{obj['kind']} {name}: {'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(obj)
    ]


def _one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _replica(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return _one(objects, "Deployment", "spnl-backend")["spec"]["template"]


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod["spec"]["containers"] if c["name"] == name]
    return found


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def _expanded(arg: str, env: dict[str, Any]) -> str:
    """Kubernetes' ``$(NAME)`` expansion; a name the container does not define stays as
    written there, which is never what is meant."""

    def value(match: re.Match) -> str:
        name = match.group(1)
        assert name in env, f"{arg!r} reads $({name}), which the container does not define"
        return POD_IP if name == "POD_IP" else str(env[name].get("value", f"<{name}>"))

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, arg)


def _serve_args(pod: dict[str, Any]) -> Any:
    container = _container(pod, "spnl-backend")
    env = {e["name"]: e for e in container.get("env", [])}
    argv = [_expanded(a, env) for a in container["command"] + container["args"]]
    assert argv[0] == "spnl-backend", "the command is the package's console script"
    return cli._build_parser().parse_args(argv[1:])


def _port_of(endpoint: str) -> int:
    match = re.fullmatch(r"tcp://[^:]+:(\d+)", endpoint)
    assert match, f"{endpoint}: expected tcp://HOST:PORT"
    return int(match.group(1))


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _epp_config(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(_one(objects, "ConfigMap", "spnl-backend-epp")["data"]["epp-config.yaml"])


def _plugin(config: dict[str, Any], kind: str) -> dict[str, Any]:
    (found,) = [p for p in config["plugins"] if p["type"] == kind]
    return found.get("parameters", {})


# ---- the Gateway API and Inference Extension objects, against their CRDs ------------------


def test_the_vendored_crds_are_the_kinds_the_manifest_uses():
    assert {kind for _, kind in SCHEMAS} == CRD_KINDS
    assert ("inference.networking.k8s.io/v1", "InferencePool") in SCHEMAS
    assert ("llm-d.ai/v1alpha2", "InferenceObjective") in SCHEMAS


def test_every_object_is_a_core_kind_or_validates_against_its_crd():
    objects = _objects()
    kinds = {o["kind"] for o in objects}
    assert kinds >= CRD_KINDS, f"missing: {CRD_KINDS - kinds}"
    assert kinds <= CORE_KINDS | CRD_KINDS, f"unchecked kinds: {kinds - CORE_KINDS - CRD_KINDS}"
    errors = [e for o in objects if o["kind"] in CRD_KINDS for e in crd_errors(o)]
    assert errors == []


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for key in parents:
            obj = obj[int(key)] if isinstance(obj, list) else obj[key]
        obj[last] = value

    return change


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def change(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for key in parents:
            obj = obj[key]
        del obj[last]

    return change


@pytest.mark.parametrize(
    ("kind", "change"),
    [
        ("InferencePool", _set("spec.targetPorts", [{"number": "8000"}])),
        ("InferencePool", _set("spec.targetPorts", [{"number": 70000}])),
        ("InferencePool", _set("spec.targetPort", 8000)),  # an unknown field
        ("InferencePool", _drop("spec.selector")),
        ("InferencePool", _set("spec.endpointPickerRef.failureMode", "Fail")),
        ("InferenceObjective", _drop("spec.poolRef")),
        ("InferenceObjective", _set("spec.priority", "high")),
        ("HTTPRoute", _set("spec.rules.0.backendRefs.0.weight", -1)),
        ("HTTPRoute", _set("spec.rules.0.matches.0.path.type", "Prefix")),
        ("Gateway", _set("spec.listeners.0.port", 0)),
    ],
)
def test_a_broken_object_is_refused(kind, change):
    """The schema check has teeth: each fault is found, naming the object."""
    (obj,) = [copy.deepcopy(o) for o in _objects() if o["kind"] == kind]
    assert crd_errors(obj) == []
    change(obj)
    errors = crd_errors(obj)
    assert errors
    assert all(e.startswith(f"{kind} ") for e in errors)


# ---- the replicas, against spnl-backend serve ---------------------------------------------


def test_the_replicas_run_serve_with_arguments_it_takes():
    objects = _objects()
    pod = _replica(objects)
    args = _serve_args(pod)
    container = _container(pod, "spnl-backend")
    ports = _ports(container)
    assert args.run is cli._run_serve
    assert args.host == "0.0.0.0", "the gateway reaches the pod on its own address"
    assert args.port == ports["http"]
    assert args.kv_events, "KV events on"
    assert _binds(args.kv_events), "bound, for the picker to connect"
    assert _port_of(args.kv_events) == ports["kv-events"]
    assert _binds(args.kv_events_replay)
    assert _port_of(args.kv_events_replay) == ports["kv-replay"]
    assert args.kv_events_topic == f"kv@{POD_IP}@{args.served_model_name}"
    assert args.grace < pod["spec"]["terminationGracePeriodSeconds"]


def test_the_probes_ask_the_open_health_route_on_the_served_port():
    container = _container(_replica(_objects()), "spnl-backend")
    health = {(r.path, r.method) for r in ROUTES if r.key == "open"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert (get["path"], "GET") in health, f"{probe}: {get['path']} is not an open GET route"
        assert get["port"] in _ports(container), f"{probe}: no container port {get['port']}"


def test_the_replicas_settings_are_settings_spnl_backend_accepts(monkeypatch):
    container = _container(_replica(_objects()), "spnl-backend")
    settings = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith(ENV_PREFIX)}
    assert settings, "the manifest shows the MISTRALRS_* settings it relies on"
    for name in [n for n in os.environ if n.upper().startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    assert unknown_env_variables() == []
    parsed = BackendSettings()
    assert parsed.paged_attn_block_size == int(settings["MISTRALRS_PAGED_ATTN_BLOCK_SIZE"])
    # as many compute threads as the CPUs the pod requests
    assert parsed.num_threads == int(container["resources"]["requests"]["cpu"])


def test_the_service_and_the_pool_reach_the_replicas():
    objects = _objects()
    pod = _replica(objects)
    labels, ports = pod["metadata"]["labels"], _ports(_container(pod, "spnl-backend"))
    assert _labels_match(
        _one(objects, "Deployment", "spnl-backend")["spec"]["selector"]["matchLabels"], labels
    )
    service = _one(objects, "Service", "spnl-backend")["spec"]
    assert _labels_match(service["selector"], labels)
    assert all(p["targetPort"] in ports for p in service["ports"])
    pool = _one(objects, "InferencePool", "spnl-backend")["spec"]
    assert _labels_match(pool["selector"]["matchLabels"], labels)
    assert [p["number"] for p in pool["targetPorts"]] == [_serve_args(pod).port]
    # the pool's picker is the picker's Service, on the port its container serves gRPC on
    epp_service = _one(objects, "Service", pool["endpointPickerRef"]["name"])["spec"]
    (ext_proc,) = [
        p for p in epp_service["ports"] if p["port"] == pool["endpointPickerRef"]["port"]["number"]
    ]
    epp_pod = _one(objects, "Deployment", "spnl-backend-epp")["spec"]["template"]
    assert _labels_match(epp_service["selector"], epp_pod["metadata"]["labels"])
    assert ext_proc["targetPort"] == "grpc"
    assert "grpc" in _ports(_container(epp_pod, "epp"))
    objective = _one(objects, "InferenceObjective", "spnl-backend-default")["spec"]
    assert objective["poolRef"]["name"] == "spnl-backend"
    route = _one(objects, "HTTPRoute", "spnl-backend")["spec"]
    (backend,) = route["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", "spnl-backend")
    gateway = _one(objects, "Gateway", route["parentRefs"][0]["name"])
    assert gateway["kind"] == "Gateway"


def test_the_endpoint_picker_reads_what_the_replicas_publish():
    objects = _objects()
    pod = _replica(objects)
    labels, args = pod["metadata"]["labels"], _serve_args(pod)
    ports = _ports(_container(pod, "spnl-backend"))
    config = _epp_config(objects)
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    used = {p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]}
    for source in config["dataLayer"]["sources"]:
        used |= {source["pluginRef"]} | {e["pluginRef"] for e in source["extractors"]}
    assert used <= declared, f"referenced, not declared: {used - declared}"
    # KV events: the port, replay port, topic and pod selector the replicas use
    events = _plugin(config, "precise-prefix-cache-producer")["kvEventsConfig"]
    discovery = events["podDiscoveryConfig"]
    assert events["engineType"] == "vllm"
    assert events["discoverPods"]
    assert discovery["socketPort"] == ports["kv-events"]
    assert discovery["replaySocketPort"] == ports["kv-replay"]
    assert args.kv_events_topic.startswith(events["topicFilter"])
    selector = dict(part.split("=") for part in discovery["podLabelSelector"].split(","))
    assert _labels_match(selector, labels)
    # load: the metrics named for the pods' engine type are ones the server publishes
    metrics = _plugin(config, "core-metrics-extractor")
    engine = labels[metrics["engineLabelKey"]]
    (names,) = [c for c in metrics["engineConfigs"] if c["name"] == engine]
    published = {name for _, name, *_ in _VLLM_METRICS}
    asked = [v for k, v in names.items() if k.endswith("Spec") and v]
    assert asked
    assert set(asked) <= published, f"not published: {set(asked) - published}"
    # the picker runs this pool with this config
    epp_pod = _one(objects, "Deployment", "spnl-backend-epp")["spec"]["template"]
    epp = _container(epp_pod, "epp")
    flags = dict(a.removeprefix("--").split("=", 1) for a in epp["args"])
    assert flags["pool-name"] == "spnl-backend"
    (mount,) = epp["volumeMounts"]
    config_map = next(v for v in epp_pod["spec"]["volumes"] if v["name"] == mount["name"])
    assert config_map["configMap"]["name"] == "spnl-backend-epp"
    assert flags["config-file"] == f"{mount['mountPath']}/epp-config.yaml"
    binding = _one(objects, "RoleBinding", "spnl-backend-epp")
    assert binding["subjects"][0]["name"] == epp_pod["spec"]["serviceAccountName"]
