"""pyengine's metrics in their ecosystem, for real: ``pyengine serve`` (a tiny checkpoint,
under the Deployment example's served name) scraped every 2 s by a real Prometheus
(Debian's ``prometheus`` package) on loopback while a few concurrent completions run;
then every expression of ``examples/grafana/pyengine-dashboard.json`` and every recording
rule of ``examples/prometheus/vllm-names.rules.yml`` (and the KEDA query) goes through
Prometheus' ``/api/v1/query`` and must return data. Without the ``prometheus`` binary
that test is skipped, unless ``PYENGINE_REQUIRE_PROMETHEUS=1`` (``.ci/run`` sets it):
then it fails. The same live server checks, without Prometheus, that ``docs/metrics.md``
lists exactly the families ``/metrics`` exposes, and that the names the endpoint picker
and KEDA read are gauges it exposes.

Loopback only, free ports chosen at run time, Prometheus' storage in ``tmp_path``, one
thread per process (``OMP_NUM_THREADS=1``, ``GOMAXPROCS=1``), bounded waits, every child
reaped."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Optional

import httpx
import pytest

yaml = pytest.importorskip("yaml")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pyengine.testing.checkpoints import make_tiny_checkpoint  # noqa: E402
from pyengine.testing.serve_process import ServeProcess  # noqa: E402
from pyengine.testing.waits import free_port, wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "examples" / "grafana" / "pyengine-dashboard.json"
RULES = ROOT / "examples" / "prometheus" / "vllm-names.rules.yml"
KUBE = ROOT / "examples" / "kubernetes"
METRICS_DOC = ROOT / "docs" / "metrics.md"
# What Grafana puts in place of the dashboard's variables: "All" models (the variable's
# allValue) and a rate window wide enough for the 2 s scrapes of the load below.
GRAFANA_VARIABLES = {"$model_name": ".*", "$__rate_interval": "1m"}
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GOMAXPROCS": "1"}


def yaml_documents(path: Path) -> list[Any]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def served_model_name() -> str:
    """The Deployment example's --served-model-name: the KEDA query selects it."""
    (deployment,) = [d for d in yaml_documents(KUBE / "pyengine.yaml") if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    return str(args[args.index("--served-model-name") + 1])


def keda_query() -> str:
    (scaled,) = yaml_documents(KUBE / "keda-scaledobject.yaml")
    (trigger,) = scaled["spec"]["triggers"]
    return str(trigger["metadata"]["query"])


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, expression with Grafana's variables substituted), every target."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, f"{panel['title']}: a dashboard variable the test does not know: {expr}"
            out.append((panel["title"], expr))
    return out


def recorded_names() -> list[str]:
    (rules,) = yaml_documents(RULES)
    return [rule["record"] for group in rules["groups"] for rule in group["rules"]]


def exposed_families(server_url: str) -> dict[str, str]:
    """family name (counters without ``_total``) -> type, as ``/metrics`` exposes them."""
    return {name: kind for name, (kind, _) in exposed_families_with_labels(server_url).items()}


def exposed_families_with_labels(server_url: str) -> dict[str, tuple[str, Optional[set[str]]]]:
    """family name -> (type, its samples' label names beside model_name and le; None
    while it has no sample: a labelled counter before its first increment)."""
    text = httpx.get(f"{server_url}/metrics", timeout=10).text
    out: dict[str, tuple[str, Optional[set[str]]]] = {}
    for family in text_string_to_metric_families(text):
        labels = {name for sample in family.samples for name in sample.labels} - {"model_name", "le"}
        out[family.name] = (family.type, labels if family.samples else None)
    return out


def documented_families() -> dict[str, tuple[str, set[str]]]:
    """The table of docs/metrics.md: family name (counters without ``_total``) -> (type,
    label names beside model_name)."""
    out = {}
    for line in METRICS_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`pyengine:"):
            name, kind = cells[0].strip("`"), cells[1]
            labels = {label.strip() for label in cells[2].split(",") if label.strip()}
            out[name.removesuffix("_total") if kind == "counter" else name] = (kind, labels)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("promserve") / "qwen3", "qwen3", seed=4)
    log = (tmp_path_factory.mktemp("promserve-log") / "serve.log").open("w")
    proc = ServeProcess([str(checkpoint), "--served-model-name", served_model_name(), "--max-num-seqs", "4",
                         "--num-kv-blocks", "64", "--stats-interval", "0", "--log-level", "warning",
                         # n-gram drafts: the speculative-decoding series (and their rules) have samples
                         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                         "--no-log-requests"], env=CHILD_ENV, stderr=log)
    try:
        proc.wait_up(180)
        yield proc
    finally:
        proc.stop()
        log.close()


def test_the_metrics_doc_lists_exactly_what_metrics_exposes(server):
    documented, exposed = documented_families(), exposed_families_with_labels(server.url)
    assert {n: kind for n, (kind, _) in documented.items()} == {n: kind for n, (kind, _) in exposed.items()}
    for name, (_, labels) in exposed.items():
        if labels is not None:
            assert documented[name][1] == labels, f"{name}: docs/metrics.md says {documented[name][1]}"


def test_every_vllm_series_the_metrics_doc_names_has_a_recording_rule():
    """The table's last column names vLLM's equivalents; each is recorded (a histogram as
    its _bucket, _sum and _count) except a label of another series (cache_config_info)."""
    recorded = set(recorded_names())
    named = []
    for line in METRICS_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[0].startswith("`pyengine:") and "label of" not in cells[4]:
            for name in re.findall(r"`(vllm:[a-z0-9_:]+)`", cells[4]):
                named += [name + s for s in ("_bucket", "_sum", "_count")] if cells[1] == "histogram" else [name]
    assert "vllm:spec_decode_num_drafts_total" in named, "the table was read"
    assert sorted(set(named) - recorded) == []


def test_the_endpoint_picker_and_keda_read_gauges_the_server_exposes(server):
    exposed = exposed_families(server.url)
    (values,) = yaml_documents(KUBE / "epp-values.yaml")
    flags = values["inferenceExtension"]["flags"]
    specs = {flag: value for flag, value in flags.items() if flag.endswith("-metric") and value}
    assert set(specs) == {"total-queued-requests-metric", "total-running-requests-metric",
                          "kv-cache-usage-percentage-metric"}
    for flag, spec in specs.items():
        assert exposed.get(spec.split("{")[0]) == "gauge", f"--{flag}={spec} is not a gauge /metrics exposes"
    names = re.findall(r"pyengine:[a-z_]+", keda_query())
    assert names and all(exposed.get(n) == "gauge" for n in names)


class Prometheus:
    """``prometheus`` on loopback, a free port, scraping ``target`` every 2 s (a scrape
    may take over a second on a loaded machine: the timeout is the interval), with the
    recording rules loaded and its storage under ``folder``."""

    def __init__(self, binary: str, folder: Path, target: str) -> None:
        config = {
            "global": {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "pyengine", "static_configs": [{"targets": [target]}]}],
        }
        self.config = folder / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (folder / "prometheus.log").open("w")
        self.proc = subprocess.Popen(  # noqa: S603 - a fixed command line
            [binary, f"--config.file={self.config}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, env=CHILD_ENV)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}: see {self.log.name}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` evaluates to now (``[]``: no data)."""
        resp = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = resp.json()
        assert resp.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
        assert body["data"]["resultType"] == "vector", expr
        return list(body["data"]["result"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(10)
        self.log.close()


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        reason = ("the prometheus binary is not on PATH (Debian: apt-get install prometheus; "
                  "`make install-prometheus`)")
        if os.environ.get("PYENGINE_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(f"PYENGINE_REQUIRE_PROMETHEUS=1 but {reason}")
        pytest.skip(reason)
    return found


async def drive_load(url: str, model: str, wave: int) -> None:
    """Concurrent completions, streamed and not, sharing a prefix (prefix-cache hits), and
    one request the server refuses with a 400 (an HTTP error series)."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async def complete(i: int, stream: bool) -> None:
            body = {"model": model, "prompt": [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, wave, i],
                    "max_tokens": 24, "ignore_eos": True, "stream": stream}
            if stream:
                async with http.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    async for _ in resp.aiter_lines():
                        pass
            else:
                assert (await http.post("/v1/completions", json=body)).status_code == 200

        await asyncio.gather(*(complete(i, stream=i % 2 == 0) for i in range(8)))
        bad = await http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    return [v for v in (float(r["value"][1]) for r in result) if math.isfinite(v)]


def test_prometheus_scrapes_the_server_and_every_dashboard_query_returns_data(server, tmp_path):
    binary = prometheus_binary()
    promtool = shutil.which("promtool")
    if promtool is not None:  # the same package ships it
        checked = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True,
                                 timeout=60, env=CHILD_ENV)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    model = served_model_name()
    prometheus = Prometheus(binary, tmp_path, server.url.removeprefix("http://"))
    try:
        assert wait_until(prometheus.ready, 60, interval=0.2), "prometheus was not ready within 60 s"
        assert wait_until(lambda: finite_values(prometheus.query('up{job="pyengine"} == 1')), 30, interval=0.5), \
            "prometheus never scraped the server"
        # Two waves, a few scrapes apart: a labelled series appears with its first
        # observation, and a rate needs it to grow after Prometheus first saw it.
        asyncio.run(drive_load(server.url, model, wave=1))
        seen_a_few_times = "count_over_time(pyengine:time_to_first_token_seconds_count[1m]) >= 3"
        assert wait_until(lambda: prometheus.query(seen_a_few_times), 30, interval=0.5), \
            "prometheus did not scrape the first wave's series three times within 30 s"
        asyncio.run(drive_load(server.url, model, wave=2))

        expressions = dashboard_expressions() + [("KEDA trigger", keda_query())]
        expressions += [(f"recording rule {name}", name) for name in recorded_names()]
        answers: dict[str, Optional[list[dict[str, Any]]]] = {}

        def all_answer() -> bool:
            for _, expr in expressions:
                if not answers.get(expr):
                    answers[expr] = prometheus.query(expr)
                    if expr.startswith("histogram_quantile") and not finite_values(answers[expr] or []):
                        answers[expr] = None  # the wave's observations not scraped yet
            return all(answers.get(expr) for _, expr in expressions)

        wait_until(all_answer, 60, interval=1.0)
        empty = [f"{title}: {expr}" for title, expr in expressions if not answers.get(expr)]
        assert not empty, "no data from Prometheus for:\n" + "\n".join(empty)
        for title, expr in expressions:
            assert finite_values(answers[expr] or []), f"{title}: {expr} gave only {answers[expr]}"
    finally:
        prometheus.stop()
