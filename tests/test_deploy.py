"""
The deployment files keep their promises (FD §3, §4, §7): C{compose.yml} is
a valid Compose file, C{deploy/nvproxy.toml} describes exactly its vLLM
services, nothing private is published beyond loopback, and the daemon's own
loader accepts the configuration.

Docker does not run here: C{compose.yml} is validated against the Compose
Specification's JSON schema (vendored in C{tests/compose_spec}, see its
C{SOURCE.rst}) and the invariants are read from the parsed files.  Each check
returns its problems, so a failure names every offender, and the checks are
also run on broken copies to show they catch what they claim.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import yaml
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.config import load_config

ROOT = Path(__file__).parent.parent
COMPOSE = ROOT / "compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
NVPROXY_TOML = ROOT / "deploy" / "nvproxy.toml"
SCHEMA = Path(__file__).parent / "compose_spec" / "compose_spec.json"
UNIT = ROOT / "deploy" / "nvproxy.service"
INSTALLED_TWISTD = "/opt/nvproxy/bin/twistd"

DAEMON_COMMAND = [
    "twistd",
    "-n",
    "--pidfile=",
    "nvproxy",
    "--config",
    "/etc/nvproxy/nvproxy.toml",
]
CONFIG_IN_CONTAINER = "/etc/nvproxy/nvproxy.toml"
ADMIN_PORT = 8010
FACADE_PORT = 8000


def load_compose() -> dict[str, Any]:
    with COMPOSE.open() as f:
        document: dict[str, Any] = yaml.safe_load(f)
    return document


def load_toml() -> dict[str, Any]:
    with NVPROXY_TOML.open("rb") as f:
        return tomllib.load(f)


def published(port: object) -> tuple[str | None, int | None, int]:
    """
    A short-syntax port mapping as (host address, host port, container
    port): C{"127.0.0.1:8010:8010"}, C{"8000:8000"}, C{"8000"}.
    """
    text = str(port).split("/")[0]
    parts = text.rsplit(":", 2)
    container = int(parts[-1])
    if len(parts) == 1:
        return None, None, container
    if len(parts) == 2:
        return None, int(parts[0]), container
    return parts[0].strip("[]"), int(parts[1]), container


def command_of(service: Mapping[str, Any]) -> list[str]:
    command = service.get("command", [])
    if isinstance(command, str):
        return command.split()
    return [str(c) for c in command]


def environment_of(service: Mapping[str, Any]) -> dict[str, str]:
    environment = service.get("environment", {})
    if isinstance(environment, list):
        return dict(str(e).partition("=")[::2] for e in environment)
    return {str(k): str(v) for k, v in environment.items()}


def option(command: list[str], name: str) -> str | None:
    """The value of C{--name VALUE} or C{--name=VALUE}, if given."""
    for index, word in enumerate(command):
        if word == name and index + 1 < len(command):
            return command[index + 1]
        if word.startswith(name + "="):
            return word.partition("=")[2]
    return None


def vllm_services(compose: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The compose services that run vLLM (by their image)."""
    return {
        name: service
        for name, service in compose.get("services", {}).items()
        if "vllm" in str(service.get("image", ""))
    }


def depends_on_conditions(compose: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    for name, service in compose.get("services", {}).items():
        depends = service.get("depends_on", {})
        if isinstance(depends, list):
            # The short form means service_started.
            continue
        for other, spec in depends.items():
            yield f"{name} -> {other}", str(spec.get("condition"))


def schema_problems(compose: object) -> list[str]:
    with SCHEMA.open() as f:
        schema = json.load(f)
    validator = jsonschema.Draft201909Validator(schema)
    return [
        f"{'/'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message}"
        for e in validator.iter_errors(compose)
    ]


def compose_problems(compose: Mapping[str, Any]) -> list[str]:
    """The FD §3/§4/§7 invariants of C{compose.yml} on its own."""
    problems: list[str] = []
    services = compose.get("services", {})
    for edge, condition in depends_on_conditions(compose):
        if condition != "service_started":
            problems.append(f"depends_on {edge}: condition {condition}")
    nvproxy = services.get("nvproxy", {})
    ports = [published(p) for p in nvproxy.get("ports", [])]
    if (None, FACADE_PORT, FACADE_PORT) not in ports:
        problems.append("nvproxy: the vLLM facade is not published as 8000:8000")
    admin = [p for p in ports if p[2] == ADMIN_PORT]
    if not admin:
        problems.append("nvproxy: the admin listener is not published")
    for host, _, _ in admin:
        if host != "127.0.0.1":
            problems.append(f"nvproxy: admin published on {host or 'every address'}")
    if command_of(nvproxy) != DAEMON_COMMAND:
        problems.append(f"nvproxy: command {command_of(nvproxy)}")
    if "healthcheck" not in nvproxy:
        problems.append("nvproxy: no healthcheck")
    mounts = [str(v) for v in nvproxy.get("volumes", [])]
    if not any(m.endswith(f":{CONFIG_IN_CONTAINER}:ro") for m in mounts):
        problems.append("nvproxy: the configuration is not mounted read-only")
    named = set(compose.get("volumes", {}) or {})
    if not any(m.split(":")[0] in named for m in mounts):
        problems.append("nvproxy: no named volume for its state")
    vllm = vllm_services(compose)
    if not vllm:
        problems.append("no vLLM service")
    waits_for = set(nvproxy.get("depends_on", {}))
    for name, service in vllm.items():
        command = command_of(service)
        environment = environment_of(service)
        for flag in ("--enable-sleep-mode", "--disable-custom-all-reduce"):
            if flag not in command:
                problems.append(f"{name}: no {flag}")
        for flag in ("--max-model-len", "--gpu-memory-utilization"):
            if option(command, flag) is None:
                problems.append(f"{name}: no explicit {flag}")
        if environment.get("VLLM_SERVER_DEV_MODE") != "1":
            problems.append(f"{name}: VLLM_SERVER_DEV_MODE is not 1")
        if environment.get("NCCL_P2P_DISABLE") != "1":
            problems.append(f"{name}: NCCL_P2P_DISABLE is not 1")
        if not environment.get("CUDA_VISIBLE_DEVICES"):
            problems.append(f"{name}: no explicit CUDA_VISIBLE_DEVICES")
        reservations = (
            service.get("deploy", {}).get("resources", {}).get("reservations", {})
        )
        if not reservations.get("devices"):
            problems.append(f"{name}: no GPU device reservation")
        if service.get("ipc") != "host":
            problems.append(f"{name}: ipc is not host")
        if service.get("restart") != "unless-stopped":
            problems.append(f"{name}: restart is not unless-stopped")
        for host, host_port, _ in (published(p) for p in service.get("ports", [])):
            if host != "127.0.0.1":
                problems.append(
                    f"{name}: debug port {host_port} on {host or 'every address'}"
                )
        if name not in waits_for:
            problems.append(f"nvproxy does not depend on {name}")
    return problems


def subnets(compose: Mapping[str, Any]) -> list[str]:
    return [
        str(entry["subnet"])
        for network in (compose.get("networks") or {}).values()
        for entry in ((network or {}).get("ipam", {}).get("config", []))
        if "subnet" in entry
    ]


def vllm_port(command: list[str]) -> int:
    return int(option(command, "--port") or 8000)


def served_model(command: list[str]) -> str:
    name = option(command, "--served-model-name")
    return name if name is not None else command[0]


def pairing_problems(compose: Mapping[str, Any], toml: Mapping[str, Any]) -> list[str]:
    """C{deploy/nvproxy.toml} against C{compose.yml}."""
    problems: list[str] = []
    vllm = vllm_services(compose)
    engines = toml.get("engines", {})
    configured = engines.get("vllm", {}).get("services", [])
    by_host: dict[str, Mapping[str, Any]] = {}
    for entry in configured:
        url = urlsplit(entry["url"])
        host = url.hostname or ""
        by_host[host] = entry
        service = vllm.get(host)
        if service is None:
            problems.append(f"service {entry['name']}: {host} is not in compose.yml")
            continue
        command = command_of(service)
        port = url.port or 80
        if port != vllm_port(command):
            problems.append(f"service {entry['name']}: port {port} is not vLLM's")
        if served_model(command) != entry["model"]:
            problems.append(
                f"service {entry['name']}: model {entry['model']!r} but"
                f" {host} serves {served_model(command)!r}"
            )
        for key in ("idle_sleep", "idle_offload"):
            if key not in entry:
                problems.append(f"service {entry['name']}: no {key}")
    for name in vllm:
        if name not in by_host:
            problems.append(f"{name} is not in deploy/nvproxy.toml")
    if engines.get("vllm", {}).get("port", FACADE_PORT) != FACADE_PORT:
        problems.append("the vLLM facade is not on 8000")
    if toml.get("admin", {}).get("listen", "127.0.0.1:8010") != "127.0.0.1:8010":
        problems.append("the admin listener is not 127.0.0.1:8010")
    if toml.get("listen_interface") in (None, "127.0.0.1", "::1"):
        problems.append("the facades listen on loopback: nothing outside reaches them")
    declared = subnets(compose)
    if len(declared) != 1:
        problems.append(f"compose.yml declares {len(declared)} subnets, not one")
    allowed = toml.get("access", {}).get("plaintext_from", [])
    for subnet in declared:
        network = ipaddress.ip_network(subnet)
        if not any(ipaddress.ip_network(a) == network for a in allowed):
            problems.append(f"the compose subnet {subnet} is not in plaintext_from")
    keys = toml.get("access", {}).get("api_keys_file")
    if keys is not None:
        mounts = compose.get("services", {}).get("nvproxy", {}).get("volumes", [])
        if not any(str(m).endswith(f":{keys}:ro") for m in mounts):
            problems.append(f"api_keys_file {keys} is not mounted read-only")
    return problems


class ComposeTests(SynchronousTestCase):
    def test_schema(self) -> None:
        """compose.yml is a valid Compose file."""
        self.assertEqual(schema_problems(load_compose()), [])

    def test_schema_catches(self) -> None:
        """The schema refuses what Compose would refuse."""
        compose = load_compose()
        compose["services"]["nvproxy"]["restrat"] = "always"
        compose["services"]["vllm-text"]["depends_on"] = {
            "vllm-ocr": {"condition": "when_ready"}
        }
        problems = schema_problems(compose)
        self.assertEqual(len(problems), 2, problems)

    def test_invariants(self) -> None:
        """Every FD §3/§4/§7 invariant holds."""
        self.assertEqual(compose_problems(load_compose()), [])

    def test_invariants_catch(self) -> None:
        """
        A public admin port, a service_healthy wait, a public debug port, a
        vLLM without sleep mode or dev mode: each is named.
        """
        compose = load_compose()
        services = compose["services"]
        services["nvproxy"]["ports"] = ["8000:8000", "8010:8010"]
        services["nvproxy"]["depends_on"]["vllm-ocr"]["condition"] = "service_healthy"
        services["vllm-ocr"]["ports"] = ["8002:8000"]
        services["vllm-embed"]["command"].remove("--enable-sleep-mode")
        services["vllm-text"]["environment"].pop("VLLM_SERVER_DEV_MODE")
        self.assertEqual(
            sorted(compose_problems(compose)),
            [
                "depends_on nvproxy -> vllm-ocr: condition service_healthy",
                "nvproxy: admin published on every address",
                "vllm-embed: no --enable-sleep-mode",
                "vllm-ocr: debug port 8002 on every address",
                "vllm-text: VLLM_SERVER_DEV_MODE is not 1",
            ],
        )

    def test_no_service_healthy_anywhere(self) -> None:
        """Nowhere outside comments, even where the structured walk does not look."""
        text = "\n".join(
            line.split("#")[0] for line in COMPOSE.read_text().splitlines()
        )
        self.assertNotIn("service_healthy", text)

    def test_dockerfile(self) -> None:
        """
        The image installs the checkout, runs as a non-root user and starts
        the daemon exactly as compose.yml does.
        """
        lines = [
            line.strip()
            for line in DOCKERFILE.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        ]
        self.assertTrue(lines[0].startswith("FROM python:3.11-slim"), lines[0])
        users = [line.split()[1] for line in lines if line.startswith("USER ")]
        self.assertEqual(users, ["nvproxy"])
        self.assertIn("pip install /src", " ".join(lines))
        # What it copies exists: a moved file fails here, not in a build.
        for line in lines:
            if line.startswith("COPY "):
                for source in line.split()[1:-1]:
                    self.assertTrue((ROOT / source).exists(), source)
        ignored = (ROOT / ".dockerignore").read_text().split()
        for heavy in (".git", ".tox"):
            self.assertIn(heavy, ignored)
        (cmd,) = [line for line in lines if line.startswith("CMD ")]
        self.assertEqual(json.loads(cmd[len("CMD ") :]), DAEMON_COMMAND)
        self.assertEqual(
            command_of(load_compose()["services"]["nvproxy"]), DAEMON_COMMAND
        )


class ConfigPairingTests(SynchronousTestCase):
    def test_pairing(self) -> None:
        """
        deploy/nvproxy.toml names each vLLM service of compose.yml once, by
        its service DNS name and vLLM's port, with the model it serves; the
        compose subnet is allowed plaintext.
        """
        self.assertEqual(pairing_problems(load_compose(), load_toml()), [])

    def test_pairing_catches(self) -> None:
        """A service missing on either side, a wrong model, a foreign subnet."""
        compose = load_compose()
        toml = copy.deepcopy(load_toml())
        services = toml["engines"]["vllm"]["services"]
        embed = next(s for s in services if s["url"] == "http://vllm-embed:8000")
        services.remove(embed)
        services[0]["model"] = "Qwen2"
        services.append(dict(embed, name="extra", url="http://vllm-extra:8000"))
        toml["access"]["plaintext_from"] = ["10.0.0.0/8"]
        toml["access"]["api_keys_file"] = "/etc/nvproxy/api-keys"
        problems = pairing_problems(compose, toml)
        self.assertEqual(
            sorted(problems),
            [
                "api_keys_file /etc/nvproxy/api-keys is not mounted read-only",
                "service extra: vllm-extra is not in compose.yml",
                "service text: model 'Qwen2' but vllm-text serves"
                " 'Qwen3.6-35B-A3B-FP8'",
                "the compose subnet 172.30.80.0/24 is not in plaintext_from",
                "vllm-embed is not in deploy/nvproxy.toml",
            ],
        )

    def test_keys_file_mounted(self) -> None:
        """An api_keys_file mounted read-only at its path passes."""
        compose = load_compose()
        toml = copy.deepcopy(load_toml())
        toml["access"]["api_keys_file"] = "/etc/nvproxy/api-keys"
        compose["services"]["nvproxy"]["volumes"].append(
            "./deploy/api-keys:/etc/nvproxy/api-keys:ro"
        )
        self.assertEqual(pairing_problems(compose, toml), [])

    def test_deploy_config_loads(self) -> None:
        """The daemon's own loader accepts deploy/nvproxy.toml."""
        config = load_config(str(NVPROXY_TOML), {}, {})
        services = config.engines["vllm"].services
        self.assertEqual(
            [s.url for s in services],
            [e["url"] for e in load_toml()["engines"]["vllm"]["services"]],
        )


def unit_settings(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as section -> key -> every value given, in order."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


class SystemdUnitTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.text = UNIT.read_text()
        self.service = unit_settings(self.text)["Service"]

    def one(self, key: str) -> str:
        values = self.service.get(key, [])
        self.assertEqual(len(values), 1, f"{key}: {values}")
        return values[0]

    def test_runs_the_daemon(self) -> None:
        """
        twistd in the foreground without a pidfile, from the virtualenv the
        Dockerfile also uses, on /etc/nvproxy/nvproxy.toml, as its own user.
        """
        self.assertEqual(
            self.one("ExecStart").split(), [INSTALLED_TWISTD, *DAEMON_COMMAND[1:]]
        )
        self.assertIn("/opt/nvproxy/bin/pip install", DOCKERFILE.read_text())
        self.assertNotIn(self.one("User"), ("", "root", "0"))
        self.assertEqual(self.one("Restart"), "on-failure")
        self.assertEqual(self.one("StateDirectory"), "nvproxy")
        self.assertEqual(self.one("ExecReload"), "/bin/kill -HUP $MAINPID")

    def test_hardening(self) -> None:
        """The sandbox the issue names, and no capabilities at all."""
        for key, value in [
            ("NoNewPrivileges", "yes"),
            ("ProtectSystem", "strict"),
            ("ProtectHome", "yes"),
            ("PrivateTmp", "yes"),
            ("CapabilityBoundingSet", ""),
        ]:
            self.assertEqual(self.one(key), value, key)
        families = set(self.one("RestrictAddressFamilies").split())
        self.assertEqual(families, {"AF_INET", "AF_INET6", "AF_UNIX"})

    def test_systemd_analyze_verify(self) -> None:
        """
        C{systemd-analyze verify} finds nothing to say.  It checks that
        ExecStart's program exists, so the copy it sees starts this test
        environment's twistd instead of the installed one.
        """
        tool = shutil.which("systemd-analyze")
        if tool is None:
            raise self.skipTest("systemd-analyze is not installed (Debian: systemd)")
        twistd = Path(sys.executable).parent / "twistd"
        directory = Path(self.mktemp())
        directory.mkdir()
        unit = directory / UNIT.name
        unit.write_text(self.text.replace(INSTALLED_TWISTD, str(twistd)))
        result = subprocess.run(
            [tool, "verify", str(unit)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        # verify exits 0 on unknown keys and bad values: its output counts.
        self.assertEqual((result.returncode, result.stdout + result.stderr), (0, ""))
