"""What README.md and docs/ promise that code can check: set-up commands, CI entry point, defaults,
and links that resolve. Each check reads the one section that documents its subject."""

import re

from conftest import REPO
from doc_pages import DOCS, README, broken_links, links, pages, section, table

from worker.config.engine_args import WORKER_DEFAULTS, known_env_names
from worker.config.early_settings import config_file
from worker.config.settings import WorkerSettings
from worker.model.baked_args import DEFAULT_ARGS_FILE
from worker.startup.fitness import FitnessSettings

QUICK_START = "Quick start (CPU machine, no GPU needed)"


def documented_defaults(text: str) -> dict[str, str]:
    """A settings table's first column's `NAME`s → its default cell."""
    return {name: default for names, default, *_ in table(text) for name in re.findall(r"`([A-Z_]+)`", names)}


def default_cell(value: object) -> str:
    """How a table shows a code default: `0.95`, `true`, `3` (for 3.0)."""
    return f"`{str(value).lower().removesuffix('.0')}`"


def check_worker_setting_defaults(rows: dict[str, str]) -> None:
    """Every worker setting the rows name shows the code's default; one without a default shows `–`
    or says where its default comes from (`MAX_CONCURRENCY`: vLLM's `max_num_seqs`)."""
    for field in WorkerSettings.model_fields.values():
        for name in set(field.validation_alias.choices) & rows.keys():
            if field.default is None:
                assert rows[name] == "–" or not re.fullmatch(r"`[^`]*`", rows[name]), name
            else:
                assert rows[name] == default_cell(field.default), name


def test_ci_runs_the_readme_test_command():
    commands = re.search(r"```bash\n(.*?)```", section(README, QUICK_START), re.S).group(1)
    assert [line.split()[0] for line in commands.splitlines()] == ["scripts/serve.sh", "scripts/test.sh"]
    assert "scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def test_worker_settings_table_is_the_codes():
    rows = documented_defaults(section(DOCS / "configuration.md", "Worker settings"))
    settings = {name for field in WorkerSettings.model_fields.values() for name in field.validation_alias.choices}
    assert rows.keys() == settings | {"VLLM_CONFIG_FILE", "LOCAL_MODEL_ARGS_FILE", "LOG_LEVEL"}
    check_worker_setting_defaults(rows)
    assert rows["VLLM_CONFIG_FILE"] == f"`{config_file({})}`"
    assert rows["LOCAL_MODEL_ARGS_FILE"] == f"`{DEFAULT_ARGS_FILE}`"


def test_fitness_checks_table_is_the_codes():
    rows = documented_defaults(section(DOCS / "configuration.md", "Fitness checks"))
    fields = {name: field for field in FitnessSettings.model_fields.values()
              for name in field.validation_alias.choices}
    assert rows.keys() == fields.keys()
    for name, field in fields.items():
        assert rows[name] == ("–" if field.default is None else default_cell(field.default)), name


def test_documented_worker_defaults_are_the_codes():
    precedence = section(DOCS / "configuration.md", "Precedence (highest first)")
    item = re.search(r"^\d+\. \*\*Worker defaults\*\*:(.*?)^\d+\. ", precedence, re.S | re.M).group(1)
    assert dict(re.findall(r"`(\w+)=([^`]*)`", item)) == {dest: str(v) for dest, v in WORKER_DEFAULTS.items()}


def test_readme_main_settings_are_read_by_the_worker_with_their_defaults():
    rows = documented_defaults(section(README, "Configuration essentials"))
    settings = {name for field in WorkerSettings.model_fields.values() for name in field.validation_alias.choices}
    assert rows.keys() <= known_env_names() | settings | {"HF_TOKEN"}
    check_worker_setting_defaults(rows)
    for dest, value in WORKER_DEFAULTS.items():
        if dest.upper() in rows:
            assert rows[dest.upper()] == default_cell(value), dest


def test_every_relative_link_and_anchor_resolves():
    assert {page.name: broken_links(page) for page in pages()} == {page.name: [] for page in pages()}


def test_the_readme_links_every_docs_page():
    linked = {target.partition("#")[0] for target in links(README)}
    assert {f"docs/{page.name}" for page in DOCS.glob("*.md")} <= linked
