"""Offline validation of the deployment configs: cluster.yaml, the Serve configs and the KubeRay RayService.

Owns: checking each file against the schema Ray itself applies (ray-schema.json for the cluster launcher,
`ray.serve.schema.ServeDeploySchema` for `serve deploy` / serveConfigV2), the app's `args:` against
deployments/args.py, and the cross-file contract: every stage's custom resource exists on exactly the node
type / worker group meant for it, GPU stages land where GPUs are, the local config needs neither GPUs nor
CPUs, and `docs/deploying.md`'s `serve run ... k=v` examples parse. No Ray cluster is started: these
are imports of the ray package only.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray.autoscaler
import yaml
from pydantic import BaseModel
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import DeploymentSchema, ServeDeploySchema

from deployments.args import AppArgs, parse_args
from deployments.cluster_env import CLUSTER_ENV
from deployments.stage_args import StageArgs

ROOT = Path(__file__).resolve().parents[3]
CLUSTER_YAML = ROOT / "cluster.yaml"
SERVE_CONFIG = ROOT / "deployments" / "serve_config.yaml"
SERVE_CONFIG_LOCAL = ROOT / "deployments" / "serve_config.local.yaml"
RAYSERVICE = ROOT / "deployments" / "kuberay" / "rayservice.yaml"
DEPLOYING_MD = ROOT / "docs" / "deploying.md"

STAGES = ("ingress", "preprocess", "encoder", "decoder")
GPU_STAGES = {"encoder", "decoder"}
# The six deployments build_app creates; a `deployments:` override naming anything else fails at deploy.
DEPLOYMENT_NAMES = {"Ingress", "Preprocess", "ProcessorCacheStore", "Encoder", "Decoder", "MetricsHub"}
# The pin of each stage, and where that pin must (and only there) be advertised.
STAGE_PIN = {"ingress": "preprocess_node", "preprocess": "preprocess_node",
             "encoder": "encoder_node", "decoder": "decoder_node"}
NODE_TYPE_OF_PIN = {"preprocess_node": "preprocess_cpu", "encoder_node": "encoder_gpu",
                    "decoder_node": "decoder_gpu"}
GROUP_OF_PIN = {"preprocess_node": "preprocess-cpu", "encoder_node": "encoder-gpu", "decoder_node": "decoder-gpu"}


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _rayservice() -> dict[str, Any]:
    return _load(RAYSERVICE)


def _serve_config_v2() -> dict[str, Any]:
    # serveConfigV2 is a YAML document inside a string: KubeRay hands it to Serve as is.
    serve_config = _rayservice()["spec"]["serveConfigV2"]
    assert isinstance(serve_config, str), "serveConfigV2 must be a YAML string, not a mapping"
    return yaml.safe_load(serve_config)


SERVE_CONFIGS = {
    "serve_config.yaml": lambda: _load(SERVE_CONFIG),
    "serve_config.local.yaml": lambda: _load(SERVE_CONFIG_LOCAL),
    "rayservice serveConfigV2": _serve_config_v2,
}
CLUSTER_SERVE_CONFIGS = ("serve_config.yaml", "rayservice serveConfigV2")


def _unknown_keys(model: BaseModel, raw: Any, where: str = "") -> list[str]:
    """Keys of `raw` the validated `model` ignored. Serve's schemas leave pydantic's default extra="ignore"
    (on purpose, for forward compatibility), so a typo such as `http_option:` validates and is dropped."""
    if not isinstance(raw, dict):
        return []
    fields = type(model).model_fields
    aliases = {f.alias: name for name, f in fields.items() if f.alias}
    unknown = []
    for key, value in raw.items():
        name = aliases.get(key, key)
        if name not in fields:
            unknown.append(f"{where}{key}")
            continue
        attr = getattr(model, name)
        if isinstance(attr, BaseModel):
            unknown += _unknown_keys(attr, value, f"{where}{key}.")
        elif isinstance(attr, list) and isinstance(value, list):
            for i, (item, raw_item) in enumerate(zip(attr, value, strict=True)):
                if isinstance(item, BaseModel):
                    unknown += _unknown_keys(item, raw_item, f"{where}{key}[{i}].")
    return unknown


def _validate_serve_config(raw: dict[str, Any]) -> ServeDeploySchema:
    schema = ServeDeploySchema.model_validate(raw)  # what `serve deploy` and KubeRay's serve client apply
    assert _unknown_keys(schema, raw) == []
    return schema


def _app(raw: dict[str, Any]) -> dict[str, Any]:
    [app] = raw["applications"]
    return app


def _max_replicas(stage: StageArgs) -> int:
    return stage.autoscaling.max_replicas if stage.autoscaling is not None else (stage.num_replicas or 1)


def _overrides(app: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in app.get("deployments", [])}


# --- cluster.yaml -------------------------------------------------------------------------------------


def test_cluster_yaml_passes_rays_json_schema_and_ray_up_validation() -> None:
    raw = _load(CLUSTER_YAML)
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(raw, schema)
    # What `ray up` does before it talks to the cloud: fill the provider's defaults, merge the setup
    # commands, then the schema plus the cross-field checks (head type exists, sum of min_workers fits).
    prepared = prepare_config(copy.deepcopy(raw))
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"
    assert prepared["head_node_type"] == "head"


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        # Node resources are integers in the schema: a fractional pin belongs in the serve config only.
        (lambda c: c["available_node_types"]["encoder_gpu"]["resources"].update(encoder_node=0.5),
         jsonschema.ValidationError),
        (lambda c: c.update(setup_comands=[]), jsonschema.ValidationError),  # typo: additionalProperties
        (lambda c: c.update(head_node_type="nope"), ValueError),
    ],
)
def test_cluster_validation_rejects_broken_configs(mutate: Any, error: type[Exception]) -> None:
    # The validators above must be able to fail, or the previous test proves nothing.
    config = prepare_config(_load(CLUSTER_YAML))
    mutate(config)
    with pytest.raises(error):
        validate_config(config)


def test_cluster_node_types_each_advertise_exactly_their_own_pin() -> None:
    node_types = _load(CLUSTER_YAML)["available_node_types"]
    assert set(node_types) == {"head", *NODE_TYPE_OF_PIN.values()}
    # The head serves nothing: no CPU to schedule on, no pin, no workers of its type.
    assert node_types["head"]["resources"] == {"CPU": 0}
    assert node_types["head"].get("max_workers", 0) == 0
    for pin, node_type in NODE_TYPE_OF_PIN.items():
        carriers = [name for name, spec in node_types.items() if pin in spec["resources"]]
        assert carriers == [node_type], f"{pin} must be on {node_type} only, is on {carriers}"
        spec = node_types[node_type]
        assert spec["resources"][pin] >= 1
        assert 0 <= spec["min_workers"] <= spec["max_workers"]
    assert node_types["encoder_gpu"]["resources"].get("GPU", 0) >= 1
    assert node_types["decoder_gpu"]["resources"].get("GPU", 0) >= 1
    assert node_types["preprocess_cpu"]["resources"].get("GPU", 0) == 0


def test_cluster_start_commands_leave_custom_resources_to_node_types() -> None:
    config = _load(CLUSTER_YAML)
    # worker_start_ray_commands is shared by every worker type: a --resources there would put every
    # pin on every worker. The launcher passes each type's `resources:` as RAY_OVERRIDE_RESOURCES.
    assert not any("--resources" in cmd for cmd in config["worker_start_ray_commands"])
    assert any("ray start --address=" in cmd for cmd in config["worker_start_ray_commands"])
    assert any("ray start --head" in cmd and "--num-cpus=0" in cmd for cmd in config["head_start_ray_commands"])


def test_cluster_setup_installs_the_project_with_the_pinned_torch() -> None:
    config = _load(CLUSTER_YAML)
    [torch_pin] = re.findall(r'"(torch==[^"]+)"', (ROOT / "pyproject.toml").read_text())

    def torch_install(commands: list[str]) -> str:
        [cmd] = [c for c in commands if "pip install" in c and "torch==" in c]
        assert f"'{torch_pin}'" in cmd, f"{cmd!r} does not pin {torch_pin}"
        assert any("pip install" in c and "/home/ubuntu/mmserve" in c for c in commands)
        return cmd

    assert "/whl/cpu" in torch_install(config["setup_commands"])  # head + preprocess_cpu
    for gpu_type in ("encoder_gpu", "decoder_gpu"):
        # A node type's own worker_setup_commands replace the global setup_commands entirely.
        commands = config["available_node_types"][gpu_type]["worker_setup_commands"]
        assert re.search(r"/whl/cu\d+", torch_install(commands))
    assert "worker_setup_commands" not in config["available_node_types"]["preprocess_cpu"]
    assert config["file_mounts"] == {"/home/ubuntu/mmserve": "."}


# --- Serve configs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_serve_config_validates_and_its_args_parse(name: str) -> None:
    raw = SERVE_CONFIGS[name]()
    schema = _validate_serve_config(raw)
    [app] = schema.applications
    assert (app.name, app.route_prefix, app.import_path) == ("mmserve", "/", "deployments.app:build_app")
    assert schema.http_options.port == 8000
    args = parse_args(app.args)  # extra="forbid": a misspelt arg fails here
    for stage_name in STAGES:
        options = getattr(args, stage_name).deployment_options()
        # What build_app hands Serve for the stage must be valid deployment options; Serve types
        # autoscaling_config as a plain Dict there, so its own model checks the values.
        DeploymentSchema.model_validate({"name": stage_name, **options})
        if "autoscaling_config" in options:
            AutoscalingConfig.model_validate(options["autoscaling_config"])
    assert set(_overrides(_app(raw))) <= DEPLOYMENT_NAMES


def test_serve_schema_ignores_typos_so_the_unknown_key_check_is_needed() -> None:
    raw = _load(SERVE_CONFIG)
    raw["http_option"] = {"port": 9000}
    _app(raw)["deployments"][0]["ray_actor_option"] = {"num_cpus": 3}
    schema = ServeDeploySchema.model_validate(raw)  # Serve itself accepts both typos silently
    assert set(_unknown_keys(schema, raw)) == {"http_option", "applications[0].deployments[0].ray_actor_option"}


def test_serve_config_args_reject_a_misspelt_stage_option() -> None:
    args = copy.deepcopy(_app(_load(SERVE_CONFIG))["args"])
    args["decoder"]["max_num_seq"] = 8
    with pytest.raises(ValueError, match="max_num_seq"):
        parse_args(args)


def test_rayservice_serve_config_is_serve_config_yaml() -> None:
    # One app, two launchers: the KubeRay copy must not drift from the file `serve deploy` uses.
    assert _serve_config_v2() == _load(SERVE_CONFIG)


@pytest.mark.parametrize("name", CLUSTER_SERVE_CONFIGS)
def test_cluster_serve_config_pins_each_stage_to_its_node_type(name: str) -> None:
    raw = SERVE_CONFIGS[name]()
    app = _app(raw)
    args = parse_args(app["args"])
    assert args.engine.model == "/models/gemma-3-4b-it"
    node_types = _load(CLUSTER_YAML)["available_node_types"]
    group_pins = {g["groupName"]: _group_custom_resources(g) for g in _worker_groups()}
    for stage_name in STAGES:
        stage = getattr(args, stage_name)
        pin = STAGE_PIN[stage_name]
        assert set(stage.resources) == {pin}, f"{stage_name} must ask for exactly {pin}"
        assert 0 < stage.resources[pin] <= 0.01  # a token amount: CPU/GPU stay the constraint
        assert pin in node_types[NODE_TYPE_OF_PIN[pin]]["resources"]
        assert pin in group_pins[GROUP_OF_PIN[pin]]
        if stage_name in GPU_STAGES:
            assert stage.num_gpus >= 1, f"{stage_name} needs a GPU on the cluster"
        else:
            assert stage.num_gpus == 0
    # ProcessorCacheStore has no args block: its override pins it next to the preprocess replicas,
    # restating num_cpus because the override replaces the code's whole ray_actor_options.
    store = _overrides(app)["ProcessorCacheStore"]["ray_actor_options"]
    assert store["resources"] == {"preprocess_node": 0.01}
    assert "num_cpus" in store


def _stage_demands(app: dict[str, Any]) -> dict[str, list[tuple[str, int, float, float]]]:
    """Per pin: (who, max replicas, CPUs per replica, GPUs per replica)."""
    args = parse_args(app["args"])
    demands: dict[str, list[tuple[str, int, float, float]]] = {}
    for stage_name in STAGES:
        stage = getattr(args, stage_name)
        demands.setdefault(STAGE_PIN[stage_name], []).append(
            (stage_name, _max_replicas(stage), stage.num_cpus, stage.num_gpus))
    store = _overrides(app)["ProcessorCacheStore"]["ray_actor_options"]
    [pin] = store["resources"]
    demands[pin].append(("ProcessorCacheStore", 1, store.get("num_cpus", 0), store.get("num_gpus", 0)))
    return demands


def _check_capacity(demands: dict[str, list[tuple[str, int, float, float]]],
                    capacity: dict[str, tuple[float, float, int]]) -> None:
    """capacity: pin -> (CPUs per node, GPUs per node, max nodes). Every replica must fit one node, and
    every stage at max_replicas must fit the group at max size (summed per group: necessary, not a full
    bin-packing, but it catches a max_replicas raised past what the autoscaler may ever launch)."""
    for pin, stages in demands.items():
        cpus, gpus, nodes = capacity[pin]
        for who, _, cpu, gpu in stages:
            assert cpu <= cpus and gpu <= gpus, f"one {who} replica does not fit a {pin} node"
        assert sum(n * cpu for _, n, cpu, _ in stages) <= cpus * nodes, f"{pin} nodes lack CPUs"
        assert sum(n * gpu for _, n, _, gpu in stages) <= gpus * nodes, f"{pin} nodes lack GPUs"


def test_cluster_yaml_can_hold_every_stage_at_max_replicas() -> None:
    node_types = _load(CLUSTER_YAML)["available_node_types"]
    capacity = {pin: (node_types[t]["resources"]["CPU"], node_types[t]["resources"].get("GPU", 0),
                      node_types[t]["max_workers"]) for pin, t in NODE_TYPE_OF_PIN.items()}
    _check_capacity(_stage_demands(_app(_load(SERVE_CONFIG))), capacity)


def test_serve_config_local_is_cpu_only_and_fits_two_cores() -> None:
    raw = _load(SERVE_CONFIG_LOCAL)
    app = _app(raw)
    args: AppArgs = parse_args(app["args"])
    assert args.engine.model is None  # the built-in tiny checkpoint: nothing to download
    cpus = 0.0
    for stage_name in STAGES:
        stage = getattr(args, stage_name)
        assert stage.num_gpus == 0 and stage.resources == {}, f"{stage_name} must run anywhere"
        cpus += _max_replicas(stage) * stage.num_cpus
    for override in app.get("deployments", []):
        actor = override.get("ray_actor_options", {})
        assert not actor.get("num_gpus") and not actor.get("resources")
        cpus += actor.get("num_cpus", 0)
    assert cpus <= 2
    assert args.engine_config(args.decoder).device == "cpu"


# --- KubeRay RayService -------------------------------------------------------------------------------


def _worker_groups() -> list[dict[str, Any]]:
    return _rayservice()["spec"]["rayClusterConfig"]["workerGroupSpecs"]


def _group_custom_resources(group: dict[str, Any]) -> dict[str, float]:
    # KubeRay's documented quoting: a YAML string holding a JSON string holding the JSON object.
    value = group["rayStartParams"].get("resources")
    if value is None:
        return {}
    decoded = json.loads(value)
    return json.loads(decoded) if isinstance(decoded, str) else decoded


def _container(pod_template: dict[str, Any]) -> dict[str, Any]:
    [container] = pod_template["spec"]["containers"]
    return container


def _cpu_quantity(value: Any) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_rayservice_cluster_shape() -> None:
    service = _rayservice()
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert "autoscalerOptions" in cluster
    # One Ray version across launchers: the image's must match what cluster.yaml installs.
    [cluster_ray] = set(re.findall(r"ray\[[a-z,]+\]==([\w.]+)", CLUSTER_YAML.read_text()))
    assert cluster["rayVersion"] == cluster_ray
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in _worker_groups()}
    assert set(groups) == set(GROUP_OF_PIN.values())
    for pin, group_name in GROUP_OF_PIN.items():
        group = groups[group_name]
        assert _group_custom_resources(group) == {pin: 1000}
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        # rayStartParams values are strings to KubeRay; a bare YAML number is rejected by the CRD.
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in groups.values()]
    for template in templates:
        container = _container(template)
        assert container["image"] == "mmserve:latest"
        [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/models"]
        [volume] = [v for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
        assert volume["persistentVolumeClaim"]["claimName"] == "mmserve-models"


def test_rayservice_gpu_groups_request_gpus_for_the_gpu_stages() -> None:
    args = parse_args(_app(_serve_config_v2())["args"])
    groups = {g["groupName"]: g for g in _worker_groups()}
    for stage_name in STAGES:
        group = groups[GROUP_OF_PIN[STAGE_PIN[stage_name]]]
        limits = _container(group["template"])["resources"]["limits"]
        gpus = int(limits.get("nvidia.com/gpu", 0))
        if stage_name in GPU_STAGES:
            assert gpus >= getattr(args, stage_name).num_gpus >= 1, f"{group['groupName']} lacks GPUs"
        else:
            assert gpus == 0, f"{group['groupName']} holds no GPU stage but asks for a GPU"


def test_rayservice_can_hold_every_stage_at_max_replicas() -> None:
    capacity = {}
    for group in _worker_groups():
        [pin] = _group_custom_resources(group)
        limits = _container(group["template"])["resources"]["limits"]
        capacity[pin] = (_cpu_quantity(limits["cpu"]), float(limits.get("nvidia.com/gpu", 0)), group["maxReplicas"])
    _check_capacity(_stage_demands(_app(_serve_config_v2())), capacity)


# --- docs ---------------------------------------------------------------------------------------------


def test_deploying_md_serve_run_examples_parse() -> None:
    # Every `serve run deployments.app:build_app k=v ...` in the doc must be accepted by parse_args.
    text = DEPLOYING_MD.read_text().replace("\\\n", " ")
    commands = [line.strip() for line in text.splitlines() if "serve run deployments.app:build_app" in line]
    assert commands, "docs/deploying.md shows no `serve run deployments.app:build_app` example"
    for command in commands:
        words = shlex.split(command[command.index("serve run"):].split("#")[0])
        pairs = dict(w.split("=", 1) for w in words[3:] if "=" in w)
        assert pairs, command
        parse_args(pairs)


def test_every_node_starts_with_mmserves_cluster_env() -> None:
    """What `serve run <import path>` gives the cluster it starts (deployments/cluster_env.py: CLUSTER_ENV), every node
    of the launcher's and KubeRay's clusters gets from its start command or its container."""
    wanted = {f"{key}={value}" for key, value in CLUSTER_ENV.items()}
    config = _load(CLUSTER_YAML)
    starts = [cmd for key in ("head_start_ray_commands", "worker_start_ray_commands") for cmd in config[key]
              if "ray start" in cmd]
    assert len(starts) == 2
    for cmd in starts:
        assert wanted <= set(shlex.split(cmd.split(";")[-1])), cmd
    cluster = _rayservice()["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"], *(g["template"] for g in _worker_groups())]
    for template in templates:
        env = {e["name"]: e["value"] for e in _container(template).get("env", [])}
        assert {f"{k}={v}" for k, v in env.items()} >= wanted, template


def test_kuberay_keeps_an_old_cluster_past_the_longest_request():
    """An image bump replaces the cluster: the old one must outlive every request it still answers."""
    from deployments.stage_args import IngressArgs

    delay = _rayservice()["spec"]["rayClusterDeletionDelaySeconds"]
    timeout = _serve_config_v2()["applications"][0]["args"].get("ingress", {}).get(
        "request_timeout_s", IngressArgs().request_timeout_s)
    assert delay >= timeout + 30, (delay, timeout)
