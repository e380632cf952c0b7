"""The deployment manifests hold against the schemas their tools apply.

- `manifests/cluster.yaml`: Ray's autoscaler JSON schema (shipped in the ray package)
  and the same `prepare_config` + `validate_config` that `ray up` runs.
- `manifests/serve.yaml` and the RayService's `serveConfigV2`: Serve's
  `ServeDeploySchema`, and the pagefleet builder's own argument check.
- `manifests/rayservice.yaml`: no package on the registries this project uses ships
  KubeRay's RayService CRD, so its OpenAPI schema cannot be applied here. The tests
  check instead what the CRD requires of the fields we use (`ray.io/v1`, groupName and
  template per worker group, rayStartParams as a map of strings, replicas within
  min/max) and what pagefleet needs of them (probes, preStop, ports, the Service).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from pagefleet.cluster.serve_app import parse_args

MANIFESTS = Path(__file__).resolve().parent.parent / "manifests"
RAY_SCHEMA = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"


def load(name: str) -> Any:
    return yaml.safe_load((MANIFESTS / name).read_text())


def rayservice() -> dict[str, Any]:
    docs = list(yaml.safe_load_all((MANIFESTS / "rayservice.yaml").read_text()))
    return next(d for d in docs if d["kind"] == "RayService")


def service() -> dict[str, Any]:
    docs = list(yaml.safe_load_all((MANIFESTS / "rayservice.yaml").read_text()))
    return next(d for d in docs if d["kind"] == "Service")


def serve_config_v2() -> dict[str, Any]:
    text = rayservice()["spec"]["serveConfigV2"]
    assert isinstance(text, str)  # the CRD types it as a string holding YAML
    return dict(yaml.safe_load(text))


# ----- ray up ----------------------------------------------------------------------------


def test_cluster_yaml_matches_rays_autoscaler_schema() -> None:
    jsonschema.validate(load("cluster.yaml"), json.loads(RAY_SCHEMA.read_text()))


def test_cluster_yaml_passes_the_checks_ray_up_runs() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(load("cluster.yaml")))


def test_the_autoscaler_schema_check_rejects_a_wrong_field() -> None:
    broken = load("cluster.yaml")
    broken["max_workers"] = "four"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, json.loads(RAY_SCHEMA.read_text()))


# ----- Serve config ----------------------------------------------------------------------


@pytest.mark.parametrize("source", ["serve.yaml", "rayservice.yaml"])
def test_serve_config_matches_serves_deploy_schema(source: str) -> None:
    data = load("serve.yaml") if source == "serve.yaml" else serve_config_v2()
    schema = ServeDeploySchema.model_validate(data)
    assert [app.import_path for app in schema.applications] == ["pagefleet.cluster.serve_app:build_application"]


@pytest.mark.parametrize("source", ["serve.yaml", "rayservice.yaml"])
def test_serve_config_args_pass_the_builders_check(source: str) -> None:
    data = load("serve.yaml") if source == "serve.yaml" else serve_config_v2()
    parsed = parse_args(data["applications"][0]["args"])
    assert parsed.config.server.grpc_port == 50051 and parsed.config.server.http_port == 8000


def test_serve_config_disables_serves_proxy_which_would_take_the_http_port() -> None:
    assert load("serve.yaml")["proxy_location"] == "Disabled"


def test_rayservice_serves_the_serve_yaml_config_with_its_kubernetes_placement() -> None:
    expected = copy.deepcopy(load("serve.yaml"))
    args = expected["applications"][0]["args"]
    args["ingress_resource"] = "pagefleet_ingress"
    args["ingress_replicas_per_node"] = 1
    args["config"]["pools"][0].update(device="cuda", num_gpus_per_worker=1)
    args["config"]["server"]["gcs_fault_tolerance"] = True
    assert serve_config_v2() == expected


# ----- RayService ------------------------------------------------------------------------


def _groups() -> dict[str, dict[str, Any]]:
    spec = rayservice()["spec"]["rayClusterConfig"]
    return {g["groupName"]: g for g in spec["workerGroupSpecs"]}


def _container(group: dict[str, Any]) -> dict[str, Any]:
    containers = group["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def test_rayservice_is_a_ray_io_v1_rayservice_with_a_head_and_worker_groups() -> None:
    doc = rayservice()
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    cluster = doc["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["template"]["spec"]["containers"][0]["image"]
    for group in [head, *cluster["workerGroupSpecs"]]:
        # The CRD types rayStartParams as map[string]string.
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        for container in group["template"]["spec"]["containers"]:
            assert container["name"] and container["image"]
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_rayservice_gpu_group_gives_each_pod_a_gpu() -> None:
    limits = _container(_groups()["gpu"])["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1"


def test_rayservice_ingress_pods_carry_the_resource_the_ingress_asks_for() -> None:
    resources = _groups()["ingress"]["rayStartParams"]["resources"]
    wanted = serve_config_v2()["applications"][0]["args"]["ingress_resource"]
    assert wanted in json.loads(json.loads(resources))


def test_rayservice_ingress_readiness_is_grpc_health_on_the_configured_port() -> None:
    probe = _container(_groups()["ingress"])["readinessProbe"]
    grpc_port = serve_config_v2()["applications"][0]["args"]["config"]["server"]["grpc_port"]
    assert probe["grpc"]["port"] == grpc_port


def test_rayservice_head_keeps_kuberays_probes_so_serve_deploys() -> None:
    # KubeRay submits serveConfigV2 only once the head pod is ready: a head waiting
    # for pagefleet would never become ready.
    container = rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"][
        "containers"
    ][0]
    assert "readinessProbe" not in container


@pytest.mark.parametrize("group", ["ingress", "gpu"])
def test_rayservice_worker_pods_drain_before_they_stop(group: str) -> None:
    spec = _groups()[group]["template"]["spec"]
    command = " ".join(_container(_groups()[group])["lifecycle"]["preStop"]["exec"]["command"])
    assert "ray drain-node" in command
    assert spec["terminationGracePeriodSeconds"] > 0


def test_rayservice_service_selects_the_ingress_pods_on_the_configured_ports() -> None:
    svc = service()
    labels = _groups()["ingress"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    server = serve_config_v2()["applications"][0]["args"]["config"]["server"]
    ports = {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]}
    assert ports["grpc"] == server["grpc_port"] and ports["http"] == server["http_port"]


# ----- Grafana ---------------------------------------------------------------------------

PROMQL_WORDS = {
    "sum", "max", "min", "avg", "by", "without", "rate", "increase", "histogram_quantile",
    "le", "pool", "worker", "mode",
}  # fmt: skip


def _exported_metric_names() -> set[str]:
    from pagefleet.cluster.metrics import IngressMetrics

    metrics = IngressMetrics()
    metrics.track_wait_queue(lambda: {"default": 0})
    names: set[str] = set()
    for family in metrics.registry.collect():
        names.add(family.name)
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        names.update(family.name + s for s in suffixes.get(family.type, ()))
    return names


def test_grafana_dashboard_queries_only_metrics_the_ingress_exports() -> None:
    import re

    dashboard = json.loads((MANIFESTS / "grafana-dashboard.json").read_text())
    exported = _exported_metric_names()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs
    for expr in exprs:
        bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", "", expr)  # label matchers, ranges
        names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare)) - PROMQL_WORDS
        assert names and names <= exported, f"{expr}: unknown {sorted(names - exported)}"


def test_grafana_dashboard_covers_blocks_hit_rate_queues_preemptions_and_latency() -> None:
    text = (MANIFESTS / "grafana-dashboard.json").read_text()
    for metric in ("kv_blocks_live", "kv_blocks_cached", "kv_blocks_free", "prefix_cache_hits_total",
                   "num_waiting", "ingress_waiting_requests", "preemptions_total", "evictions_total",
                   "time_to_first_token_seconds_bucket", "worker_alive"):  # fmt: skip
        assert metric in text


def test_grafana_dashboard_plots_each_pools_target_against_its_actual_workers() -> None:
    dashboard = json.loads((MANIFESTS / "grafana-dashboard.json").read_text())
    exprs = {t["expr"] for p in dashboard["panels"] for t in p["targets"]}
    for kind in ("target", "actual"):
        assert f'max by (pool) (pool_workers{{pool=~"$pool",kind="{kind}"}})' in exprs


def test_rayservice_enables_gcs_fault_tolerance_with_the_redis_it_deploys() -> None:
    ft = rayservice()["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    docs = list(yaml.safe_load_all((MANIFESTS / "rayservice.yaml").read_text()))
    redis = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "pagefleet-redis")
    assert ft["redisAddress"] == f"redis://{redis['metadata']['name']}:{redis['spec']['ports'][0]['port']}"
    secret = ft["redisPassword"]["valueFrom"]["secretKeyRef"]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["env"][0]["valueFrom"]["secretKeyRef"] == secret  # one password for both
    assert deployment["spec"]["selector"]["matchLabels"] == redis["spec"]["selector"]


def test_rayservice_ingress_serves_through_a_gcs_restart_because_the_gcs_is_fault_tolerant() -> None:
    # Without the config switch the ingress would turn NOT_SERVING as soon as the GCS
    # stops answering; with it but no Redis, a restarted GCS would have lost the cluster.
    assert rayservice()["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]["redisAddress"]
    parsed = parse_args(serve_config_v2()["applications"][0]["args"])
    assert parsed.config.server.gcs_fault_tolerance is True
    assert load("serve.yaml")["applications"][0]["args"]["config"]["server"].get("gcs_fault_tolerance") is None
