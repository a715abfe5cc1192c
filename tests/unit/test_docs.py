"""The docs stay true to the code: generated pages are fresh, links resolve, flags exist."""
from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

from batchline.testing.checkout import ROOT

# The pages a reader follows from README.md; the benchmark and deploy pages are linked from there.
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "deploy" / "README.md",
                *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def test_generated_pages_are_fresh():
    pages = _gen_docs().render()
    assert pages
    for rel, text in pages.items():
        path = ROOT / rel
        assert path.exists(), f"{rel} is not checked in: run python scripts/gen_docs.py"
        assert path.read_text() == text, f"{rel} is stale: run python scripts/gen_docs.py"


def test_every_setting_and_config_key_is_in_the_settings_page():
    # The generator reads the classes; this guards the generator itself against skipping any.
    from batchline.settings import CommonSettings
    from executor.model_config import ModelConfig
    from executor.settings import ExecutorSettings
    from gateway.settings import GatewaySettings
    from scheduler.settings import SchedulerSettings

    page = (ROOT / "docs" / "reference" / "settings.md").read_text()
    for cls in (GatewaySettings, SchedulerSettings, ExecutorSettings):
        prefix = cls.model_config["env_prefix"]
        for name in cls.model_fields:
            where = "BATCHLINE_<SERVICE>_" if name in CommonSettings.model_fields else prefix
            assert f"`{where}{name.upper()}`" in page, f"{prefix}{name.upper()} is not in docs/reference/settings.md"
    for key in ModelConfig.model_fields:
        assert f"`{key}`" in page or f"`[{key}]`" in page, f"config.toml key {key} is not in docs/reference/settings.md"


def test_every_metric_is_in_the_metrics_page():
    from prometheus_client.metrics import MetricWrapperBase

    from batchline import metrics

    page = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    found = [m for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)]
    assert len(found) >= len(metrics.METRIC_NAMES)
    for name in metrics.METRIC_NAMES:
        assert f"`{name}`" in page, f"{name} is not in docs/reference/metrics.md"


def test_every_status_code_is_in_the_status_codes_page():
    from batchline import errors

    page = (ROOT / "docs" / "reference" / "status-codes.md").read_text()
    rows = {m.group(1) for m in re.finditer(r"^\| `([A-Z_]+)` \|", page, re.M)}
    assert rows == {code.name for code in errors._CODES.values()}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(path: pathlib.Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # links inside code spans are not links
    return LINK.findall(text)


def test_the_slug_rule_matches_github():
    assert _slug("config.toml") == "configtoml"
    assert _slug("The `batchline bench` tool") == "the-batchline-bench-tool"
    assert _slug("Scheduling and admission control") == "scheduling-and-admission-control"
    assert _slug("soak.py") == "soakpy"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.is_dir() or anchor not in _anchors(dest)):
            broken.append(f"{target}: no heading '{anchor}' in {_rel(dest)}")
    assert not broken, f"{_rel(page)}: " + "; ".join(broken)


def test_every_page_is_reachable_from_the_readme():
    reached, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in reached or page.suffix != ".md" or not page.exists():
            continue
        reached.add(page)
        for target in _links(page):
            file_part = target.partition("#")[0]
            if file_part and not re.match(r"[a-z][a-z0-9+.-]*:", file_part):
                dest = (page.parent / file_part).resolve()
                todo.append(dest / "README.md" if dest.is_dir() else dest)
    unreached = [_rel(p) for p in PAGES if p.resolve() not in reached]
    assert not unreached, f"no link leads from README.md to {unreached}"


def _known_flags() -> set[str]:
    """Every flag batchline defines: the services' settings, the CLI and the benchmark scripts."""
    from batchline.settings import _flag
    from executor.settings import ExecutorSettings
    from gateway.settings import GatewaySettings
    from scheduler.settings import SchedulerSettings

    flags = {"--help"}
    for cls in (GatewaySettings, SchedulerSettings, ExecutorSettings):
        for name, info in cls.model_fields.items():
            flags.add(_flag(name))
            if info.annotation is bool:
                flags.add("--no-" + _flag(name)[2:])
    sources = [*(ROOT / "batchline").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
               *(ROOT / "scripts").glob("*.py")]
    for source in sources:
        text = source.read_text()
        flags.update(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", text))
        flags.update("--no-" + f
                     for f in re.findall(r"add_argument\(\s*\"--([a-z0-9-]+)\".*?BooleanOptionalAction", text))
    return flags


# Flags of other tools the docs show (docker, docker compose, kubectl, curl).
OTHER_TOOLS = {"--build", "--build-arg", "--scale", "--from-literal", "--from-file", "--profile", "--data-binary"}


def test_every_flag_the_docs_name_exists():
    known = _known_flags() | OTHER_TOOLS
    unknown = {}
    for page in PAGES:
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", page.read_text()):
            if flag not in known:
                unknown.setdefault(_rel(page), set()).add(flag)
    assert not unknown, f"flags the code does not define: {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_page_narrates_sessions(page):
    text = page.read_text()
    found = re.findall(r"\b(?:\w+th|first|second|third|this|last|next|previous|that) session\b", text, re.I)
    assert not found, f"{_rel(page)} narrates history ({found}): that goes to git"


def test_the_readme_commands_are_the_ones_dev_sh_runs():
    readme = (ROOT / "README.md").read_text()
    dev = (ROOT / "dev.sh").read_text()
    assert "./dev.sh up" in readme and "./dev.sh test" in readme and "./dev.sh lint" in readme
    assert re.search(r"^\s*up\)\n(?:.*\n)*?\s*exec .*batchline\" up", dev, re.M)
    assert re.search(r"^\s*test\)\n(?:.*\n)*?\s*exec .* -m pytest", dev, re.M)
    assert re.search(r"^\s*lint\)\n\s*install\n\s*.*/ruff\" check \.\n\s*.*/mypy\"\n"
                     r"\s*exec .* scripts/check_commits\.py\n", dev, re.M)
    # CI lints first, then runs the README's test command.
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./dev.sh test" in ci and 0 <= ci.find("./dev.sh lint") < ci.find("./dev.sh test")
