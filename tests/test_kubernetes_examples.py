"""``examples/kubernetes/`` and ``examples/prometheus/`` hold together with the code they
name: every file parses (``yaml.safe_load_all``); the Deployment's command line parses
with ``pyengine serve``'s own parser; its probes and scrape annotations name routes the
server really has, on the port the command line listens on; the Service, the KEDA
``ScaledObject`` and the endpoint picker's values point at that Deployment. The metric
names these files read are checked against a live server's ``/metrics`` in
``tests/test_prometheus_dashboard.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

from pyengine.server import info  # noqa: E402
from pyengine.server.cli import build_parser  # noqa: E402

ROOT = Path(__file__).resolve().parents[1] / "examples"
KUBE = ROOT / "kubernetes"


def documents(path: Path) -> list[Any]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def manifests() -> dict[str, dict[str, Any]]:
    """kind -> the one manifest of that kind in examples/kubernetes (values files aside)."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(KUBE.glob("*.yaml")):
        for doc in documents(path):
            if "kind" in doc:
                assert doc["kind"] not in out, f"two {doc['kind']}s in examples/kubernetes"
                out[doc["kind"]] = doc
    return out


def serve_container() -> dict[str, Any]:
    (container,) = manifests()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def get_routes() -> set[str]:
    return {route.path for route in info.router.routes if "GET" in route.methods}


def test_every_example_file_parses():
    files = sorted(ROOT.rglob("*.yaml")) + sorted(ROOT.rglob("*.yml"))
    assert len(files) >= 4
    for path in files:
        assert documents(path), f"{path} holds no YAML document"
    assert {"Deployment", "Service", "ScaledObject"} <= set(manifests())


def test_the_deployment_command_line_is_pyengine_serve_s():
    container = serve_container()
    assert container["command"] == ["pyengine", "serve"]
    parser, _ = build_parser()
    args = parser.parse_args(container["args"])  # an unknown flag exits (SystemExit): the test fails
    assert args.model is not None and args.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.port}


def test_probes_and_scrape_annotations_name_real_routes_on_the_served_port():
    container = serve_container()
    parser, _ = build_parser()
    port = parser.parse_args(container["args"]).port
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    routes = get_routes()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] in routes, f"{probe} asks for {get['path']}, which the server does not serve"
        assert named.get(get["port"], get["port"]) == port
    template = manifests()["Deployment"]["spec"]["template"]
    service = manifests()["Service"]
    notes = template["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == port
    assert notes["prometheus.io/path"] in routes
    # The pods only: annotated as well, the Service would have each pod scraped twice
    # (kubernetes-service-endpoints beside kubernetes-pods), doubling KEDA's sum().
    assert not any(k.startswith("prometheus.io/") for k in service["metadata"].get("annotations") or {})


def test_the_service_keda_and_the_endpoint_picker_point_at_the_deployment():
    kinds = manifests()
    deployment, service, scaled = kinds["Deployment"], kinds["Service"], kinds["ScaledObject"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    port_names = {p["name"] for p in serve_container()["ports"]}
    assert all(p["targetPort"] in port_names for p in service["spec"]["ports"])
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    (values,) = documents(KUBE / "epp-values.yaml")
    pool = values["inferencePool"]
    assert pool["modelServers"]["matchLabels"].items() <= pod_labels.items()
    parser, _ = build_parser()
    assert pool["targetPortNumber"] == parser.parse_args(serve_container()["args"]).port
    assert values["inferenceExtension"]["flags"]["model-server-metrics-path"] in get_routes()


def test_the_dashboard_is_an_importable_grafana_dashboard():
    import json

    dashboard = json.loads((ROOT / "grafana" / "pyengine-dashboard.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"] and all(t["expr"] and t["datasource"]["uid"] == "${datasource}"
                                        for t in panel["targets"])
